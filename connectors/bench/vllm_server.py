"""Time to first token through vLLM's real OpenAI server, the pool through the node's shard.

``run(context, repeats, backends)`` starts, for ``backend="node"``, a pool *outside* the engine's
process as an operator runs it (:class:`~kvpool.connectors.bench.node_pool_proc.NodePool`), then vLLM's
OpenAI server (:class:`~kvpool.connectors.bench.vllm_server_proc.Server`) with the KVPoolConnector on
``backend: "node"`` (vLLM's multiprocess engine: the scheduler and the worker each open their own
NodeClient). ``backend="local"``: the same server with vLLM's engine in-process and the
connector's in-process pool (as ``vllm.LLM`` in-process uses it).

Every request is a prompt of ``context`` token ids (``prompt`` as a list of ints to
``/v1/completions``, ``max_tokens=1``, ``temperature=0``, ``logprobs=1``); ``repeats`` fresh random
prompts P_i. vLLM's own hit and the pool hit are measured **on equal terms**: on the same server,
after the same warm-up, interleaved, each timed the same way:

1. server A: a warm-up prompt W0 (compiles; not counted), a second one W1 (into the pool), then
   each P_i **cold** (nothing cached anywhere; the connector saves its chunks).
2. ``backend="node"``: server A is stopped and server B started: the **pool hit after restart**
   (the pool outside the engine keeps the chunks). ``backend="local"``: the in-process pool dies
   with its server, so vLLM's own cache is emptied instead (``POST /reset_prefix_cache``).
3. warm-up of the measured server, both paths once, not counted: W1 (a pool hit), W1 again (an own hit).
4. per i, one right after the other: P_i, the **pool hit** (vLLM holds none of it: valid only
   when vLLM's ``vllm:prompt_tokens_cached_by_source_total{source="host"}`` grew by the prompt's
   whole chunks, ``min(whole chunks, context - 1)`` tokens, and ``source="device"`` did not), then
   P_i again, **vLLM's own hit** (valid when ``source="device"`` covered the whole blocks before
   the last token).

Medians and ranges over the repeats; pool / native is the median of the per-repeat ratios. The
answers must agree: the same token and log-prob (within 1e-4; the pool and own hit compute the
same last token over the same KV bits, cold computes the whole prompt in other batch shapes) for
cold, own hit and pool hit, and a server that returns no log-probs fails the run.

TTFT is the wall time of the non-streamed HTTP request (``max_tokens=1``: the first token is the
whole answer) on a kept-alive connection, for every case. Beside it, per request, the deltas of
the server's own histograms (``vllm:time_to_first_token_seconds``, ``..._queue_time``,
``..._prefill_time``) say where the time went; the connector's hooks are timed by the server's
``TimedKVPoolConnector``.

NOTE: vLLM's own hit covers whole blocks up to the prompt's last token (4064 of 4096 tokens with
32-token blocks): on the own-hit request the connector still loads the 31-token tail from the
pool (one chunk read, ``native_pool_tokens``).
Everything started here is stopped on exit, on an exception and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
from statistics import median
from typing import Any

from kvpool.connectors.bench.node_pool_proc import CHUNK_TOKENS, TENANT, NodePool, terminated_as_interrupt
from kvpool.connectors.bench.node_pool_proc import log as _log
from kvpool.connectors.bench.vllm_server_proc import BLOCK_SIZE, Server
from kvpool.errors import BadRequest

__all__ = ["NodePool", "Server", "run", "failures", "format_table", "summarize"]


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _measured(server: Server, prompt: list[int]) -> tuple[dict, dict]:
    """The pool hit (vLLM holds nothing of ``prompt``) and, right after it on the same server,
    vLLM's own hit of the same prompt."""
    pool = server.complete(prompt)
    return pool, server.complete(prompt)


def _row(i: int, c: dict, n: dict, p: dict, whole: int, own: int) -> dict[str, Any]:
    lps = [x["logprob"] for x in (c, n, p)]
    have = all(x is not None for x in lps)
    return {"repeat": i, "cold_s": c["ttft_s"], "native_s": n["ttft_s"], "pool_s": p["ttft_s"],
            "pool_vs_native": p["ttft_s"] / n["ttft_s"], "cold_vs_pool": c["ttft_s"] / p["ttft_s"],
            "pool_tokens": p["pool_tokens"], "pool_local_tokens": p["local_tokens"],
            "native_local_tokens": n["local_tokens"], "native_pool_tokens": n["pool_tokens"],
            "cold_cached_tokens": c["local_tokens"] + c["pool_tokens"],
            "pool_hit_valid": p["pool_tokens"] >= whole and p["local_tokens"] == 0
            and c["local_tokens"] + c["pool_tokens"] == 0,
            "native_hit_valid": n["local_tokens"] >= own,
            "same_token": c["token"] == n["token"] == p["token"] and bool(c["token"]),
            "logprobs": lps,
            "logprob_max_diff": (max(lps) - min(lps)) if have else None,
            "pool_vs_native_logprob_diff": abs(p["logprob"] - n["logprob"]) if have else None,
            "tokens": [c["token"], n["token"], p["token"]],
            "server": {k: {f: x[f"server_{f}_s"] for f in ("ttft", "queue", "prefill")}
                       for k, x in (("cold", c), ("native", n), ("pool", p))},
            "connector": {k: x["connector"] for k, x in (("cold", c), ("native", n), ("pool", p))}}


def _measure(start, context: int, repeats: int, vocab: int, seed: int, progress: bool, label: str,
             restart: bool) -> dict[str, Any]:
    """The protocol of the module docstring on servers made by ``start()`` (each closed here, also
    on an exception)."""
    whole = min(context // CHUNK_TOKENS * CHUNK_TOKENS, context - 1)
    own = (context - 1) // BLOCK_SIZE * BLOCK_SIZE  # vLLM's own hit: whole blocks before the last token
    prompts = [_prompt(context, seed + i, vocab) for i in range(repeats)]
    warm = [_prompt(context, seed + 10_000 + k, vocab) for k in range(2)]
    server = start()
    try:
        server.complete(warm[0])  # warm-up (compiles): not counted
        server.complete(warm[1])  # into the pool: the warm-up of the measured server
        colds = []
        for i, p in enumerate(prompts):
            colds.append(server.complete(p))
            _log(f"{label} cold {i}: {colds[-1]['ttft_s']:.3f} s", progress)
        if restart:
            server.close()
            _log(f"{label}: vLLM's server restarted (the pool keeps the prompts)", progress)
            server = start()
        else:
            server.reset_prefix_cache()  # an in-process pool dies with the server: vLLM's own cache emptied instead
        _measured(server, warm[1])  # the same warm-up for both paths: one pool hit, one own hit; not counted
        rows = []
        for i, p in enumerate(prompts):
            pool, native = _measured(server, p)
            rows.append(_row(i, colds[i], native, pool, whole, own))
            r = rows[-1]
            _log(f"{label} repeat {i}: pool {r['pool_s']:.3f} s, native {r['native_s']:.3f} s "
                 f"({r['pool_vs_native']:.2f}x native), pool tokens {r['pool_tokens']}, same token {r['same_token']}, "
                 f"log-prob diff {r['logprob_max_diff']}", progress)
    except Exception:
        print(f"--- the vLLM server's log ({label}), its end:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.close()
    return summarize(rows, whole)


def summarize(rows: list[dict], whole: int) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float]:
        v = [r[key] for r in rows]
        return {"median": median(v), "min": min(v), "max": max(v)}

    diffs = [r["logprob_max_diff"] for r in rows if r["logprob_max_diff"] is not None]
    pn = [r["pool_vs_native_logprob_diff"] for r in rows if r["pool_vs_native_logprob_diff"] is not None]
    return {"repeats": rows, "expected_pool_tokens": whole,
            **{k: stat(k) for k in ("cold_s", "native_s", "pool_s", "pool_vs_native", "cold_vs_pool")},
            "server_median": {case: {f: median(r["server"][case][f] for r in rows) for f in ("ttft", "queue", "prefill")}
                              for case in ("cold", "native", "pool")},
            "connector_median": {case: {k: median(r["connector"][case].get(k, 0.0) for r in rows)
                                        for k in sorted({k for r in rows for k in r["connector"][case]})}
                                 for case in ("cold", "native", "pool")},
            "valid": all(r["pool_hit_valid"] and r["native_hit_valid"] for r in rows),
            # NOTE: log-probs are part of the answer: a server that gives none fails the comparison
            "same_answers": all(r["same_token"] for r in rows) and len(diffs) == len(rows) and max(diffs) <= 1e-4,
            "logprob_max_diff": max(diffs) if diffs else None,
            "pool_vs_native_logprob_diff": max(pn) if pn else None}


def run(context: int = 4096, repeats: int = 5, backends: tuple[str, ...] = ("node", "local"), *,
        tiny: bool = False, progress: bool = True, seed: int = 0, model: str = "random",
        pool_factory=None) -> dict[str, Any]:
    """One server per backend, one after the other (never two at once on a small machine); see the
    module docstring. ``model``: ``random``, the benchmark Llama (16 KiB of KV per token), or
    ``qwen2``, a small Qwen2 shape (7.5 KiB); ``tiny``: the engine tests' 2-layer Llama.
    ``pool_factory(page_bytes, dram_pages, progress)``: the "node" backend's pool (default
    node_pool_proc.NodePool; connectors/bench/pool_modes.py passes the CLI's pools)."""
    if model not in ("random", "qwen2"):
        raise BadRequest(f"model {model!r}: the server benchmark runs 'random' or 'qwen2'")
    for b in backends:
        if b not in ("node", "local"):
            raise BadRequest(f"backend {b!r}: the server benchmark runs 'node' or 'local'")
    if repeats < 1 or context <= CHUNK_TOKENS:
        raise BadRequest(f"--repeats at least 1 and --context more than one chunk ({CHUNK_TOKENS} tokens)")
    result: dict[str, Any] = {"engine": "vllm-server", "context": context, "chunk_tokens": CHUNK_TOKENS,
                              "block_size": BLOCK_SIZE, "repeats": repeats,
                              "ttft": "wall time of a non-streamed POST /v1/completions, max_tokens=1",
                              "protocol": "cold on server A; pool hit then own hit of each prompt, interleaved, on "
                                          "the restarted server B after one warm-up of both paths",
                              "backends": {}}
    with terminated_as_interrupt():
        return _run(result, context, repeats, backends, tiny, progress, seed, model, pool_factory or NodePool)


def _start(model_dir: str, config: dict, context: int, workdir: str, backend: str, to_close: list, starts: list,
           progress: bool) -> Server:
    """A vLLM server on ``config``, healthy (its start time appended to ``starts``); it is in
    ``to_close`` (closing twice is harmless)."""
    _log(f"vLLM server, backend {backend}", progress)
    server = Server(model_dir, config, context, workdir, multiprocess=backend == "node")
    to_close.append(server)
    starts.append(server.wait_healthy())
    _log(f"server up in {starts[-1]:.0f} s", progress)
    return server


def _run(result: dict[str, Any], context: int, repeats: int, backends: tuple[str, ...], tiny: bool, progress: bool,
         seed: int, model_name: str = "random", pool_factory=NodePool) -> dict[str, Any]:
    import torch

    from kvpool.connectors.bench.ttft import bench_model, small_qwen2

    workdir = tempfile.mkdtemp(prefix="kvpool-ttft-server-")
    to_close: list = []
    try:
        model_dir = os.path.join(workdir, "model")
        model = small_qwen2() if model_name == "qwen2" else bench_model()
        if tiny:
            from kvpool.connectors.hf_model import tiny_llama

            model = tiny_llama(0, layers=2, hidden=256, heads=4, kv_heads=2, vocab=1024)
        model.save_pretrained(model_dir)
        cfg = model.config
        vocab = cfg.vocab_size
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        chunk_bytes = cfg.num_hidden_layers * 2 * CHUNK_TOKENS * cfg.num_key_value_heads * head_dim * 4
        chunks = (repeats + 2) * -(-context // CHUNK_TOKENS) + 8
        result["model"] = {"name": "tiny" if tiny else model_name, "arch": type(model).__name__,
                           "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                           "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                           "head_dim": head_dim, "vocab": vocab, "dtype": "float32", "chunk_bytes": chunk_bytes}
        del model
        torch.set_flush_denormal(True)
        for backend in backends:
            pool = None
            if backend == "node":
                heads = cfg.num_key_value_heads  # a page a slice: one KV head's chunk (kvpool.slices)
                pool = pool_factory(1 << max(chunk_bytes // heads - 1, 1).bit_length(), chunks * heads, progress)
                to_close.append(pool)
                pool.start()
                config = pool.connector_config()
            else:
                config = {"backend": "local", "pool": "bench", "chunk_tokens": CHUNK_TOKENS,
                          "dram_mib": chunks * chunk_bytes // (1 << 20) + 64, "tenants": [TENANT]}
            starts: list[float] = []
            start = functools.partial(_start, model_dir, config, context, workdir, backend, to_close, starts, progress)
            r = _measure(start, context, repeats, vocab, seed, progress, backend, restart=backend == "node")
            r.update({"server_start_s": starts,
                      "engine": "multiprocess (scheduler and worker apart)" if backend == "node" else "in-process",
                      "pool_hit_after": "a restart of vLLM's server" if backend == "node" else
                      "POST /reset_prefix_cache (the in-process pool lives in the server)",
                      "index": pool.index if pool else None})
            result["backends"][backend] = r
            if pool is not None:
                pool.close()
                to_close.remove(pool)
    finally:
        # NOTE: a second Ctrl-C or SIGTERM must not cut the teardown short (a starting vLLM server
        # may take its 30 s to stop): ignored until everything is down
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for x in reversed(to_close):
            with contextlib.suppress(Exception):
                x.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def failures(result: dict[str, Any]) -> list[str]:
    why = []
    for b, r in result["backends"].items():
        if not r["valid"]:
            bad = [x["repeat"] for x in r["repeats"] if not x["pool_hit_valid"]]
            own = [x["repeat"] for x in r["repeats"] if not x["native_hit_valid"]]
            why.append(f"{b}: repeats {bad} did not load the prompt's {r['expected_pool_tokens']} tokens from the "
                       f"pool (or the cold request was not cold, or vLLM already held the prompt), repeats {own} were "
                       "not vLLM's own hits: INVALID run")
        if not r["same_answers"]:
            why.append(f"{b}: the answers differ between cold, native and pool, or came without log-probs (tokens "
                       f"{[x['tokens'] for x in r['repeats']]}, log-prob diff {r['logprob_max_diff']})")
    return why


def format_table(result: dict[str, Any]) -> str:
    lines = [f"vLLM server, context {result['context']}, TTFT = {result['ttft']}"]
    for b, r in result["backends"].items():
        lines.append(f"\nbackend {b} ({r['engine']} engine, index {r['index']}):")
        lines.append(f"{'repeat':>6}{'cold s':>9}{'native s':>10}{'pool s':>9}{'pool/native':>13}{'cold/pool':>11}"
                     f"{'pool tok':>10}  same")
        for x in r["repeats"]:
            lines.append(f"{x['repeat']:>6}{x['cold_s']:>9.3f}{x['native_s']:>10.3f}{x['pool_s']:>9.3f}"
                         f"{x['pool_vs_native']:>12.2f}x{x['cold_vs_pool']:>10.1f}x{x['pool_tokens']:>10}"
                         f"  {x['same_token']}")
        lines.append(f"{'median':>6}{r['cold_s']['median']:>9.3f}{r['native_s']['median']:>10.3f}"
                     f"{r['pool_s']['median']:>9.3f}{r['pool_vs_native']['median']:>12.2f}x"
                     f"{r['cold_vs_pool']['median']:>10.1f}x")
        lines.append(f"pool/native range {r['pool_vs_native']['min']:.2f}-{r['pool_vs_native']['max']:.2f}x; "
                     f"valid {r['valid']}; same answers {r['same_answers']} (log-prob diff: all three "
                     f"{r['logprob_max_diff']}, pool vs native {r['pool_vs_native_logprob_diff']}); pool hit after "
                     f"{r['pool_hit_after']}")
        sm = r["server_median"]
        lines.append("server-side medians (s): " + "; ".join(
            f"{c}: ttft {sm[c]['ttft']:.4f}, queue {sm[c]['queue']:.4f}, prefill {sm[c]['prefill']:.4f}"
            for c in ("cold", "native", "pool")))
        cm = r["connector_median"]
        lines.append("connector medians (s): " + "; ".join(
            f"{c}: " + ", ".join(f"{k} {v:.4f}" for k, v in cm[c].items() if k != "loaded_tokens" and v >= 5e-4)
            for c in ("native", "pool")))
    return "\n".join(lines)
