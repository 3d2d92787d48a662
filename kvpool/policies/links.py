"""Several doubly linked lists over one slot space, links in plain lists (no object per node).

A slot is in at most one list at a time. List ``l`` has its sentinel at index ``capacity + l``:
``next[sentinel]`` is the head (oldest / least recently used), ``prev[sentinel]`` the tail.
"""

from __future__ import annotations

from collections.abc import Iterator


class SlotLists:
    __slots__ = ("capacity", "prev", "next", "where", "sizes")

    def __init__(self, capacity: int, nlists: int = 1) -> None:
        n = capacity + nlists
        self.capacity = capacity
        self.prev = list(range(n))
        self.next = list(range(n))
        self.where = [-1] * capacity  # list of each slot, -1 when in none
        self.sizes = [0] * nlists

    def __len__(self) -> int:
        return sum(self.sizes)

    def size(self, lst: int) -> int:
        return self.sizes[lst]

    def push_tail(self, lst: int, slot: int) -> None:
        assert self.where[slot] == -1, (slot, self.where[slot])
        s = self.capacity + lst
        last = self.prev[s]
        self.prev[slot] = last
        self.next[slot] = s
        self.next[last] = slot
        self.prev[s] = slot
        self.where[slot] = lst
        self.sizes[lst] += 1

    def push_head(self, lst: int, slot: int) -> None:
        assert self.where[slot] == -1, (slot, self.where[slot])
        s = self.capacity + lst
        first = self.next[s]
        self.next[slot] = first
        self.prev[slot] = s
        self.prev[first] = slot
        self.next[s] = slot
        self.where[slot] = lst
        self.sizes[lst] += 1

    def remove(self, slot: int) -> int:
        """Unlinks ``slot``; returns the list it was in (-1 if none)."""
        lst = self.where[slot]
        if lst < 0:
            return -1
        p, n = self.prev[slot], self.next[slot]
        self.next[p] = n
        self.prev[n] = p
        self.where[slot] = -1
        self.sizes[lst] -= 1
        return lst

    def move_to_tail(self, lst: int, slot: int) -> None:
        self.remove(slot)
        self.push_tail(lst, slot)

    def head(self, lst: int) -> int | None:
        h = self.next[self.capacity + lst]
        return None if h >= self.capacity else h

    def iter_from_head(self, lst: int) -> Iterator[int]:
        """Oldest first. Do not change the list while iterating."""
        cap = self.capacity
        s = self.next[cap + lst]
        while s < cap:
            yield s
            s = self.next[s]

    def iter_from_tail(self, lst: int) -> Iterator[int]:
        cap = self.capacity
        s = self.prev[cap + lst]
        while s < cap:
            yield s
            s = self.prev[s]
