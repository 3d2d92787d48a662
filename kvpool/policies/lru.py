"""Chunk-level policies: ``reject`` (no eviction, the baseline) and ``lru`` (what vLLM and SGLang
do by default)."""

from __future__ import annotations

from kvpool.policies.base import Access, Policy, Residency
from kvpool.policies.links import SlotLists


class RejectPolicy(Policy):
    name = "reject"
    description = "no eviction: a write into a full pool is refused (507), the baseline"

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        pass

    def on_access(self, slots: list[int], access: Access) -> None:
        pass

    def on_remove(self, slot: int) -> None:
        pass

    def victims(self) -> list[int]:
        return []


class LruPolicy(Policy):
    name = "lru"
    description = "chunk-level least recently used"

    def __init__(self, capacity: int, residency: Residency) -> None:
        super().__init__(capacity, residency)
        self.lists = SlotLists(capacity, 1)

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        self.lists.push_tail(0, slot)

    def on_access(self, slots: list[int], access: Access) -> None:
        # NOTE: leaf first, so the root ends up most recent: a prefix is always more recent than
        # its suffix and the LRU end holds leaves, which is what the prefix rule lets us evict.
        move = self.lists.move_to_tail
        for s in reversed(slots):
            move(0, s)

    def on_remove(self, slot: int) -> None:
        self.lists.remove(slot)

    def skip(self, slot: int) -> None:
        # A tier that demotes offers prefixes too; one that could not move (the tier below is full
        # of chunks that cannot go) goes round, or it would be offered first again and again.
        if self.lists.where[slot] >= 0:
            self.lists.move_to_tail(0, slot)

    def victims(self) -> list[int]:
        can = self.can_evict
        for s in self.lists.iter_from_head(0):
            if can(s):
                return [s]
        return []
