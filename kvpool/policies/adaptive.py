"""``adaptive``: kvpool's own policy, and the pool's default.

S3-FIFO's idea (most KV chunks are used once: make new chunks prove themselves in a small
probation queue before they take room in the main queue) with two changes measured on the
Mooncake conversation trace and on the generated workloads (docs/benchmarks.md):

1. The probation queue's size adapts instead of being 10% of the cache. A chunk that comes back
   soon after probation dropped it (a hit in the probation ghost) says probation is too short; a
   chunk that comes back after main dropped it (a hit in the main ghost) says main is too small.
   Each ghost hit moves the target by ARC's rule (Megiddo & Modha, FAST'03): one slot, scaled by
   the ratio of the ghosts' sizes. At small capacities the target settles low (S3-FIFO's quick
   demotion wins there), at large ones it grows towards LRU-like behaviour, where plain S3-FIFO
   loses to LRU. It starts at half the cache, not at S3-FIFO's 10%: starting low cost up to 0.6%
   of hits against LRU on the generated chat workloads while the target climbed, starting in the
   middle cost nothing anywhere measured.
2. The trailing partial chunk of a prompt is not admitted: a later prompt can only reuse it if it
   repeats the prompt exactly, so it is almost never hit (0.7% on the conversation trace) but
   takes a page like any other chunk.

Prefix-aware like every policy: a cold prefix is emptied from its leaves up by the cache.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.policies.base import Access, Residency
from kvpool.policies.s3fifo import MAIN, SMALL, S3FifoPolicy


class AdaptivePolicy(S3FifoPolicy):
    name = "adaptive"
    description = "kvpool's: S3-FIFO with a probation size adapted by ghost hits (ARC's rule); skips partial chunks"

    def __init__(self, capacity: int, residency: Residency, small_fraction: float = 0.5,
                 min_fraction: float = 0.01, max_fraction: float = 0.9, gain: float = 1.0) -> None:
        super().__init__(capacity, residency, small_fraction)
        self.ghost_main: OrderedDict[object, None] = OrderedDict()
        self.target = small_fraction * capacity
        self.lo = min_fraction * capacity
        self.hi = max_fraction * capacity
        self.gain = gain

    def small_target(self) -> float:
        return self.target

    def admit(self, position: int, access: Access, parent: int, key: object) -> bool:
        return position < access.full_blocks

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        key = self.res.key[slot]
        if key in self.ghost:  # probation dropped it too early
            step = self.gain * max(1.0, len(self.ghost_main) / max(len(self.ghost), 1))
            self.target = min(self.hi, self.target + step)
        elif key in self.ghost_main:  # main dropped it: main too small
            step = self.gain * max(1.0, len(self.ghost) / max(len(self.ghost_main), 1))
            self.target = max(self.lo, self.target - step)
            del self.ghost_main[key]
            self.freq[slot] = 0
            self.size += 1
            self.lists.push_tail(MAIN, slot)
            return
        super().on_insert(slot, position, access)

    def on_remove(self, slot: int) -> None:
        if self.lists.where[slot] == MAIN:
            self.ghost_main[self.res.key[slot]] = None
            if len(self.ghost_main) > self.capacity:
                self.ghost_main.popitem(last=False)
        super().on_remove(slot)

    def stats(self) -> dict:
        return {"probation_fraction": self.target / max(self.capacity, 1),
                "probation_chunks": self.lists.size(SMALL), "main_chunks": self.lists.size(MAIN)}
