"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23) made prefix-aware.

New chunks enter a small FIFO; a chunk hit while there moves to the main FIFO when it reaches
the head, others leave and are remembered in a ghost list; a ghost that comes back enters main
directly. Main is a FIFO with reinsertion (a CLOCK with a 2-bit counter).
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.policies.base import Access, Policy, Residency
from kvpool.policies.links import SlotLists

SMALL, MAIN = 0, 1


class S3FifoPolicy(Policy):
    name = "s3fifo"
    description = "S3-FIFO: small probation FIFO, main FIFO with reinsertion, ghost list"

    def __init__(self, capacity: int, residency: Residency, small_fraction: float = 0.1) -> None:
        super().__init__(capacity, residency)
        self.lists = SlotLists(capacity, 2)
        self.freq = [0] * capacity
        self.small_fraction = small_fraction
        self.ghost: OrderedDict[object, None] = OrderedDict()
        self.pending: list[int] = []
        self.size = 0
        # Candidates the cache could not use since the last removal, per queue: once a queue has
        # gone all the way round, the other queue gives victims.
        self.stuck = [0, 0]

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        self.freq[slot] = 0
        self.size += 1
        key = self.res.key[slot]
        if key in self.ghost:
            del self.ghost[key]
            self.lists.push_tail(MAIN, slot)
        elif access is None:
            self.lists.push_tail(MAIN, slot)
        else:
            self.pending.append(slot)

    def on_access(self, slots: list[int], access: Access) -> None:
        freq = self.freq
        for s in slots[: access.hit_blocks]:
            if freq[s] < 3:
                freq[s] += 1
        self._join_pending()

    def _join_pending(self) -> None:
        # New chunks join small leaf first, so a chain's leaf leaves before its root.
        for s in reversed(self.pending):
            if self.lists.where[s] == -1 and self.res.resident[s]:
                self.lists.push_tail(SMALL, s)
        self.pending.clear()

    def on_remove(self, slot: int) -> None:
        self.stuck[0] = self.stuck[1] = 0
        q = self.lists.remove(slot)
        if q == -1 and slot in self.pending:
            self.pending.remove(slot)
        elif q == SMALL and self.freq[slot] == 0:
            self._remember(slot)
        self.size -= 1

    def skip(self, slot: int) -> None:
        q = self.lists.where[slot]
        if q >= 0:
            self.stuck[q] += 1
            self.lists.move_to_tail(q, slot)

    def _remember(self, slot: int) -> None:
        self.ghost[self.res.key[slot]] = None
        if len(self.ghost) > self.capacity:
            self.ghost.popitem(last=False)

    def small_target(self) -> float:
        return self.small_fraction * max(self.size, 1)

    def victims(self) -> list[int]:
        lists, freq = self.lists, self.freq
        budget = 5 * self.size + 8
        while budget > 0:
            budget -= 1
            n_small, n_main = lists.size(SMALL), lists.size(MAIN)
            if self.pending and (n_small + n_main == 0 or budget == 0):
                # NOTE: a request still storing its chunks (a prompt longer than the queues hold) is
                # told of at its end; when nothing else can go, its chunks stored so far join small now.
                self._join_pending()
                budget = max(budget, 5 * self.size + 8)
                continue
            if n_small + n_main == 0:
                return []
            q = SMALL if n_small and (n_small >= self.small_target() or not n_main) else MAIN
            if self.stuck[q] >= lists.size(q) and lists.size(1 - q):
                q = 1 - q
            s = lists.head(q)
            if not self.movable(s):
                # NOTE: a chunk that cannot go now (leased, pinned) goes round again; O(1). A
                # prefix of resident chunks is returned all the same: the cache evicts its
                # suffix's leaves first.
                self.stuck[q] += 1
                lists.move_to_tail(q, s)
                continue
            if freq[s] > 0:
                freq[s] = 0 if q == SMALL else freq[s] - 1
                lists.move_to_tail(MAIN, s)
                continue
            return [s]
        return []
