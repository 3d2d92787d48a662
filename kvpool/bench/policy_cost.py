"""Per-access CPU cost of each eviction policy against LRU's, in the same run.

Two measurements over one generated multi-turn chat workload (the cache holds a quarter of its
blocks, so it evicts all the time):

- ``metadata``: ``TieredCache.serve``, the metadata path the store runs under its lock and the
  simulator runs for every hit rate it reports (lookup, leases, inserts, eviction, policy events);
- ``store``: the chunk store itself, ``get_many`` of each request's chunks then ``put_many`` of the
  ones it missed, 4 KiB chunks (copies and checksums small, the store's own bookkeeping included).

Time per block of the requests' prompts; policies interleaved round by round, the ratio to LRU
taken within each round and the median over rounds reported.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvpool.cache import TieredCache
from kvpool.keys import ChunkKey
from kvpool.policies import Access, make_policy
from kvpool.progress import Progress
from kvpool.sim.workloads import generate
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry

CHUNK_BYTES = 4096


def _metadata(trace, policy: str, capacity: int) -> float:
    cache = TieredCache([capacity], lambda cap, res, t: make_policy(policy, cap, res))
    t0 = time.perf_counter()
    for rid, req in enumerate(trace):
        run = cache.leading_run(req.blocks)
        cache.serve(req.blocks, Access(rid, req.time_s, len(req.blocks), req.full_blocks, len(run)), run)
    return time.perf_counter() - t0


def _store(trace, keys: dict[int, ChunkKey], policy: str, capacity: int) -> float:
    store = ChunkStore(StoreConfig(CHUNK_BYTES, capacity, policy=policy), TenantRegistry([Tenant("bench")]))
    payload = np.zeros(CHUNK_BYTES, dtype=np.uint8)
    outs = [np.empty(CHUNK_BYTES, dtype=np.uint8) for _ in range(max(len(r.blocks) for r in trace))]
    t0 = time.perf_counter()
    for req in trace:
        ks = [keys[b] for b in req.blocks[: req.full_blocks]]
        got = store.get_many(ks, "bench", outs[: len(ks)])
        h = next((i for i, g in enumerate(got) if g is None), len(ks))
        if h < len(ks):
            store.put_many(ks[h:], [payload] * (len(ks) - h), "bench", parent=ks[h - 1] if h else None,
                           first_position=h)
    elapsed = time.perf_counter() - t0
    store.close()
    return elapsed


def bench_policy_cost(policies: tuple[str, ...] = ("lru", "density", "adaptive"), requests: int = 3000,
                      rounds: int = 3, progress: bool = True) -> dict:
    trace = generate("chat", n_requests=requests, seed=5)
    blocks = sum(len(r.blocks) for r in trace)
    distinct = {b for r in trace for b in r.blocks}
    capacity = max(64, len(distinct) // 4)
    keys = {b: ChunkKey(int(b).to_bytes(16, "little")) for b in distinct}
    times: dict[tuple[str, str], list[float]] = {(k, p): [] for k in ("metadata", "store") for p in policies}
    with Progress(rounds * len(policies), "bench policy cost", enabled=progress) as bar:
        for _ in range(rounds):
            for p in policies:
                times[("metadata", p)].append(_metadata(trace, p, capacity))
                times[("store", p)].append(_store(trace, keys, p, capacity))
                bar.advance()
    out: dict = {"policy_cost_requests": requests, "policy_cost_blocks": blocks, "policy_cost_capacity": capacity,
                 "policy_cost_rounds": rounds}
    for kind in ("metadata", "store"):
        for p in policies:
            ts = times[(kind, p)]
            out[f"{kind}_us_per_block_{p}"] = statistics.median(ts) / blocks * 1e6
            if p != "lru":
                out[f"{kind}_{p}_vs_lru"] = statistics.median(
                    t / lru for t, lru in zip(ts, times[(kind, "lru")]))
    return out


def format_lines(r: dict) -> list[str]:
    lines = [f"eviction policy cost per block accessed ({r['policy_cost_blocks']} blocks, capacity "
             f"{r['policy_cost_capacity']}, median of {r['policy_cost_rounds']} rounds):"]
    for kind in ("metadata", "store"):
        cells = []
        for key, v in r.items():
            if key.startswith(f"{kind}_us_per_block_"):
                p = key.rsplit("_", 1)[1]
                ratio = r.get(f"{kind}_{p}_vs_lru")
                cells.append(f"{p} {v:.2f} us" + (f" (x{ratio:.2f} lru)" if ratio else ""))
        lines.append(f"  {kind:<9}" + ", ".join(cells))
    return lines
