"""Replaying requests through a policy, an infinite cache and Belady's offline optimum.

Hit rate, as everywhere in kvpool: the fraction of requested blocks served from the cache,
counting only the leading run of resident blocks of each request (a block after a miss is
recomputed anyway). After the lookup the request is served by ``TieredCache.serve``, the same
routine the concurrency benchmark uses: the policy decides what of the request to store.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from kvpool.cache import TieredCache
from kvpool.policies import TIERED_MEMORY, TIERED_MEMORY_SPLIT, Access, make_policy
from kvpool.sim.trace import SimRequest


def leading(blocks, held) -> int:
    """How many of ``blocks``, from the first, are in ``held`` (a leading run)."""
    h = 0
    for b in blocks:
        if b not in held:
            break
        h += 1
    return h


def _tokens(req: SimRequest, nblocks: int) -> int:
    return sum(req.block_tokens(i) for i in range(nblocks))


def replay(trace: list[SimRequest], policy: str, capacity: int, tiers: list[int] | None = None,
           on_progress: Callable[[int], None] | None = None, **params) -> dict:
    """Runs ``trace`` through a TieredCache of ``capacity`` blocks (or the given tier sizes, top
    first) whose every tier uses ``policy``. ``tiered-memory`` splits the capacity into HBM, DRAM
    and disk tiers (``TIERED_MEMORY_SPLIT``) that each run ``tier_policy`` (default lru)."""
    tier_policy = policy
    if policy == TIERED_MEMORY:
        tier_policy = params.pop("tier_policy", "lru")
        if tiers is None:
            tiers = [max(1, int(capacity * f)) for f in TIERED_MEMORY_SPLIT[:-1]]
            tiers.append(max(1, capacity - sum(tiers)))
    sizes = tiers or [capacity]
    cache = TieredCache(sizes, lambda cap, res, t: make_policy(tier_policy, cap, res, **params))
    hits = total = hit_tok = tot_tok = top_hits = 0
    t0 = time.perf_counter()
    for rid, req in enumerate(trace):
        blocks = req.blocks
        run = cache.leading_run(blocks)
        h = len(run)
        hits += h
        total += len(blocks)
        hit_tok += _tokens(req, h)
        tot_tok += req.input_tokens
        if len(sizes) > 1:
            top_hits += sum(1 for n in run if cache.node_tier[n] == 0)
        cache.serve(blocks, Access(rid, req.time_s, len(blocks), req.full_blocks, h, req.tenant), run)
        if on_progress is not None and rid % 1000 == 999:
            on_progress(1000)
    row = {
        "policy": policy,
        "capacity": capacity,
        "hit_rate": hits / max(total, 1),
        "token_hit_rate": hit_tok / max(tot_tok, 1),
        "requests": len(trace),
        "blocks": total,
        "seconds": time.perf_counter() - t0,
        **{k: v for k, v in cache.counts.items()},
    }
    if len(sizes) > 1:
        row["tiers"] = sizes
        row["top_tier_hit_rate"] = top_hits / max(total, 1)
    stats = cache.policies[0].stats()
    if stats:
        row["policy_stats"] = stats
    return row


def infinite(trace: list[SimRequest]) -> dict:
    seen: set[int] = set()
    hits = total = hit_tok = tot_tok = 0
    for req in trace:
        h = leading(req.blocks, seen)
        hits += h
        total += len(req.blocks)
        hit_tok += _tokens(req, h)
        tot_tok += req.input_tokens
        seen.update(req.blocks)
    return {"policy": "infinite", "hit_rate": hits / max(total, 1), "token_hit_rate": hit_tok / max(tot_tok, 1)}


def belady_runs(trace: list[SimRequest], capacity: int) -> list[int]:
    """Offline optimum: each request's leading run of resident blocks. Evicts the block whose next
    use is furthest away, and does not store a block whose next use is further than every
    resident one's (or that is never used again). Ties go to the deeper block, so a suffix goes
    before its prefix."""
    never = 1 << 62
    next_use: list[list[int]] = [[]] * len(trace)
    last: dict[int, int] = {}
    for ri in range(len(trace) - 1, -1, -1):
        blocks = trace[ri].blocks
        next_use[ri] = [last.get(b, never) for b in blocks]
        for b in blocks:
            last[b] = ri
    resident: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), lazily invalidated
    runs: list[int] = []
    for ri, req in enumerate(trace):
        blocks = req.blocks
        runs.append(leading(blocks, resident))
        nu = next_use[ri]
        for pos, b in enumerate(blocks):
            t = nu[pos]
            if b in resident:
                resident[b] = t
                heapq.heappush(heap, (-t, -pos, b))
                continue
            if t >= never:
                continue
            while len(resident) >= capacity:
                nt, _, vb = heap[0]
                if resident.get(vb) != -nt:
                    heapq.heappop(heap)
                    continue
                if -nt <= t:
                    break
                heapq.heappop(heap)
                del resident[vb]
            if len(resident) < capacity:
                resident[b] = t
                heapq.heappush(heap, (-t, -pos, b))
    return runs


def belady(trace: list[SimRequest], capacity: int) -> dict:
    runs = belady_runs(trace, capacity)
    hits = sum(runs)
    total = sum(len(r.blocks) for r in trace)
    hit_tok = sum(_tokens(r, h) for r, h in zip(trace, runs))
    tot_tok = sum(r.input_tokens for r in trace)
    return {"policy": "belady", "capacity": capacity, "hit_rate": hits / max(total, 1),
            "token_hit_rate": hit_tok / max(tot_tok, 1)}
