"""The hash ring: where a chunk goes. Consistent hashing with virtual nodes, capacity weights,
bounded load and replicas.

- A shard owns ``vnodes x weight`` points on a 64-bit ring (xxh64 of "shard#i"); a key's point is
  the first 8 bytes of its (already uniform) 128-bit chunk key.
- ``owners(key, r)``: the first r distinct shards clockwise from the key. Adding or removing a shard
  moves only the keys between its points and their predecessors: ~1/N of them.
- ``place(key, loads, r)``: the same walk, skipping shards already at their bounded load
  ``ceil((1 + eps) x weight share x (total + 1))`` (consistent hashing with bounded loads, Mirrokni,
  Thorup & Zadimoghaddam, SODA'18), so no shard takes more than (1 + eps) x its fair share.
Placement is only where new chunks go; readers find chunks through the index, so data placed
before a ring change is still found.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

import xxhash

from kvpool.errors import BadRequest, Unavailable


def key_point(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


class HashRing:
    def __init__(self, vnodes: int = 128, eps: float = 0.25) -> None:
        if vnodes < 1 or eps < 0:
            raise BadRequest(f"ring needs vnodes >= 1 and eps >= 0, got vnodes={vnodes}, eps={eps}")
        self.vnodes = vnodes
        self.eps = eps
        self.weights: dict[str, float] = {}
        self._points: list[int] = []
        self._owners: list[str] = []
        self.version = 0

    def __len__(self) -> int:
        return len(self.weights)

    @property
    def shards(self) -> list[str]:
        return sorted(self.weights)

    def add(self, shard: str, weight: float = 1.0) -> None:
        if not shard or weight <= 0:
            raise BadRequest(f"a shard needs a name and a positive weight, got {shard!r}, {weight}")
        self.weights[shard] = float(weight)
        self._rebuild()

    def remove(self, shard: str) -> None:
        if self.weights.pop(shard, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        pts = []
        for shard, w in self.weights.items():
            for i in range(max(1, round(self.vnodes * w))):
                pts.append((xxhash.xxh64_intdigest(f"{shard}#{i}".encode()), shard))
        pts.sort()
        self._points = [p for p, _ in pts]
        self._owners = [s for _, s in pts]
        self.version += 1

    def _walk(self, key: bytes):
        n = len(self._points)
        if n == 0:
            raise Unavailable("the ring has no shards (the pool is starting, or its controller restarting): "
                              "retry shortly, or start the pool (kvpool up)")
        i = bisect.bisect_left(self._points, key_point(key))
        for j in range(n):
            yield self._owners[(i + j) % n]

    def owners(self, key: bytes, replicas: int = 1) -> list[str]:
        """The first ``replicas`` distinct shards clockwise from the key."""
        out: list[str] = []
        for s in self._walk(key):
            if s not in out:
                out.append(s)
                if len(out) == min(replicas, len(self.weights)):
                    break
        return out

    def bound(self, shard: str, total: int) -> int:
        """The most keys ``shard`` may hold when ``total`` keys are placed."""
        share = self.weights[shard] / sum(self.weights.values())
        return math.ceil((1 + self.eps) * share * total)

    def place(self, key: bytes, loads: Mapping[str, int], replicas: int = 1) -> list[str]:
        """Owners for a new chunk under bounded load; ``loads`` are the shards' current key counts
        (the caller adds the placed key to them)."""
        total = sum(loads.get(s, 0) for s in self.weights) + 1
        out: list[str] = []
        for s in self._walk(key):
            if s in out or loads.get(s, 0) + 1 > self.bound(s, total):
                continue
            out.append(s)
            if len(out) == min(replicas, len(self.weights)):
                return out
        # Every shard is at its bound (possible with eps = 0 and rounding): plain consistent hashing.
        return out + [s for s in self.owners(key, replicas) if s not in out][: replicas - len(out)]

    def to_dict(self) -> dict:
        return {"version": self.version, "vnodes": self.vnodes, "eps": self.eps, "weights": dict(self.weights)}

    @classmethod
    def from_dict(cls, d: dict) -> "HashRing":
        ring = cls(d["vnodes"], d["eps"])
        ring.weights = {k: float(v) for k, v in d["weights"].items()}
        ring._rebuild()
        ring.version = d["version"]
        return ring
