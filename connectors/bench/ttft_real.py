"""``kvpool bench ttft --model smollm2``: time to first token on the real model, with and without the pool.

The prompts are real English: consecutive, non-overlapping slices of the Python documentation's
topic pages that ship with Python (``pydoc_data.topics``), each wrapped in SmolLM2's chat template
with a question after it (so the greedy answer is an answer, not noise). Each context gets a slice
of its own, so no prompt shares a prefix with another: every cold request is cold.

SmolLM2-135M-Instruct has 8192 positions (``max_position_embeddings``): a context and its answer
must fit in them, so a context asked above ``8192 - answer`` is measured at that length (the row
keeps what was asked in ``asked_context``), and one above 8192 is refused.

- ``hf``: :func:`kvpool.connectors.bench.ttft.run_hf` on the real model (cold: no pool; warm: the
  prefix loaded from the pool; ``same_output``: the greedy answers are identical).
- ``vllm``: :func:`kvpool.connectors.bench.ttft.run_vllm` on the real model's checkpoint.
- ``vllm-server``: :func:`run_server` here: vLLM's own OpenAI server, streamed requests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from kvpool.errors import BadRequest

ANSWER_TOKENS = 16
CHUNK_TOKENS = 256
QUESTION = "\n\nIn one sentence: what is the text above about?"
PLACEHOLDER = "\x00"


def max_positions() -> int:
    """The model's ``max_position_embeddings`` (8192), read from its checkpoint's config."""
    from kvpool.connectors.demo import smollm2

    with open(smollm2.checkpoint() / "config.json") as f:
        return int(json.load(f)["max_position_embeddings"])


def fit(contexts: list[int], answer_tokens: int = ANSWER_TOKENS) -> list[tuple[int, int]]:
    """``(asked, measured)`` per context: a context plus its answer must fit the model's positions."""
    limit = max_positions()
    out = []
    for c in contexts:
        if c > limit or c <= CHUNK_TOKENS:
            raise BadRequest(f"--context {c}: SmolLM2 takes more than one chunk ({CHUNK_TOKENS} tokens) and at most "
                             f"{limit} positions; e.g. --context 1024,4096,8192 (8192 is measured at "
                             f"{limit - answer_tokens}, leaving room for the answer)")
        out.append((c, min(c, limit - answer_tokens)))
    return out


def _document_ids(needed: int) -> list[int]:
    """At least ``needed`` tokens of the documentation (topic pages in order, tokenized one by one:
    the whole text takes seconds), or all there is."""
    import pydoc_data.topics as topics

    from kvpool.connectors.demo import smollm2

    tok, out = smollm2.tokenizer(), []
    for name in sorted(topics.topics):
        if len(out) >= needed:
            break
        out += tok(topics.topics[name].strip() + "\n\n", add_special_tokens=False)["input_ids"]
    return out


def prompts(lengths: list[int]) -> list[list[int]]:
    """One chat prompt of exactly each length: the template, a slice of documentation of its own, the
    question. Slices follow each other, so no two prompts share a prefix."""
    from kvpool.connectors.demo import smollm2

    tok = smollm2.tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True,
                                   tokenize=False)
    before, after = text.split(PLACEHOLDER)
    head = tok(before, add_special_tokens=False)["input_ids"]
    tail = tok(QUESTION + after, add_special_tokens=False)["input_ids"]
    doc = _document_ids(sum(lengths))
    out, at = [], 0
    for n in lengths:
        body = n - len(head) - len(tail)
        if body < 1 or at + body > len(doc):
            raise BadRequest(f"contexts {lengths}: the documentation holds {len(doc)} tokens; ask for fewer or "
                             "shorter contexts")
        out.append([*head, *doc[at:at + body], *tail])
        at += body
    return out


def answer_text(tokens: list[int]) -> str:
    from kvpool.connectors.demo import smollm2

    return smollm2.tokenizer().decode(tokens, skip_special_tokens=True)


# ---------------------------------------------------------------- vLLM's OpenAI server
def stream(port: int, tokens: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One streamed ``/v1/completions`` (greedy, ``max_tokens`` answer tokens, EOS ignored so both
    engines answer the same length): seconds to the first answer token, and the answer's ids."""
    body = {"model": "bench", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"/v1/completions answered {r.status}: {r.read()[:500]!r}")
        ttft, out = None, []
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            for choice in json.loads(data).get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                out += [int(t) for t in ids]
        if ttft is None:
            raise RuntimeError("the server streamed no token")
        return ttft, out
    finally:
        conn.close()


def _metrics(server) -> dict[str, float]:
    """The server's figures; its kept-alive connection may have been closed by the server while a
    long streamed request ran on another: then once more on a fresh one."""
    try:
        return server.metrics()
    except (OSError, http.client.HTTPException):
        return server.metrics()


def _cached(server, before: dict[str, float]) -> tuple[int, int]:
    """(tokens vLLM found in its own prefix cache, tokens loaded from the pool) for the request
    just finished (the engine publishes a request's figures after its last step: wait for them)."""
    deadline = time.monotonic() + 5
    while True:
        after = _metrics(server)
        if after.get("time_to_first_token_seconds_count", 0) > before.get("time_to_first_token_seconds_count", 0) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return (int(after.get("cached_device", 0) - before.get("cached_device", 0)),
            int(after.get("cached_host", 0) - before.get("cached_host", 0)))


def _request(server, tokens: list[int], answer_tokens: int) -> dict[str, Any]:
    before = _metrics(server)
    ttft, answer = stream(server.port, tokens, answer_tokens)
    local, pool = _cached(server, before)
    return {"ttft_s": ttft, "answer": answer, "local_tokens": local, "pool_tokens": pool}


def _row(server, asked: int, tokens: list[int], answer_tokens: int, backend: str) -> dict[str, Any]:
    """Cold (the first request: nothing cached, the connector saves the chunks), vLLM's own
    prefix-cache hit, then after ``/reset_prefix_cache`` the pool hit; their answers compared."""
    cold = _request(server, tokens, answer_tokens)
    native = _request(server, tokens, answer_tokens)
    server.reset_prefix_cache()
    pool = _request(server, tokens, answer_tokens)
    n = len(tokens)
    whole = min(n // CHUNK_TOKENS * CHUNK_TOKENS, n - 1)
    return {"engine": "vllm-server", "model": "smollm2", "backend": backend, "context": n, "asked_context": asked,
            "cold_ttft_s": cold["ttft_s"], "native_hit_ttft_s": native["ttft_s"], "warm_ttft_s": pool["ttft_s"],
            "speedup": cold["ttft_s"] / pool["ttft_s"], "warm_vs_native": pool["ttft_s"] / native["ttft_s"],
            "loaded_tokens": pool["pool_tokens"], "expected_pool_tokens": whole,
            "pool_hit_valid": pool["pool_tokens"] >= whole and cold["local_tokens"] + cold["pool_tokens"] == 0,
            "same_output": cold["answer"] == native["answer"] == pool["answer"] and len(cold["answer"]) == answer_tokens,
            "answer_tokens": cold["answer"], "answer": answer_text(cold["answer"])}


def run_server(contexts: list[int], backend: str = "node", *, answer_tokens: int = ANSWER_TOKENS,
               progress: bool = True) -> list[dict[str, Any]]:
    """One vLLM server on the real model's checkpoint (``backend`` node: a pool started outside it,
    vLLM's multiprocess engine; local: the connector's in-process pool), every context in turn after
    one warm-up round that is not counted."""
    from kvpool.connectors.bench.node_pool_proc import NodePool, log, terminated_as_interrupt
    from kvpool.connectors.bench.vllm_server_proc import Server
    from kvpool.connectors.demo import smollm2
    from kvpool.progress import Progress

    if backend not in ("node", "local"):
        raise BadRequest(f"--backend {backend!r}: the server benchmark runs node or local")
    sizes = fit(contexts, answer_tokens)
    ckpt = str(smollm2.checkpoint())
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    chunk_bytes = cfg["num_hidden_layers"] * 2 * CHUNK_TOKENS * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    warmup = 1024
    texts = prompts([m for _, m in sizes] + [warmup])  # the warm-up's last: the rest are the hf rows' prompts
    chunks = sum(-(-len(p) // CHUNK_TOKENS) for p in texts) + 8
    workdir = tempfile.mkdtemp(prefix="kvpool-ttft-real-")
    to_close: list = []
    rows = []
    with terminated_as_interrupt():
        try:
            if backend == "node":
                heads = cfg["num_key_value_heads"]  # a page a slice: one KV head's chunk (kvpool.slices)
                pool = NodePool(1 << max(chunk_bytes // heads - 1, 1).bit_length(), chunks * heads, progress)
                to_close.append(pool)
                pool.start()
                config = pool.connector_config()
            else:
                config = {"backend": "local", "pool": "bench", "chunk_tokens": CHUNK_TOKENS,
                          "dram_mib": chunks * chunk_bytes // (1 << 20) + 64, "tenants": ["default"]}
            log(f"vLLM server on SmolLM2-135M-Instruct, backend {backend}", progress)
            server = Server(ckpt, config, max(len(p) for p in texts), workdir, multiprocess=backend == "node",
                            max_model_len=max_positions())
            to_close.append(server)
            log(f"server up in {server.wait_healthy():.0f} s", progress)
            try:
                with Progress(len(sizes) + 1, "bench ttft (vllm-server, smollm2)", enabled=progress) as bar:
                    _row(server, warmup, texts[-1], answer_tokens, backend)  # compiles; not counted
                    bar.advance(note="warm-up")
                    for (asked, _), tokens in zip(sizes, texts):
                        rows.append(_row(server, asked, tokens, answer_tokens, backend))
                        bar.advance(note=f"{len(tokens)} tokens")
            except Exception:
                print(f"--- the vLLM server's log, its end:\n{server.log_tail()}", file=sys.stderr)
                raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # the teardown must not be cut short
                signal.signal(sig, signal.SIG_IGN)
            for x in reversed(to_close):
                with contextlib.suppress(Exception):
                    x.close()
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def failures(rows: list[dict[str, Any]]) -> list[str]:
    why = []
    for r in rows:
        if not r.get("pool_hit_valid", True):
            why.append(f"context {r['context']}: the pool hit loaded {r['loaded_tokens']} of {r['expected_pool_tokens']} "
                       "tokens (or the cold request was not cold): INVALID")
        if not r["same_output"]:
            why.append(f"context {r['context']}: the answers with and without the pool differ")
    return why


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"SmolLM2-135M-Instruct, greedy answers of {len(rows[0]['answer_tokens']) if rows else ANSWER_TOKENS} tokens",
             f"{'engine':<12}{'context':>8}{'cold s':>9}{'pool hit s':>12}{'ratio':>8}{'native hit s':>14}"
             "  same answer  answer"]
    for r in rows:
        native = r.get("native_hit_ttft_s")
        ctx = f"{r['context']}" + ("*" if r["asked_context"] != r["context"] else "")
        lines.append(f"{r['engine']:<12}{ctx:>8}{r['cold_ttft_s']:>9.3f}{r['warm_ttft_s']:>12.3f}"
                     f"{r['cold_ttft_s'] / r['warm_ttft_s']:>7.1f}x{'' if native is None else f'{native:.3f}':>14}"
                     f"  {r['same_output']!s:<11}  {r['answer'][:60]!r}")
    if any(r["asked_context"] != r["context"] for r in rows):
        lines.append(f"* asked {max(r['asked_context'] for r in rows)}: the model has {max_positions()} positions, "
                     "and the answer needs its own")
    return "\n".join(lines)
