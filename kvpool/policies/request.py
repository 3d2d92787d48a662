"""Whole-request policies: all chunks a request stored go together (``request-fifo``,
``request-lru``)."""

from __future__ import annotations

from collections import OrderedDict

from kvpool.policies.base import Access, Policy, Residency


class RequestFifoPolicy(Policy):
    name = "request-fifo"
    description = "whole requests, first stored first evicted"
    touch_on_hit = False

    def __init__(self, capacity: int, residency: Residency) -> None:
        super().__init__(capacity, residency)
        # request id -> its resident chunks, root to leaf; oldest request first
        self.groups: OrderedDict[int, list[int]] = OrderedDict()
        self.group_of = [-1] * capacity

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        rid = self.res.request[slot]
        g = self.groups.get(rid)
        if g is None:
            g = self.groups[rid] = []
        # A chunk moved here from another tier joins its request's group in depth order.
        if g and self.res.depth[g[-1]] > self.res.depth[slot]:
            g.append(slot)
            g.sort(key=self.res.depth.__getitem__)
        else:
            g.append(slot)
        self.group_of[slot] = rid

    def on_access(self, slots: list[int], access: Access) -> None:
        if not self.touch_on_hit:
            return
        seen = set()
        for s in reversed(slots):
            rid = self.group_of[s]
            if rid not in seen:
                seen.add(rid)
                self.groups.move_to_end(rid)

    def on_remove(self, slot: int) -> None:
        rid = self.group_of[slot]
        self.group_of[slot] = -1
        g = self.groups[rid]
        g.remove(slot)
        if not g:
            del self.groups[rid]

    def skip(self, slot: int) -> None:
        rid = self.group_of[slot]  # a request whose chunks could not go goes round (see LruPolicy.skip)
        if rid in self.groups:
            self.groups.move_to_end(rid)

    def victims(self) -> list[int]:
        return self.chain_tail(self.groups.values())


class RequestLruPolicy(RequestFifoPolicy):
    name = "request-lru"
    description = "whole requests, least recently used request first"
    touch_on_hit = True
