"""Fixed-size page allocator: a free stack in one numpy array, no Python objects per operation."""

from __future__ import annotations

import numpy as np


class PageAllocator:
    """Hands out page numbers ``0..num_pages-1``.

    The most recently freed page is handed out first: its bytes are the likeliest still in cache.
    """

    __slots__ = ("num_pages", "_free", "_top", "_used")

    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 0, num_pages
        self.num_pages = num_pages
        # Page 0 on top of the stack, so a fresh allocator hands out 0, 1, 2, ...
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._used = np.zeros(num_pages, dtype=np.bool_)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    def alloc(self) -> int | None:
        """A free page, or None when every page is in use."""
        if self._top == 0:
            return None
        self._top -= 1
        page = int(self._free[self._top])
        assert not self._used[page], page
        self._used[page] = True
        return page

    def free(self, page: int) -> None:
        assert self._used[page], f"double free of page {page}"
        self._used[page] = False
        self._free[self._top] = page
        self._top += 1

    @property
    def nbytes(self) -> int:
        return self._free.nbytes + self._used.nbytes

