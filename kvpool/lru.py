"""An LRU order over page numbers: a doubly linked list whose links live in numpy arrays.

O(1) insert, touch and removal from the middle, and no Python object per page or per operation.
Index ``n`` is the sentinel: ``next[n]`` is the most recently used page, ``prev[n]`` the least.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class LruList:
    __slots__ = ("_prev", "_next", "_in", "_head", "_len")

    def __init__(self, num_pages: int) -> None:
        n = num_pages
        self._prev = np.full(n + 1, n, dtype=np.int64)
        self._next = np.full(n + 1, n, dtype=np.int64)
        self._in = np.zeros(n + 1, dtype=np.bool_)
        self._head = n
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        return self._prev.nbytes + self._next.nbytes + self._in.nbytes

    def __contains__(self, page: int) -> bool:
        return bool(self._in[page])

    def push_mru(self, page: int) -> None:
        assert not self._in[page], page
        h = self._head
        first = self._next[h]
        self._prev[page] = h
        self._next[page] = first
        self._prev[first] = page
        self._next[h] = page
        self._in[page] = True
        self._len += 1

    def remove(self, page: int) -> None:
        assert self._in[page], page
        p, n = self._prev[page], self._next[page]
        self._next[p] = n
        self._prev[n] = p
        self._in[page] = False
        self._len -= 1

    def touch(self, page: int) -> None:
        self.remove(page)
        self.push_mru(page)

    def iter_lru(self) -> Iterator[int]:
        """Pages from least to most recently used. Do not modify the list while iterating."""
        h = self._head
        page = int(self._prev[h])
        while page != h:
            yield page
            page = int(self._prev[page])
