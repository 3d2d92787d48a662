"""``tiered``: three zones, the way operators run pools with pinned prefixes.

- **pinned**: never evicted. Hard cap: ``pinned_fraction`` of capacity (default 20%, at most
  25%). It holds operator pins (warm-up) while room lasts, then the hottest prefixes: a chunk hit
  ``hot_hits`` times is pinned, replacing a colder pinned chunk when the zone is full. Pins past
  the cap fall back to the LRU zone.
- **lru**: everything else, chunk-level LRU.
- **window**: the chunks of long contexts (more than ``long_context`` chunks) past their first
  ``head_chunks``. Whole contexts leave oldest first, each from its end backwards, so a context
  never loses chunks from the middle of its window. It gives up pages first once it holds more
  than ``window_fraction`` of the capacity.

NOTE: a sliding window in the attention sense would drop a long context's *oldest* tokens first.
In a prefix-keyed pool that orphans everything after them (a later lookup stops at the first
missing chunk), so the window zone drops from the end instead: what remains is still a usable
prefix. The zone's job, keeping long contexts from flushing everything else, is unchanged.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.errors import BadRequest
from kvpool.policies.base import Access, Policy, Residency
from kvpool.policies.links import SlotLists

PINNED, LRU, WINDOW = 0, 1, 2
MAX_PINNED_FRACTION = 0.25


class TieredPolicy(Policy):
    name = "tiered"
    description = "zones: pinned hottest prefixes (capped), LRU, and a window zone for long contexts"

    def __init__(self, capacity: int, residency: Residency, pinned_fraction: float = 0.2, hot_hits: int = 4,
                 long_context: int = 32, head_chunks: int = 4, window_fraction: float = 0.3) -> None:
        super().__init__(capacity, residency)
        if not 0 <= pinned_fraction <= MAX_PINNED_FRACTION:
            raise BadRequest(
                f"pinned_fraction {pinned_fraction} is outside [0, {MAX_PINNED_FRACTION}]: a pinned zone "
                "larger than a quarter of the pool starves everything else"
            )
        self.lists = SlotLists(capacity, 3)
        self.pin_cap = int(pinned_fraction * capacity)
        self.hot_hits = hot_hits
        self.long_context = long_context
        self.head_chunks = head_chunks
        self.window_cap = window_fraction * capacity
        self.hits = [0] * capacity
        self.contexts: OrderedDict[int, list[int]] = OrderedDict()  # request -> window chunks, root first
        self.context_of = [-1] * capacity

    # ---------------------------------------------------------------- events

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        self.hits[slot] = 0
        if access is not None and access.num_blocks > self.long_context and position >= self.head_chunks:
            rid = access.request_id
            self.contexts.setdefault(rid, []).append(slot)
            self.context_of[slot] = rid
            self.lists.push_tail(WINDOW, slot)
        else:
            self.lists.push_tail(LRU, slot)

    def on_access(self, slots: list[int], access: Access) -> None:
        hits, lists = self.hits, self.lists
        touched: list[int] = []
        for s in reversed(slots):  # leaf first: the root ends up most recent
            z = lists.where[s]
            if z == LRU:
                lists.move_to_tail(LRU, s)
            elif z == WINDOW:
                rid = self.context_of[s]
                if rid not in touched:
                    touched.append(rid)
        for rid in touched:
            self.contexts.move_to_end(rid)
        for s in slots[: access.hit_blocks]:
            hits[s] += 1
            if hits[s] >= self.hot_hits and lists.where[s] != PINNED:
                self._pin(s, explicit=False)

    def on_remove(self, slot: int) -> None:
        z = self.lists.remove(slot)
        if z == PINNED:
            self.res.pinned[slot] = False
        elif z == WINDOW:
            rid = self.context_of[slot]
            ctx = self.contexts[rid]
            ctx.remove(slot)
            if not ctx:
                del self.contexts[rid]
            self.context_of[slot] = -1

    def skip(self, slot: int) -> None:
        z = self.lists.where[slot]  # a chunk that could not move goes round (see LruPolicy.skip)
        if z == LRU:
            self.lists.move_to_tail(LRU, slot)
        elif z == WINDOW:
            self.contexts.move_to_end(self.context_of[slot])

    def on_pin(self, slot: int) -> bool:
        return self._pin(slot, explicit=True)

    # ---------------------------------------------------------------- pinning

    def _pin(self, slot: int, explicit: bool) -> bool:
        lists = self.lists
        if lists.size(PINNED) >= self.pin_cap:
            if explicit or self.pin_cap == 0:
                return False  # past the cap: stays in its zone
            # Replace the coldest of the oldest pins, if it is colder than this chunk.
            coldest, best = None, self.hits[slot]
            for i, p in enumerate(lists.iter_from_head(PINNED)):
                if i >= 32:
                    break
                if self.hits[p] < best:
                    coldest, best = p, self.hits[p]
            if coldest is None:
                return False
            self._unpin(coldest)
        self._leave_zone(slot)
        lists.push_tail(PINNED, slot)
        self.res.pinned[slot] = True
        return True

    def _unpin(self, slot: int) -> None:
        self.lists.remove(slot)
        self.res.pinned[slot] = False
        self.hits[slot] = 0  # it earns its pin again from scratch
        self.lists.push_tail(LRU, slot)

    def _leave_zone(self, slot: int) -> None:
        if self.lists.where[slot] == WINDOW:
            self.on_remove(slot)
        else:
            self.lists.remove(slot)

    # ---------------------------------------------------------------- eviction

    def victims(self) -> list[int]:
        if self.lists.size(WINDOW) > self.window_cap:
            out = self._window_victims()
            if out:
                return out
        can = self.can_evict
        for s in self.lists.iter_from_head(LRU):
            if can(s):
                return [s]
        return self._window_victims()

    def _window_victims(self) -> list[int]:
        return self.chain_tail(self.contexts.values())

    def stats(self) -> dict:
        return {"pinned": self.lists.size(PINNED), "lru": self.lists.size(LRU), "window": self.lists.size(WINDOW),
                "pin_cap": self.pin_cap}
