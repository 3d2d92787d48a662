"""``kvpool demo`` (what ``make demo`` runs): a real model on the pool, end to end.

Starts local Ray with one shard and the embedded index (or joins ``--ray-address``; ``--redis``
puts the index in Redis; ``--backend local`` keeps everything in this process) and serves
multi-tenant, multi-turn chats through the transformers connector: each request loads its
longest cached prefix from the pool and runs only the rest. The same request also runs with no
pool (the baseline, same run), and every answer is checked against it.

``--model smollm2`` (the default) is SmolLM2-135M-Instruct (kvpool.connectors.demo.smollm2) answering
questions about documents that ship with Python (kvpool.connectors.demo.workload,
kvpool.connectors.demo.chat): real answers, which must be the same greedy tokens with and
without the pool. ``--model tiny`` is a small random-weight Llama on random tokens (no weights to
load, seconds): the last position's logits with the pool must equal those without it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import model_spec, tiny_llama
from kvpool.errors import BadRequest
from kvpool.progress import Progress
from kvpool.tenants import Tenant, TenantRegistry

log = logging.getLogger("kvpool.connectors.demo.run")

CHUNK = 64
VOCAB = 4096
# (tenants, conversations per tenant, turns) of each model's workload, and its pool's DRAM chunks
DEFAULTS = {"smollm2": (3, 2, 2), "tiny": (3, 2, 4)}
DRAM_CHUNKS = {"smollm2": 128, "tiny": 256}  # 128 SmolLM2 chunks of 64 tokens: 360 MiB


@dataclass
class Request:
    tenant: str
    tokens: np.ndarray


def demo_model():
    """The tiny demo's model: 4 layers, hidden 256, 4 heads over 2 KV heads (head dim 64), fp32."""
    return tiny_llama(0, layers=4, hidden=256, heads=4, kv_heads=2, vocab=VOCAB)


def workload(tenants: int = 3, conversations: int = 2, turns: int = 4, seed: int = 0) -> list[Request]:
    """The tiny model's workload: each tenant has a 512-token system prompt; each turn re-sends
    the conversation so far plus 100-300 new tokens. Tenants and conversations interleave; a
    conversation's turns stay in order."""
    rng = np.random.default_rng(seed)
    convs: list[list[Request]] = []
    for t in range(tenants):
        system = rng.integers(0, VOCAB, 512)
        for _ in range(conversations):
            history, turns_of = system, []
            for _ in range(turns):
                history = np.concatenate([history, rng.integers(0, VOCAB, int(rng.integers(100, 300)))])
                turns_of.append(Request(f"tenant-{t}", history.copy()))
            convs.append(turns_of)
    out: list[Request] = []
    for turn in range(turns):
        order = rng.permutation(len(convs))
        out += [convs[i][turn] for i in order]
    return out


def run(model: str = "smollm2", tenants: int | None = None, conversations: int | None = None,
        turns: int | None = None, *, max_new_tokens: int = 48, progress: bool = True, backend: str = "ray",
        ray_address: str | None = None, redis: str | None = None) -> dict:
    """Runs the demo; the result's ``ok`` is False when an answer changed with the pool."""
    if model not in DEFAULTS:
        raise BadRequest(f"demo model {model!r}: choose 'smollm2' (the real model) or 'tiny' (random weights)")
    if backend not in ("ray", "local"):
        raise BadRequest(f"demo backend {backend!r}: choose 'ray' or 'local'")
    if backend == "local" and redis:
        raise BadRequest("--redis needs the Ray backend (the index is shared by the cluster's shards)")
    if not 1 <= max_new_tokens <= 512:
        raise BadRequest(f"--max-new-tokens {max_new_tokens}: give 1-512")
    d = DEFAULTS[model]
    tenants, conversations, turns = (d[i] if v is None else v for i, v in enumerate((tenants, conversations, turns)))
    where = _where(backend, ray_address, redis)
    if model == "tiny":
        names = [f"tenant-{t}" for t in range(tenants)]
        torch.set_flush_denormal(True)  # NOTE: see kvpool.connectors.bench.ttft: random weights make denormals
        m = demo_model()
        spec = model_spec(m, model_id="kvpool/demo-llama", chunk_tokens=CHUNK)
        with _pool(spec, names, DRAM_CHUNKS[model], backend, ray_address, redis) as pool:
            return _run(m, pool, names, conversations, turns, progress, where)
    return _run_real(tenants, conversations, turns, max_new_tokens, progress, backend, ray_address, redis, where)


def _run_real(tenants: int, conversations: int, turns: int, max_new_tokens: int, progress: bool, backend: str,
              ray_address: str | None, redis: str | None, where: str) -> dict:
    from kvpool.connectors.demo import chat as demo_chat
    from kvpool.connectors.demo import smollm2
    from kvpool.connectors.demo.workload import plan

    convs = plan(tenants, conversations, turns)  # bad counts fail before the model loads
    smollm2.gguf_dir()  # not installed: a BadRequest naming the install, before anything starts
    if progress:
        log.warning("kvpool demo: loading SmolLM2-135M-Instruct (about 20 s)")
    model, tok = smollm2.load()
    spec = model_spec(model, model_id=smollm2.MODEL_ID, chunk_tokens=CHUNK)
    names = list(dict.fromkeys(c.work.tenant for c in convs))
    docs = {c.work.tenant: c.work.document for c in convs}
    with _pool(spec, names, DRAM_CHUNKS["smollm2"], backend, ray_address, redis) as pool:
        result = demo_chat.serve(model, tok, pool, convs, max_new_tokens=max_new_tokens, progress=progress)
        result["store"] = pool.stats()
    result.update(model="smollm2", model_name="SmolLM2-135M-Instruct", where=where,
                  spec=spec.to_dict(), max_new_tokens=max_new_tokens,
                  documents=[{"tenant": t, "title": d.title, "source": d.source,
                              "tokens": len(tok(d.text)["input_ids"])} for t, d in docs.items()])
    return result


def _where(backend: str, ray_address: str | None, redis: str | None) -> str:
    if backend == "local":
        return "in-process pool"
    where = "Ray cluster at " + ray_address if ray_address else "local Ray pool"
    return where + (", index in Redis" if redis else ", embedded index")


@contextlib.contextmanager
def _pool(spec, names: list[str], dram_chunks: int, backend: str, ray_address: str | None, redis: str | None):
    tenants = [Tenant(n) for n in names]
    if backend == "local":
        from kvpool.connectors.pools import local_pool

        yield local_pool(spec, TenantRegistry(tenants), dram_chunks)
        return
    from kvpool.cluster.local import local_cluster_pool

    with local_cluster_pool(spec, tenants, dram_chunks, ray_address, index_url=redis) as pool:
        yield pool


def _run(model, pool, names: list[str], conversations: int, turns: int, progress: bool, where: str) -> dict:
    conn = HFConnector(model, pool)
    reqs = workload(len(names), conversations, turns)
    per_tenant = {n: {"requests": 0, "tokens": 0, "hit_tokens": 0, "cold_s": 0.0, "warm_s": 0.0,
                      "warm_ttft_s": [], "cold_ttft_s": []} for n in names}
    verified = worst = 0.0
    with Progress(len(reqs), "demo", enabled=progress) as bar:
        for r in reqs:
            cold = conn.prefill(r.tokens, tenant=r.tenant, use_pool=False)  # the baseline: recompute all
            warm = conn.prefill(r.tokens, tenant=r.tenant)
            ref, got = cold.logits[0, -1], warm.logits[0, -1]
            diff = (ref - got).abs().max().item() / max(1.0, ref.abs().max().item())
            if diff > 1e-5 or int(ref.argmax()) != int(got.argmax()):
                raise AssertionError(f"reused KV changed the output of a {r.tenant} request (relative diff {diff:.2e})")
            verified += 1
            worst = max(worst, diff)
            s = per_tenant[r.tenant]
            s["requests"] += 1
            s["tokens"] += len(r.tokens)
            s["hit_tokens"] += warm.loaded_tokens
            s["cold_s"] += cold.seconds
            s["warm_s"] += warm.seconds
            if warm.loaded_tokens:  # the same request, without and with its cached prefix
                s["cold_ttft_s"].append(cold.seconds)
                s["warm_ttft_s"].append(warm.seconds)
            bar.advance(note=r.tenant)
    stats = pool.stats()
    return {"model": "tiny", "ok": True, "tenants": per_tenant, "verified_requests": int(verified),
            "worst_relative_diff": worst, "store": stats, "spec": pool.spec.to_dict(), "where": where,
            "breakeven": conn.breakeven.stats()}


def format_report(result: dict) -> str:
    if result.get("model") == "smollm2":
        from kvpool.connectors.demo.chat import format_report as chat_report

        return chat_report(result)
    spec = result["spec"]
    lines = [
        f"kvpool demo: {result['where']}; random-weight {spec['model_id']} ({spec['num_layers']} layers, "
        f"{spec['num_kv_heads']} KV heads x {spec['head_dim']}, {spec['dtype']}), chunks of {spec['chunk_tokens']} tokens",
        "",
        f"{'tenant':<10}{'requests':>9}{'tokens':>9}{'hit rate':>10}{'no pool s':>11}{'pool s':>9}{'speed-up':>10}",
    ]
    tot = {"requests": 0, "tokens": 0, "hit_tokens": 0, "cold_s": 0.0, "warm_s": 0.0}
    for name, s in result["tenants"].items():
        for k in tot:
            tot[k] += s[k]
        lines.append(_row(name, s))
    lines.append(_row("all", tot))
    warm = [t for s in result["tenants"].values() for t in s["warm_ttft_s"]]
    cold = [t for s in result["tenants"].values() for t in s["cold_ttft_s"]]
    if warm and cold:
        c, w = float(np.median(cold)), float(np.median(warm))
        lines.append(f"time to first token of the {len(warm)} requests with a cached prefix (median): "
                     f"{1e3 * c:.1f} ms without the pool, {1e3 * w:.1f} ms with it ({c / w:.1f}x)")
    st = result["store"]
    dram = st["tiers"]["dram"]
    m = st["metrics"]
    be = result["breakeven"]
    lines += [
        "",
        f"pool: {st['chunks']} chunks, {dram['bytes'] / 2**20:.1f} MiB in dram "
        f"({dram['pages_used']}/{dram['pages_total']} pages), evictions {sum(m['evictions'].values()):.0f}, "
        f"checksum failures {sum(m['checksum_failures'].values()):.0f}",
        "per tenant: " + ", ".join(f"{t} {v['bytes'] / 2**20:.1f} MiB" for t, v in st["tenants"].items()),
        f"verified: {result['verified_requests']} requests gave the same logits with and without the pool "
        f"(largest difference {result['worst_relative_diff']:.1e} of the logits' scale)",
        f"load or recompute: loads at {be['load_gbps'] or 0:.2f} GB/s, prefill {be['prefill_ms_per_token'] or 0:.3f} "
        f"ms/token: {be['loads']} loads, {be['recomputes']} recomputes",
    ]
    return "\n".join(lines)


def _row(name: str, s: dict) -> str:
    rate = s["hit_tokens"] / max(s["tokens"], 1)
    speed = s["cold_s"] / s["warm_s"] if s["warm_s"] else float("nan")
    return f"{name:<10}{s['requests']:>9}{s['tokens']:>9}{rate:>10.1%}{s['cold_s']:>11.3f}{s['warm_s']:>9.3f}{speed:>9.2f}x"
