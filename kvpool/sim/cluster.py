"""Routers over a cluster of engine instances, simulated on a trace (:mod:`kvpool.routing`'s code).

``instances`` engine instances, ``per_node`` to a node, each with a GPU prefix cache of
``gpu_blocks`` blocks (LRU, as vLLM's); each node's shard of the pool holds ``node_blocks`` blocks
(LRU); a block the pool does not hold goes to the shard of the node whose instance computed it (the
pool's locality placement). Each instance serves its requests one after another: a request's time
to first token is its wait behind the instance's queued work, plus loading its prefix tier by tier
and prefilling the rest (:class:`kvpool.routing.CostModel`). The trace's clock is scaled so that the
prompts' cold prefill work would keep ``utilization`` of the instances busy; caching then lowers it.

Per policy: the share of prompt tokens served by each tier, the mean and p99 modelled TTFT, and the
load balance (the busiest instance's work over the mean).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass

from kvpool.errors import BadRequest
from kvpool.routing import TIERS, CostModel, Instance, Router, tiers
from kvpool.sim.trace import BLOCK_TOKENS, SimRequest

# NOTE: an 8B-parameter model in fp16 on an H100-class GPU: 128 KiB of KV a token, prefill ~10,000 tokens/s; the
# node's shard over PCIe ~20 GB/s; another node's ~2 GB/s (this pool's cross-node / same-node get of a 256 KiB chunk
# is ~10x, docs/benchmarks.md "The data path"). Flags of `kvpool sim --instances` change each.
DEFAULT_COST = CostModel(prefill_s=1e-4, node_s=128 * 1024 / 20e9, remote_s=128 * 1024 / 2e9)


@dataclass(frozen=True)
class Shape:
    instances: int
    per_node: int = 4
    gpu_blocks: int = 600  # ~300K tokens of KV in an 80 GB GPU beside the weights
    node_blocks: int = 8000  # ~500 GB of a node's DRAM, at 64 MiB a 512-token block

    def __post_init__(self) -> None:
        if min(self.instances, self.per_node, self.gpu_blocks, self.node_blocks) < 1:
            raise BadRequest(f"cluster shape {self}: every count must be at least 1")


class _LRU:
    """Blocks in recency order; ``add`` returns those it evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.d = capacity, OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self.d

    def add(self, b: int) -> list[int]:
        if b in self.d:
            self.d.move_to_end(b)
            return []
        self.d[b] = None
        out = []
        while len(self.d) > self.capacity:
            out.append(self.d.popitem(last=False)[0])
        return out


def simulate(reqs: list[SimRequest], policy: str, shape: Shape, cost: CostModel = DEFAULT_COST,
             utilization: float = 0.7) -> dict:
    if not reqs:
        raise BadRequest("simulate: no requests")
    if not 0 < utilization <= 1.5:
        raise BadRequest(f"utilization {utilization}: the share of the instances' time cold prefill would take, "
                         "in (0, 1.5]")
    n = shape.instances
    node_of = [f"n{i // shape.per_node}" for i in range(n)]
    gpu = [_LRU(shape.gpu_blocks) for _ in range(n)]
    holders: dict[int, set[int]] = {}  # block -> instances whose GPU cache holds it
    shards = {node: _LRU(shape.node_blocks) for node in dict.fromkeys(node_of)}
    where: dict[int, str] = {}  # the pool's index: block -> node
    span = max(reqs[-1].time_s - reqs[0].time_s, 1e-9)
    scale = sum(r.input_tokens for r in reqs) * cost.prefill_s / (span * utilization * n)
    free_at, work = [0.0] * n, [0.0] * n
    totals = dict.fromkeys(TIERS, 0)
    ttfts = []
    router = Router(policy, cost)
    for r in reqs:
        t = (r.time_s - reqs[0].time_s) * scale
        whole = r.full_blocks
        blocks = r.blocks[:whole]
        lengths = [BLOCK_TOKENS] * whole
        at = [where.get(b) for b in blocks]
        base = {node: tiers(lengths, lambda j: False, at.__getitem__, node) for node in shards}
        by = [base[node_of[i]] for i in range(n)]
        for i in set().union(*(holders.get(b, ()) for b in blocks)):
            by[i] = tiers(lengths, lambda j, i=i, blocks=blocks: blocks[j] in gpu[i], at.__getitem__, node_of[i])
        views = [Instance(str(i), node_of[i], max(0.0, free_at[i] - t)) for i in range(n)]
        i = router.choose(views, by)
        got = dict(by[i])
        got["miss"] += r.input_tokens - whole * BLOCK_TOKENS  # the partial last block is always computed
        seconds = cost.seconds(got)
        free_at[i] = max(t, free_at[i]) + seconds
        work[i] += seconds
        ttfts.append(free_at[i] - t)
        for k in TIERS:
            totals[k] += got[k]
        for b in blocks:  # now in the instance's cache and in the pool
            for gone in gpu[i].add(b):
                holders[gone].discard(i)
            holders.setdefault(b, set()).add(i)
            home = where.get(b)
            if home is not None:
                shards[home].add(b)
                continue
            where[b] = node_of[i]
            for gone in shards[node_of[i]].add(b):
                del where[gone]
    tokens = sum(totals.values())
    mean_work = statistics.fmean(work)
    ttfts.sort()
    return {"policy": policy, "instances": n, "nodes": len(shards), "requests": len(reqs),
            **{f"{k}_share": totals[k] / tokens for k in TIERS},
            "cached_share": 1 - totals["miss"] / tokens,
            "local_share": (totals["gpu"] + totals["node"]) / tokens,
            "mean_ttft_s": statistics.fmean(ttfts), "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "max_load_vs_mean": max(work) / mean_work if mean_work else 1.0, "utilization": utilization}
