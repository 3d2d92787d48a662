"""``kvpool bench placement``: where new chunks go, measured on a real trace, two rules side by side.

Replays a trace (Mooncake's conversation trace by default: each request a chain of 512-token
block ids) on ``nodes`` simulated nodes of ``capacity`` chunks each (LRU), engines behind a router
that sends each request to one node, and compares two placement rules on the same requests:

- ``locality``: the pool's rule (cluster/placement.py). A chunk goes to the node of the engine
  that computed it; when that node would evict while another has ``SPILL_MARGIN`` more of its
  room free, to the node with the most room.
- ``ring``: consistent hashing with bounded loads (cluster/bench/ring.py): a chunk goes to the
  owner of its key, wherever its engine runs.

Reads follow the index in both (a chunk is found wherever it is). Per rule and router the report
gives: the hit rate (block references served from the pool), locality (the share of those read on
the reader's own node: shared memory, no network), balance (the busiest node's write load, the
chunks it took, over the mean), and at a node lost mid-trace, the share of stored chunks lost with it and the hit rate of
the requests right after. Two routers: ``round-robin`` (prefix-unaware) and ``prefix`` (a request
goes where its conversation's first own block hashes to, as KV-aware routers do).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict

import xxhash

from kvpool.cluster.bench.ring import HashRing
from kvpool.cluster.placement import SPILL_MARGIN

RULES = ("locality", "ring")
ROUTERS = ("round-robin", "prefix")
AFTER = 1000  # requests measured after the node loss


def block_key(block: int) -> bytes:
    return xxhash.xxh3_128_digest(block.to_bytes(8, "little"))


class Pool:
    """``nodes`` LRU caches of ``capacity`` chunks, and where each chunk is."""

    def __init__(self, rule: str, nodes: int, capacity: int) -> None:
        self.rule, self.capacity = rule, capacity
        self.nodes = {f"n{i}": OrderedDict() for i in range(nodes)}
        self.where: dict[int, str] = {}
        self.ring = HashRing()
        for n in self.nodes:
            self.ring.add(n)
        self.hits = self.local = self.refs = 0
        self.writes = dict.fromkeys(self.nodes, 0)  # chunks each node took: its write load

    def read(self, node: str, blocks) -> int:
        """The leading run of ``blocks`` the pool holds (touched), counted; how many."""
        n = 0
        for b in blocks:
            at = self.where.get(b)
            if at is None:
                break
            self.nodes[at].move_to_end(b)
            self.local += at == node
            n += 1
        self.hits += n
        self.refs += len(blocks)
        return n

    def target(self, node: str, block: int) -> str:
        if self.rule == "ring":
            return self.ring.owners(block_key(block))[0]
        free = self.capacity - len(self.nodes[node])
        if free > 0:
            return node
        best = max(self.nodes, key=lambda n: self.capacity - len(self.nodes[n]))
        if (self.capacity - len(self.nodes[best])) / self.capacity - free / self.capacity >= SPILL_MARGIN:
            return best
        return node

    def write(self, node: str, block: int) -> None:
        at = self.target(node, block)
        cache = self.nodes[at]
        if len(cache) >= self.capacity:
            old, _ = cache.popitem(last=False)
            self.where.pop(old, None)
        cache[block] = True
        self.where[block] = at
        self.writes[at] += 1

    def lose(self, node: str) -> float:
        """The node leaves with its chunks; the share of stored chunks lost."""
        total = sum(len(c) for c in self.nodes.values())
        gone = self.nodes.pop(node)
        for b in gone:
            self.where.pop(b, None)
        self.ring.remove(node)
        return len(gone) / max(total, 1)

    def balance(self) -> float:
        """The busiest node's write load over the mean (1.0: even)."""
        w = list(self.writes.values())
        return max(w) / max(statistics.mean(w), 1e-9)


def route(router: str, i: int, blocks, nodes: list[str]) -> str:
    if router == "round-robin":
        return nodes[i % len(nodes)]
    own = blocks[1] if len(blocks) > 1 else blocks[0]  # block 0 is the shared system prompt
    return nodes[xxhash.xxh64_intdigest(own.to_bytes(8, "little")) % len(nodes)]


def replay(requests, rule: str, router: str, nodes: int, capacity: int) -> dict:
    pool = Pool(rule, nodes, capacity)
    lose_at = len(requests) // 2
    out: dict = {}
    for i, req in enumerate(requests):
        if i == lose_at:
            out["hit_rate"] = pool.hits / max(pool.refs, 1)
            out["locality"] = pool.local / max(pool.hits, 1)
            out["balance"] = pool.balance()
            out["lost_share"] = pool.lose(sorted(pool.nodes)[-1])
            pool.hits = pool.local = pool.refs = 0
        if i == lose_at + AFTER:
            out["hit_rate_after_loss"] = pool.hits / max(pool.refs, 1)
        node = route(router, i, req.blocks, sorted(pool.nodes))
        n = pool.read(node, req.blocks)
        for b in req.blocks[n:]:
            pool.write(node, b)
    return {k: round(v, 4) for k, v in out.items()}


def run(trace: str, nodes: int = 4, capacity: int = 4096, limit: int | None = None) -> dict:
    from kvpool.sim.trace import load_mooncake

    requests = load_mooncake(trace, limit=limit)
    rows = {f"{rule} / {router}": replay(requests, rule, router, nodes, capacity)
            for router in ROUTERS for rule in RULES}
    return {"trace": trace, "requests": len(requests), "nodes": nodes, "capacity": capacity, "rows": rows}


def format_table(r: dict) -> str:
    lines = [f"{r['requests']} requests of {r['trace']}, {r['nodes']} nodes of {r['capacity']} chunks (LRU); "
             f"a node lost after half of them",
             f"{'rule / router':<24}{'hit rate':>9}{'locality':>10}{'balance':>9}{'lost':>7}{'hit after':>11}"]
    for name, v in r["rows"].items():
        lines.append(f"{name:<24}{v['hit_rate']:>9.1%}{v['locality']:>10.1%}{v['balance']:>9.2f}"
                     f"{v['lost_share']:>7.1%}{v.get('hit_rate_after_loss', 0):>11.1%}")
    return "\n".join(lines)
