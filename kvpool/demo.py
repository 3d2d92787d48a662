"""``kvpool demo``: the main job on the embedded default: local Ray (one shard on this node, the
embedded index in an actor, no Redis); ``--backend local`` runs it in this process alone.

Three tenants hold multi-turn conversations that share a per-tenant system prompt. Each request
asks the pool for the longest cached prefix, computes only the rest with a toy prefill, and
saves its new whole chunks. The same workload also runs with no pool as the baseline, and every
loaded chunk is checked against a recomputation: reuse must never change the KV.

NOTE: the prefill here is a toy (random projections of prefix-dependent states) so that this
job needs no model; the real-model job (transformers, then Ray) replaces it in later issues.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.errors import BadRequest
from kvpool.health import HealthMonitor
from kvpool.pool import LocalPool
from kvpool.progress import Progress
from kvpool.spec import KVSpec
from kvpool.tenants import Tenant, TenantRegistry

SPEC = KVSpec("kvpool/toy-llama", num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32",
              block_size=16, chunk_tokens=64)
HIDDEN = 512
VOCAB = 32000


class ToyPrefill:
    """KV of token t depends on tokens 0..t (a running mean of embeddings), like a real model's."""

    def __init__(self, spec: KVSpec, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.spec = spec
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        width = spec.num_kv_heads * spec.head_dim
        self.w = torch.randn(spec.num_layers, 2, HIDDEN, width, generator=g) / HIDDEN**0.5
        self.mix = torch.randn(spec.num_layers, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5

    def __call__(self, tokens: np.ndarray, start: int) -> torch.Tensor:
        """KV ``[layers, 2, len(tokens) - start, kv_heads, head_dim]`` of tokens[start:]."""
        e = self.embed[torch.from_numpy(tokens.astype(np.int64))]
        h = e.cumsum(0) / torch.arange(1, len(tokens) + 1).unsqueeze(1)
        h = h[start:]
        spec, n = self.spec, len(tokens) - start
        out = torch.empty(spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim)
        for layer in range(spec.num_layers):
            h = torch.tanh(h @ self.mix[layer])
            out[layer, 0] = (h @ self.w[layer, 0]).view(n, spec.num_kv_heads, spec.head_dim)
            out[layer, 1] = (h @ self.w[layer, 1]).view(n, spec.num_kv_heads, spec.head_dim)
        return out


@dataclass
class Request:
    tenant: str
    tokens: np.ndarray


def workload(tenants: int = 3, conversations: int = 2, turns: int = 4, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    reqs: list[Request] = []
    for t in range(tenants):
        system = rng.integers(0, VOCAB, 512)
        for _ in range(conversations):
            history = system
            for _ in range(turns):
                history = np.concatenate([history, rng.integers(0, VOCAB, int(rng.integers(100, 300)))])
                reqs.append(Request(f"tenant-{t}", history.copy()))
    rng.shuffle(reqs)  # tenants interleave; each conversation's turns stay in order below
    reqs.sort(key=lambda r: len(r.tokens))
    return reqs


def run(tenants: int = 3, conversations: int = 2, turns: int = 4, verify: bool = True, progress: bool = True,
        backend: str = "ray", ray_address: str | None = None) -> dict:
    """``backend``: "ray" (local Ray, one shard, the embedded index in an actor: the default) or
    "local" (this process only)."""
    names = [f"tenant-{t}" for t in range(tenants)]
    if backend == "local":
        return _run(LocalPool.create(SPEC, TenantRegistry([Tenant(n) for n in names]), dram_chunks=256),
                    names, conversations, turns, verify, progress, "in-process pool")
    if backend != "ray":
        raise BadRequest(f"demo backend {backend!r}: choose 'ray' or 'local'")
    from kvpool.cluster.pool import local_cluster_pool

    with local_cluster_pool(SPEC, [Tenant(n) for n in names], 256, ray_address) as pool:
        return _run(pool, names, conversations, turns, verify, progress, "local Ray pool")


def _run(pool, names: list[str], conversations: int, turns: int, verify: bool, progress: bool, where: str) -> dict:
    tenants = len(names)
    prefill = ToyPrefill(SPEC)
    reqs = workload(tenants, conversations, turns)
    ct = SPEC.chunk_tokens
    per_tenant = {n: {"requests": 0, "tokens": 0, "hit_tokens": 0, "cold_s": 0.0, "warm_s": 0.0} for n in names}
    verified = 0
    monitor = HealthMonitor(pool.store) if isinstance(pool, LocalPool) else None
    with Progress(len(reqs), "demo", enabled=progress) as bar:
        for r in reqs:
            t0 = time.perf_counter()
            prefill(r.tokens, 0)  # the baseline: no pool, everything recomputed
            cold = time.perf_counter() - t0

            t0 = time.perf_counter()
            keys = pool.keys(r.tenant, r.tokens)
            req = pool.begin(r.tenant, keys)  # its cached prefix stays put while it runs
            loaded = pool.load(r.tenant, keys)
            hit = len(loaded) * ct
            suffix = prefill(r.tokens, hit)
            full = len(keys) - len(loaded)
            new_chunks = [suffix[:, :, i * ct : (i + 1) * ct].contiguous() for i in range(full)]
            pool.save(r.tenant, keys, new_chunks, start=len(loaded), request=req)
            pool.end(req)
            warm = time.perf_counter() - t0

            if verify and loaded:
                ref = prefill(r.tokens, 0)
                for i, chunk in enumerate(loaded):
                    assert torch.equal(chunk, ref[:, :, i * ct : (i + 1) * ct]), "reused KV differs"
                    verified += 1
            s = per_tenant[r.tenant]
            s["requests"] += 1
            s["tokens"] += len(r.tokens)
            s["hit_tokens"] += hit
            s["cold_s"] += cold
            s["warm_s"] += warm
            bar.advance(note=r.tenant)
    verdicts = monitor.sample()["verdicts"] if monitor else []
    stats = pool.store.stats() if isinstance(pool, LocalPool) else pool.stats()
    return {"tenants": per_tenant, "verified_chunks": verified, "store": stats, "spec": SPEC.to_dict(),
            "where": where, "health": [{"figure": v.figure, "value": v.value, "ok": v.ok} for v in verdicts],
            "health_lines": [str(v) for v in verdicts]}


def format_report(result: dict) -> str:
    lines = [
        f"kvpool demo: {result['where']}, toy prefill of {result['spec']['model_id']} "
        f"({result['spec']['num_layers']} layers, chunks of {result['spec']['chunk_tokens']} tokens)",
        "",
        f"{'tenant':<10}{'requests':>9}{'tokens':>9}{'hit rate':>10}{'no pool s':>11}{'pool s':>9}{'speed-up':>10}",
    ]
    tot = {"requests": 0, "tokens": 0, "hit_tokens": 0, "cold_s": 0.0, "warm_s": 0.0}
    for name, s in result["tenants"].items():
        for k in tot:
            tot[k] += s[k]
        lines.append(_row(name, s))
    lines.append(_row("all", tot))
    st = result["store"]
    dram = st["tiers"]["dram"]
    m = st["metrics"]
    lines += [
        "",
        f"pool: {st['chunks']} chunks, {dram['bytes'] / 2**20:.1f} MiB in dram "
        f"({dram['pages_used']}/{dram['pages_total']} pages), evictions {sum(m['evictions'].values()):.0f}, "
        f"checksum failures {sum(m['checksum_failures'].values()):.0f}",
        "per tenant: " + ", ".join(f"{t} {v['bytes'] / 2**20:.1f} MiB" for t, v in st["tenants"].items()),
        f"verified: {result['verified_chunks']} loaded chunks equal their recomputation exactly",
        f"policy: {st['policy']} {st['policy_stats']}",
    ]
    if result["health_lines"]:
        lines += ["", "health (this run; a cold start is not warm traffic, so a low hit rate is expected here):",
                  *("  " + line for line in result["health_lines"])]
    return "\n".join(lines)


def _row(name: str, s: dict) -> str:
    rate = s["hit_tokens"] / max(s["tokens"], 1)
    speed = s["cold_s"] / s["warm_s"] if s["warm_s"] else float("nan")
    return f"{name:<10}{s['requests']:>9}{s['tokens']:>9}{rate:>10.1%}{s['cold_s']:>11.3f}{s['warm_s']:>9.3f}{speed:>9.2f}x"
