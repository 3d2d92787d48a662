"""``kvpool bench auth``: what checking a credential costs on the hot path (lookup, get, put),
beside the same calls without the check, in the same run.

Two in-process pools over stores of equal size hold the same chunks: a secured ``LocalPool`` (it
verifies the credential and computes the caller's scoped addresses on every call: everything the
shards also do per call) and the same pool with both steps removed (the caller is taken as given
and the keys are the store's addresses). Calls alternate between the two, and each figure is the
median over many calls, so a noisy neighbour slows both sides alike. In process is the strictest
case: with no network round trip to hide behind, the check's share of a call is largest here.

Targets: under 2 % of a 32 MiB get, under 10 % of one 256 KiB get.

Also the cost of sealing payloads at rest (``Tenant(encrypt=True)``, AES-256-GCM, opt-in): a
tenant that seals beside one that does not, on one secured pool, alternating.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvpool.auth import Authority, Principal, new_secret
from kvpool.pool import LocalPool
from kvpool.progress import Progress
from kvpool.spec import KVSpec
from kvpool.tenants import Tenant, TenantRegistry

SIZES = {
    "256 KiB": KVSpec("bench/small", 2, 2, 64, dtype="float16", block_size=16, chunk_tokens=256),
    "32 MiB": KVSpec("bench/llama3-8b", 32, 8, 128, dtype="float16", block_size=16, chunk_tokens=256),
}


class _Unchecked(LocalPool):
    """The baseline: the same pool without the credential check and the scoped addresses."""

    def _who(self, tenant: str) -> Principal:
        return Principal(tenant, "operator")

    def _where(self, p: Principal, keys):
        return list(keys)


def _pair(spec: KVSpec, chunks: int):
    auth = Authority(new_secret())
    tenants = [Tenant("alice")]
    secured = LocalPool.create(spec, TenantRegistry(tenants), chunks + 8, authority=auth, policy="lru")
    plain = _Unchecked.create(spec, TenantRegistry(tenants), chunks + 8, policy="lru")
    return (secured, auth.issue("alice")), (plain, "alice")


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_size(label: str, spec: KVSpec, calls: int, progress: Progress | None) -> dict:
    chunks = 16
    pools = _pair(spec, chunks)
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(spec.chunk_shape, generator=g).to(torch.float16) for _ in range(chunks)]
    tokens = list(range(chunks * spec.chunk_tokens))
    keyed = []
    for pool, who in pools:
        keys = pool.keys(who, tokens)
        assert pool.save(who, keys, kv) == chunks
        keyed.append((pool, who, keys))
    # put: a new one-chunk prompt per call (the store evicts the oldest to make room)
    fresh = [[pool.keys(who, [10**6 + i] * spec.chunk_tokens) for i in range(calls)] for pool, who in pools]
    ops = {
        "lookup (16 chunks)": lambda p, w, k, i: p.lookup(w, k),
        "get (1 chunk)": lambda p, w, k, i: p.load(w, k[:1]),
        "put (1 new chunk)": lambda p, w, k, i: p.save(w, fresh[p is keyed[1][0]][i], kv[:1]),
    }
    out = {}
    for name, op in ops.items():
        times: list[list[float]] = [[], []]
        for i in range(calls):
            for side in ((0, 1) if i % 2 else (1, 0)):  # alternate which goes first
                pool, who, keys = keyed[side]
                t0 = time.perf_counter()
                op(pool, who, keys, i)
                times[side].append(time.perf_counter() - t0)
        checked, plain = _median_us(times[0]), _median_us(times[1])
        out[name] = {"checked_us": round(checked, 2), "unchecked_us": round(plain, 2),
                     "overhead_us": round(checked - plain, 2),
                     "overhead_pct": round(100 * (checked - plain) / plain, 2)}
        if progress:
            progress.advance(note=f"{label} {name}")
    for pool, _, _ in keyed:
        pool.store.close()
    return out


def bench_seal(label: str, spec: KVSpec, calls: int, progress: Progress | None) -> dict:
    """get and put of one chunk by a tenant that seals beside one that does not (same pool)."""
    auth = Authority(new_secret())
    pool = LocalPool.create(spec, TenantRegistry([Tenant("plain"), Tenant("sealed", encrypt=True)]), 2 * calls + 8,
                            authority=auth, policy="lru")
    who = [auth.issue("sealed"), auth.issue("plain")]
    kv = [torch.randn(spec.chunk_shape, generator=torch.Generator().manual_seed(1)).to(torch.float16)]
    keys = [[pool.keys(w, [10**6 + i] * spec.chunk_tokens) for i in range(calls)] for w in who]
    out = {}
    for name, op in (("put (1 new chunk)", lambda s, i: pool.save(who[s], keys[s][i], kv)),
                     ("get (1 chunk)", lambda s, i: pool.load(who[s], keys[s][i]))):
        times: list[list[float]] = [[], []]
        for i in range(calls):
            for side in ((0, 1) if i % 2 else (1, 0)):
                t0 = time.perf_counter()
                op(side, i)
                times[side].append(time.perf_counter() - t0)
        sealed, plain = _median_us(times[0]), _median_us(times[1])
        out[name] = {"sealed_us": round(sealed, 1), "plain_us": round(plain, 1), "ratio": round(sealed / plain, 2)}
        if progress:
            progress.advance(note=f"{label} sealed {name}")
    pool.store.close()
    return out


def bench_primitives(reps: int = 20000) -> dict:
    """The check's parts alone: a credential verified the first time and then from the cache,
    and the scoped addresses of 16 keys."""
    from kvpool.auth import scope_tag, scoped
    from kvpool.keys import ChunkKey

    auth = Authority(new_secret())
    creds = [auth.issue(f"t{i}") for i in range(reps)]
    t0 = time.perf_counter()
    for c in creds:
        auth.verify(c)
    first = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for c in creds:
        auth.verify(c)
    cached = (time.perf_counter() - t0) / reps
    keys = [ChunkKey(bytes([i]) * 16) for i in range(16)]
    tag = scope_tag("alice")
    t0 = time.perf_counter()
    for _ in range(reps // 10):
        scoped(keys, tag)
    scope16 = (time.perf_counter() - t0) / (reps // 10)
    return {"verify_first_us": round(first * 1e6, 2), "verify_cached_us": round(cached * 1e6, 3),
            "scope_16_keys_us": round(scope16 * 1e6, 2)}


def run(calls: int = 200, progress: bool = True) -> dict:
    result = {"primitives": bench_primitives(), "sizes": {}, "sealed": {}}
    with Progress(len(SIZES) * 5, "bench auth", enabled=progress) as p:
        for label, spec in SIZES.items():
            n = calls if spec.chunk_nbytes < (1 << 20) else max(20, calls // 4)
            result["sizes"][label] = bench_size(label, spec, n, p)
            result["sealed"][label] = bench_seal(label, spec, n, p)
    return result


def format_table(r: dict) -> str:
    pr = r["primitives"]
    lines = [f"verify: {pr['verify_first_us']} us the first time, {pr['verify_cached_us']} us cached; "
             f"scoped addresses of 16 keys: {pr['scope_16_keys_us']} us",
             f"{'chunk':>8}  {'call':<24} {'checked us':>11} {'unchecked us':>13} {'overhead':>10}"]
    for label, ops in r["sizes"].items():
        for name, o in ops.items():
            lines.append(f"{label:>8}  {name:<24} {o['checked_us']:>11.1f} {o['unchecked_us']:>13.1f} "
                         f"{o['overhead_pct']:>9.2f}%")
    lines.append(f"sealed at rest (opt-in): {'chunk':>8}  {'call':<20} {'sealed us':>10} {'plain us':>9} {'ratio':>6}")
    for label, ops in r["sealed"].items():
        for name, o in ops.items():
            lines.append(f"{'':24} {label:>8}  {name:<20} {o['sealed_us']:>10.1f} {o['plain_us']:>9.1f} "
                         f"{o['ratio']:>5.2f}x")
    return "\n".join(lines)
