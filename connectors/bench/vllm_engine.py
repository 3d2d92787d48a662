"""Time to first token with vLLM: cold, warm from the pool in a fresh engine, and vLLM's own hit.

``measure_ttft(context_tokens, model)`` measures vLLM's own prefix-cache hit and the pool hit on
equal terms, the protocol of the server benchmark (:mod:`kvpool.connectors.bench.vllm_server`), in
this process and one engine after the other:

1. engine A (prefix caching on, KVPoolConnector on an in-process pool of its own): a warm-up
   prompt of the same length (compiles, and calibrates the load-or-recompute figures), a second
   one (into the pool, for engine B's warm-up), then the context **cold** once per repeat
   (nothing cached anywhere; the connector saves its chunks);
2. engine A is shut down (the restart); engine B starts fresh on the same pool and warms up both
   paths once with the second warm-up prompt (a pool hit, then vLLM's own hit); then per repeat,
   one right after the other: the context **from the pool** (vLLM has nothing, the connector
   loads the prefix) and the context again: **vLLM's own prefix-cache hit**. Same engine, same
   warm-up, interleaved.

Each TTFT is the wall time of a ``generate`` with one output token. ``same_output`` says whether
every run produced the first cold run's tokens and log-probs (``logprob_max_diff``, and
``pool_vs_native_logprob_diff`` between the two hits of each repeat); ``warm_load_s`` is a pool
hit's load (pool read ``warm_load_pool_s`` + copy into vLLM's blocks), medians.

NOTE: vLLM's own hit can only cover whole blocks up to the prompt's last token, so on the native
run the connector may still load the sub-block tail (``native_pool_tokens``, at most a block).
NOTE: the pool is in-process (``backend="local"``), so the engine must run in-process too:
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here when unset). Only one engine with a KV connector
can live in a process at a time (vLLM keeps its worker connector in a global).
"""

from __future__ import annotations

import gc
import os
import time
import uuid
from statistics import median
from typing import Any

from kvpool.errors import BadRequest


def scheduler_connector(llm):
    """The scheduler-side KVPoolConnector of an in-process ``vllm.LLM`` (its counters)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector():
    """This process's worker-side connector (vLLM keeps one per process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def shutdown_engine(llm) -> None:
    """Stops an in-process engine so another can start in this process."""
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()  # a no-op when the worker's shutdown already did it
    gc.collect()


def make_engine(model: str, pool_config: dict[str, Any], *, block_size: int = 32, dtype: str = "float32",
                max_model_len: int | None = None, enable_prefix_caching: bool = True, **engine_args: Any):
    """An in-process ``vllm.LLM`` with KVPoolConnector on ``pool_config`` (prompts as token ids)."""
    from vllm import LLM

    from kvpool.connectors.vllm import kv_transfer_config

    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0" and \
            pool_config.get("backend", "local") == "local":
        raise BadRequest("an in-process kvpool ('local' backend) needs VLLM_ENABLE_V1_MULTIPROCESSING=0; "
                         "or use backend 'node'")
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    if has_kv_transfer_group():
        raise BadRequest("another vLLM engine with a KV connector is alive in this process: "
                         "shutdown_engine(it) first")
    try:
        return LLM(model=model, skip_tokenizer_init=True, dtype=dtype, block_size=block_size, enforce_eager=True,
                   enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                   kv_transfer_config=kv_transfer_config(**pool_config), **engine_args)
    except BaseException:
        # NOTE: an engine that fails after its worker built the connector (a refused cache layout)
        # leaves vLLM's process-wide connector behind, and the next engine here would be refused
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        raise


def _timed(llm, tokens: list[int], salt: str | None = None, logprobs: int = 1):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=logprobs)
    prompt = {"prompt_token_ids": list(tokens), **({"cache_salt": salt} if salt else {})}
    t0 = time.perf_counter()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    o = out.outputs[0]
    lps = [d[t].logprob for t, d in zip(o.token_ids, o.logprobs or [])]
    return dt, list(o.token_ids), lps, int(out.num_cached_tokens or 0)


def _delta(llm, before: dict, key: str) -> int:
    return scheduler_connector(llm).stats().get(key, 0) - before.get(key, 0)


def measure_ttft(context_tokens: list[int], model: str, *, chunk_tokens: int = 256, block_size: int = 32,
                 dtype: str = "float32", dram_mib: int = 1024, repeats: int = 5, seed: int = 0,
                 **engine_args: Any) -> dict[str, Any]:
    """Cold, pool hit (fresh engine) and vLLM's own hit of one context, on equal terms; see the
    module docstring. ``model`` is a local model directory or name vLLM can load without a tokenizer.

    Each of the ``repeats`` is a tenant of its own, sending its request secret as ``cache_salt``,
    so its cold run is cold for vLLM and for the pool; medians and every run are reported (on a
    shared machine single runs vary several-fold). Engine arguments (``max_model_len``, ...) pass
    through to ``vllm.LLM``."""
    import numpy as np

    n = len(context_tokens)
    if n <= chunk_tokens:
        raise BadRequest(f"the context has {n} tokens; measure_ttft needs more than one chunk ({chunk_tokens})")
    if repeats < 1:
        raise BadRequest(f"repeats={repeats}: measure at least once")
    salts = [f"kvpool-ttft-repeat-{i}" for i in range(repeats)]
    pool = {"backend": "local", "pool": f"ttft-{uuid.uuid4().hex[:8]}", "chunk_tokens": chunk_tokens,
            "dram_mib": dram_mib,
            "tenants": ["default", *({"id": f"ttft-{i}", "request_secret": s} for i, s in enumerate(salts))]}
    rng = np.random.default_rng(seed)
    warmups = [[int(t) for t in rng.integers(3, max(max(context_tokens) + 1, 4), n)] for _ in range(2)]
    max_len = engine_args.pop("max_model_len", None) or max(2048, n + 16)
    cold, native, warm, loaded, native_pool = [], [], [], [], []

    t0 = time.perf_counter()
    llm = make_engine(model, pool, block_size=block_size, dtype=dtype, max_model_len=max_len, **engine_args)
    start_s = time.perf_counter() - t0
    try:
        _timed(llm, warmups[0])  # compiles; calibrates the load-or-recompute figures
        _timed(llm, warmups[1])  # into the pool: engine B's warm-up
        for salt in salts:
            cold.append(_timed(llm, context_tokens, salt))
    finally:
        shutdown_engine(llm)
        del llm
    llm = make_engine(model, pool, block_size=block_size, dtype=dtype, max_model_len=max_len, **engine_args)
    try:
        _timed(llm, warmups[1])  # the same warm-up for both paths: a pool hit,
        _timed(llm, warmups[1])  # then an own hit
        for salt in salts:
            s0 = dict(scheduler_connector(llm).stats())
            warm.append(_timed(llm, context_tokens, salt))  # vLLM holds none of it: the pool hit
            s1 = dict(scheduler_connector(llm).stats())
            native.append(_timed(llm, context_tokens, salt))  # the same again: vLLM's own hit
            loaded.append({key: s1.get(key, 0) - s0.get(key, 0) for key in ("loaded_tokens", "load_us", "load_pool_us")})
            native_pool.append(_delta(llm, s1, "matched_tokens"))
        breakeven = scheduler_connector(llm).stats().get("breakeven")
        groups = len(scheduler_connector(llm).groups)
    finally:
        shutdown_engine(llm)
        del llm
    ref_tokens, ref_lp = cold[0][1], cold[0][2]
    diff = max((abs(a - b) for r in (*cold, *warm, *native) for a, b in zip(ref_lp, r[2])), default=0.0)
    pool_vs_native = max((abs(a - b) for w, x in zip(warm, native) for a, b in zip(w[2], x[2])), default=0.0)
    same = all(r[1] == ref_tokens and len(r[2]) == len(ref_tokens) for r in (*cold, *warm, *native))
    k = len(salts)
    return {
        "context_tokens": n, "chunk_tokens": chunk_tokens, "repeats": k,
        "protocol": "cold in engine A; pool hit then own hit of each repeat, interleaved, in the fresh engine B "
                    "after one warm-up of both paths",
        "cold_ttft_s": median([c[0] for c in cold]), "warm_ttft_s": median([w[0] for w in warm]),
        "native_hit_ttft_s": median([x[0] for x in native]),
        "warm_vs_native": median([w[0] / x[0] for w, x in zip(warm, native)]),
        "cold_runs_s": [c[0] for c in cold], "warm_runs_s": [w[0] for w in warm],
        "native_runs_s": [x[0] for x in native],
        "same_output": same and bool(ref_lp) and diff <= 1e-4, "logprob_max_diff": diff,
        "pool_vs_native_logprob_diff": pool_vs_native,
        "cold_tokens": ref_tokens, "warm_loaded_tokens": min(x["loaded_tokens"] for x in loaded), "warm_cached_tokens": min(w[3] for w in warm),
        "native_cached_tokens": min(x[3] for x in native), "native_pool_tokens": max(native_pool),
        "warm_load_s": median(x["load_us"] for x in loaded) / 1e6,
        "warm_load_pool_s": median(x["load_pool_us"] for x in loaded) / 1e6,
        "engine_start_s": start_s, "breakeven": breakeven, "kv_cache_groups": groups,
    }
