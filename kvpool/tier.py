"""A tier: a slab of pages, its allocator, its LRU order and the metadata of every page.

Per-page metadata lives in numpy arrays indexed by page number (plus one list for the keys), so
storing or dropping a chunk creates no Python object besides the key itself.
"""

from __future__ import annotations

import numpy as np

from kvpool.allocator import PageAllocator
from kvpool.keys import ChunkKey
from kvpool.lru import LruList
from kvpool.slab import Slab


class Tier:
    __slots__ = (
        "name", "slab", "alloc", "lru", "keys", "nbytes", "checksum", "tenant",
        "leases", "shared", "doomed", "used_bytes",
    )

    def __init__(self, name: str, slab: Slab) -> None:
        n = slab.num_pages
        self.name = name
        self.slab = slab
        self.alloc = PageAllocator(n)
        self.lru = LruList(n)
        self.keys: list[ChunkKey | None] = [None] * n
        self.nbytes = np.zeros(n, dtype=np.int64)
        self.checksum = np.zeros(n, dtype=np.uint64)
        self.tenant = np.zeros(n, dtype=np.int32)
        self.leases = np.zeros(n, dtype=np.int32)
        self.shared = np.zeros(n, dtype=np.bool_)
        # Removed while leased: invisible at once, its page freed when the last lease ends.
        self.doomed = np.zeros(n, dtype=np.bool_)
        self.used_bytes = 0

    @property
    def num_pages(self) -> int:
        return self.slab.num_pages

    def payload(self, page: int) -> np.ndarray:
        """The stored bytes of ``page`` (a view)."""
        return self.slab.page(page)[: int(self.nbytes[page])]

    def set_entry(self, page: int, key: ChunkKey, nbytes: int, checksum: int, tenant: int, shared: bool) -> None:
        self.keys[page] = key
        self.nbytes[page] = nbytes
        self.checksum[page] = checksum
        self.tenant[page] = tenant
        self.shared[page] = shared
        self.doomed[page] = False
        self.used_bytes += nbytes

    def clear_entry(self, page: int) -> None:
        """Forgets the entry on ``page`` and frees the page. The caller has unlinked it."""
        assert self.leases[page] == 0, (self.name, page)
        self.used_bytes -= int(self.nbytes[page])
        self.keys[page] = None
        self.nbytes[page] = 0
        self.doomed[page] = False
        self.alloc.free(page)

    def metadata_bytes(self) -> int:
        arrays = (self.nbytes, self.checksum, self.tenant, self.leases, self.shared, self.doomed)
        links = self.lru.nbytes + self.alloc.nbytes
        # The keys list holds a pointer per page, and each resident key is a 16-byte bytes object.
        keys = 8 * len(self.keys) + 49 * self.alloc.num_used
        return sum(a.nbytes for a in arrays) + links + keys
