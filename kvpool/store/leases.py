"""Leases and read views: chunks pinned in place (neither evicted nor moved) until released; and
removal, which waits for a leased chunk's last release."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool.keys import ChunkKey, as_keys

if TYPE_CHECKING:
    from kvpool.store.chunk_store import ChunkStore


class Lease:
    """Pins chunks in place until released: they are neither evicted nor moved meanwhile."""

    __slots__ = ("_store", "_nodes", "keys")

    def __init__(self, store: "ChunkStore", nodes: list[int], keys: list[ChunkKey]) -> None:
        self._store = store
        self._nodes = nodes
        self.keys = keys

    def release(self) -> None:
        nodes, self._nodes = self._nodes, []
        if nodes:
            with self._store._lock:
                for n in nodes:
                    self._store._unlease(n)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __len__(self) -> int:
        return len(self._nodes)


class ChunkView(Lease):
    """A verified, read-only view of one stored payload, valid until released (zero-copy read)."""

    __slots__ = ("data",)

    def __init__(self, store: "ChunkStore", node: int, key: ChunkKey, data: np.ndarray) -> None:
        super().__init__(store, [node], [key])
        self.data = data


class LeasesMixin:
    # ------------------------------------------------------------------ removal, leases, pins

    def remove(self, key: ChunkKey, tenant: str) -> bool:
        return self.remove_many([key], tenant) == 1

    def remove_many(self, keys: Sequence[ChunkKey], tenant: str) -> int:
        """Removes the tenant's own chunks (shared ones only by their owner); returns how many."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        n = 0
        with self._lock:
            for k in keys:
                node = self._cache.index.get(k)
                if node is None or not self._ready[node] or self._tenant[node] != t_idx:
                    continue
                self._discard(node, "removed")
                n += 1
        return n

    def lease(self, keys: Sequence[ChunkKey], tenant: str) -> Lease:
        """Leases the resident chunks among ``keys`` that the tenant can see (a request in flight)."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        nodes, held = [], []
        with self._lock:
            for k in keys:
                node = self._visible(self._cache.index.get(k), t_idx)
                if node is not None:
                    self._cache.res.leases[node] += 1
                    nodes.append(node)
                    held.append(k)
        return Lease(self, nodes, held)

    def pin(self, keys: Sequence[ChunkKey], tenant: str) -> int:
        """Asks the policy to pin these chunks (warm-up); how many it pinned (zoned policies pin up
        to their cap, others none)."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        with self._lock:
            return sum(
                1 for k in keys
                if (n := self._visible(self._cache.index.get(k), t_idx)) is not None and self._cache.pin(n)
            )
