"""Time to first token through vLLM's real OpenAI server, the pool on the node path (issue 17).

``run(context, repeats, backends)`` starts, for ``backend="node"``, a pool *outside* the engine's
process as an operator runs it (:class:`~kvpool.connectors.node_pool_proc.NodePool`), then vLLM's
OpenAI server (:class:`~kvpool.connectors.vllm_server_proc.Server`) with the KVPoolConnector on
``backend: "node"`` (vLLM's multiprocess engine: the scheduler and the worker each open their own
NodeClient). ``backend="local"``: the same server with vLLM's engine in-process and the
connector's in-process pool (what the issue 7 numbers used, there through ``vllm.LLM``).

Per repeat, a fresh random prompt of ``context`` token ids (``prompt`` as a list of ints to
``/v1/completions``, ``max_tokens=1``, ``temperature=0``, ``logprobs=1``):

a. **cold**: the first request (nothing cached anywhere; the connector saves its chunks);
b. **native**: the same prompt again: vLLM's own prefix-cache hit;
c. ``POST /reset_prefix_cache``, then the same prompt: the **pool** hit. Valid only when vLLM's
   ``vllm:prompt_tokens_cached_by_source_total{source="host"}`` grew by the prompt's whole chunks
   (the last token is always computed: ``min(whole chunks, context - 1)`` tokens).

TTFT is the wall time of the non-streamed HTTP request (``max_tokens=1``: the first token is the
whole answer) on a kept-alive connection. Beside it, per request, the deltas of the server's own
histograms (``vllm:time_to_first_token_seconds``, ``..._queue_time``, ``..._prefill_time``) say
where the time went. One warm-up round (cold, native, reset, pool) runs first and is not counted.
The connector's hooks are timed by the server's ``TimedKVPoolConnector``.

NOTE: vLLM's own hit covers whole blocks up to the prompt's last token (4064 of 4096 tokens with
32-token blocks): on the native request the connector still loads the 31-token tail from the pool
(one chunk read, ``native_pool_tokens``). The issue 7 numbers measured the same.
Everything started here is stopped on exit, on an exception and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from statistics import median
from typing import Any

from kvpool.connectors.node_pool_proc import CHUNK_TOKENS, TENANT, NodePool, terminated_as_interrupt
from kvpool.connectors.node_pool_proc import log as _log
from kvpool.connectors.vllm_server_proc import BLOCK_SIZE, Server
from kvpool.errors import BadRequest

__all__ = ["NodePool", "Server", "run", "failures", "format_table", "summarize"]


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _round(server: Server, prompt: list[int]) -> dict[str, dict]:
    cold = server.complete(prompt)
    native = server.complete(prompt)
    server.reset_prefix_cache()
    pool = server.complete(prompt)
    return {"cold": cold, "native": native, "pool": pool}


def _measure(server: Server, context: int, repeats: int, vocab: int, seed: int, progress: bool,
             label: str) -> dict[str, Any]:
    whole = min(context // CHUNK_TOKENS * CHUNK_TOKENS, context - 1)
    _round(server, _prompt(context, seed + 10_000, vocab))  # warm-up: not counted
    rows = []
    for i in range(repeats):
        r = _round(server, _prompt(context, seed + i, vocab))
        c, n, p = r["cold"], r["native"], r["pool"]
        lps = [x["logprob"] for x in (c, n, p) if x["logprob"] is not None]
        row = {"repeat": i, "cold_s": c["ttft_s"], "native_s": n["ttft_s"], "pool_s": p["ttft_s"],
               "pool_vs_native": p["ttft_s"] / n["ttft_s"], "cold_vs_pool": c["ttft_s"] / p["ttft_s"],
               "pool_tokens": p["pool_tokens"], "pool_local_tokens": p["local_tokens"],
               "native_local_tokens": n["local_tokens"], "native_pool_tokens": n["pool_tokens"],
               "cold_cached_tokens": c["local_tokens"] + c["pool_tokens"],
               "pool_hit_valid": p["pool_tokens"] >= whole and c["local_tokens"] + c["pool_tokens"] == 0,
               "same_token": c["token"] == n["token"] == p["token"] and bool(c["token"]),
               "logprob_max_diff": (max(lps) - min(lps)) if len(lps) == 3 else None,
               "tokens": [c["token"], n["token"], p["token"]],
               "server": {k: {f: x[f"server_{f}_s"] for f in ("ttft", "queue", "prefill")}
                          for k, x in (("cold", c), ("native", n), ("pool", p))},
               "connector": {k: x["connector"] for k, x in (("cold", c), ("native", n), ("pool", p))}}
        rows.append(row)
        _log(f"{label} repeat {i}: cold {row['cold_s']:.3f} s, native {row['native_s']:.3f} s, pool "
             f"{row['pool_s']:.3f} s ({row['pool_vs_native']:.2f}x native), pool tokens {row['pool_tokens']}, "
             f"same token {row['same_token']}", progress)
    return summarize(rows, whole)


def summarize(rows: list[dict], whole: int) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float]:
        v = [r[key] for r in rows]
        return {"median": median(v), "min": min(v), "max": max(v)}

    diffs = [r["logprob_max_diff"] for r in rows if r["logprob_max_diff"] is not None]
    return {"repeats": rows, "expected_pool_tokens": whole,
            **{k: stat(k) for k in ("cold_s", "native_s", "pool_s", "pool_vs_native", "cold_vs_pool")},
            "server_median": {case: {f: median(r["server"][case][f] for r in rows) for f in ("ttft", "queue", "prefill")}
                              for case in ("cold", "native", "pool")},
            "connector_median": {case: {k: median(r["connector"][case].get(k, 0.0) for r in rows)
                                        for k in sorted({k for r in rows for k in r["connector"][case]})}
                                 for case in ("cold", "native", "pool")},
            "valid": all(r["pool_hit_valid"] for r in rows),
            "same_answers": all(r["same_token"] for r in rows) and (not diffs or max(diffs) <= 1e-4),
            "logprob_max_diff": max(diffs) if diffs else None}


def run(context: int = 4096, repeats: int = 5, backends: tuple[str, ...] = ("node", "local"), *,
        tiny: bool = False, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """One server per backend, one after the other (never two at once on a small machine); see the
    module docstring. ``tiny``: the engine tests' 2-layer Llama instead of the benchmark model."""
    for b in backends:
        if b not in ("node", "local"):
            raise BadRequest(f"backend {b!r}: the server benchmark runs 'node' or 'local'")
    if repeats < 1 or context <= CHUNK_TOKENS:
        raise BadRequest(f"--repeats at least 1 and --context more than one chunk ({CHUNK_TOKENS} tokens)")
    result: dict[str, Any] = {"engine": "vllm-server", "context": context, "chunk_tokens": CHUNK_TOKENS,
                              "block_size": BLOCK_SIZE, "repeats": repeats,
                              "ttft": "wall time of a non-streamed POST /v1/completions, max_tokens=1",
                              "backends": {}}
    with terminated_as_interrupt():
        return _run(result, context, repeats, backends, tiny, progress, seed)


def _run(result: dict[str, Any], context: int, repeats: int, backends: tuple[str, ...], tiny: bool, progress: bool,
         seed: int) -> dict[str, Any]:
    import torch

    from kvpool.connectors.bench_ttft import bench_model

    workdir = tempfile.mkdtemp(prefix="kvpool-ttft-server-")
    to_close: list = []
    try:
        model_dir = os.path.join(workdir, "model")
        model = bench_model()
        if tiny:
            from kvpool.connectors.hf import tiny_llama

            model = tiny_llama(0, layers=2, hidden=256, heads=4, kv_heads=2, vocab=1024)
        model.save_pretrained(model_dir)
        cfg = model.config
        vocab = cfg.vocab_size
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        chunk_bytes = cfg.num_hidden_layers * 2 * CHUNK_TOKENS * cfg.num_key_value_heads * head_dim * 4
        chunks = (repeats + 2) * -(-context // CHUNK_TOKENS) + 8
        result["model"] = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                           "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                           "head_dim": head_dim, "vocab": vocab, "dtype": "float32", "chunk_bytes": chunk_bytes}
        del model
        torch.set_flush_denormal(True)
        for backend in backends:
            pool = None
            if backend == "node":
                pool = NodePool(1 << max(chunk_bytes - 1, 1).bit_length(), chunks, progress)
                to_close.append(pool)
                pool.start()
                config = pool.connector_config()
            else:
                config = {"backend": "local", "pool": "bench", "chunk_tokens": CHUNK_TOKENS,
                          "dram_mib": chunks * chunk_bytes // (1 << 20) + 64, "tenants": [TENANT]}
            _log(f"vLLM server, backend {backend}", progress)
            server = Server(model_dir, config, context, workdir, multiprocess=backend == "node")
            to_close.append(server)
            start_s = server.wait_healthy()
            _log(f"server up in {start_s:.0f} s", progress)
            try:
                r = _measure(server, context, repeats, vocab, seed, progress, backend)
            except Exception:
                print(f"--- the vLLM server's log (backend {backend}), its end:\n{server.log_tail()}",
                      file=sys.stderr)
                raise
            r.update({"server_start_s": start_s,
                      "engine": "multiprocess (scheduler and worker apart)" if backend == "node" else "in-process",
                      "index": pool.index if pool else None})
            result["backends"][backend] = r
            server.close()
            to_close.remove(server)
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
            why.append(f"{b}: repeats {bad} did not load the prompt's {r['expected_pool_tokens']} tokens from the "
                       "pool (or the cold request was not cold): INVALID run")
        if not r["same_answers"]:
            why.append(f"{b}: the answers differ between cold, native and pool (logprob diff {r['logprob_max_diff']})")
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
                     f"valid {r['valid']}; same answers {r['same_answers']} (logprob diff {r['logprob_max_diff']})")
        sm = r["server_median"]
        lines.append("server-side medians (s): " + "; ".join(
            f"{c}: ttft {sm[c]['ttft']:.4f}, queue {sm[c]['queue']:.4f}, prefill {sm[c]['prefill']:.4f}"
            for c in ("cold", "native", "pool")))
        cm = r["connector_median"]
        lines.append("connector medians (s): " + "; ".join(
            f"{c}: " + ", ".join(f"{k} {v:.4f}" for k, v in cm[c].items() if k != "loaded_tokens" and v >= 5e-4)
            for c in ("native", "pool")))
    return "\n".join(lines)
