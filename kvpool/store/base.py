"""The state of a chunk store and the lock that guards it: the slabs, the tiered cache, the
per-node arrays, the requests and holds; and the internals (lock held) that every part uses."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from kvpool.cache import TieredCache
from kvpool.keys import ChunkKey
from kvpool.metrics import Metrics
from kvpool.policies import Access, make_policy
from kvpool.slab import Slab
from kvpool.store.config import StoreConfig
from kvpool.store.holds import _Hold
from kvpool.store.requests import ActiveRequest
from kvpool.tenants import TenantRegistry


class StoreBase:
    def __init__(
        self, config: StoreConfig, tenants: TenantRegistry | None = None, metrics: Metrics | None = None
    ) -> None:
        self.config = config
        self.tenants = tenants if tenants is not None else TenantRegistry()
        self.metrics = metrics if metrics is not None else Metrics()
        self._lock = threading.Lock()
        if config.dram_dir:
            self._slabs = [Slab.mapped_file("dram", config.dram_dir, config.page_bytes, config.dram_pages,
                                            name=f"kvpool-{config.name}-dram.kvslab")]
        else:
            self._slabs = [Slab.dram(config.page_bytes, config.dram_pages, config.pin_memory)]
        if config.disk_pages:
            self._slabs.append(Slab.mapped_file("disk", config.disk_dir, config.page_bytes, config.disk_pages))
        self.tier_names = [s.tier for s in self._slabs]
        params = dict(config.policy_params)
        self._cache = TieredCache(
            [s.num_pages for s in self._slabs],
            lambda cap, res, t: make_policy(config.policy, cap, res, **params),
            hooks=self,
        )
        n = self._cache.capacity
        self._nbytes = np.zeros(n, dtype=np.int64)
        self._checksum = np.zeros(n, dtype=np.uint64)
        self._tenant = np.zeros(n, dtype=np.int32)
        self._shared = np.zeros(n, dtype=np.bool_)
        self._ready = np.zeros(n, dtype=np.bool_)  # bytes in place: findable
        self._doomed = np.zeros(n, dtype=np.bool_)  # removed while leased: dropped at last release
        self._requests = itertools.count(1)
        self._active: dict[int, ActiveRequest] = {}
        self._holds: dict[int, _Hold] = {}  # reservations and read leases of other processes
        self._read_held: dict[int, int] = {}  # tenant index -> pages its read leases hold
        self._gone: list[ChunkKey] = []  # findable chunks that left since take_gone(): the index forgets them
        self.track_gone = False  # a shard that publishes to an index turns this on
        # The node's shard lists its ready DRAM chunks here for same-node readers (kvpool.node.table).
        self.table = None
        self._writer = -1  # tenant index of the write making room now (for guaranteed shares)
        self.tenants.pool_bytes = sum(s.nbytes for s in self._slabs)
        for s in self._slabs:
            self.metrics.pages_total.set(s.num_pages, s.tier)
        self._evictor: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._closing = False
        if config.background_eviction:
            self._evictor = threading.Thread(target=self._evict_loop, name="kvpool-evictor", daemon=True)
            self._evictor.start()

    def close(self) -> None:
        if self._evictor is not None:
            with self._wake:
                self._closing = True
                self._wake.notify()
            self._evictor.join(timeout=5)
        with self._lock:
            assert not any(self._cache.res.leases), "closing a store with live leases"
            if self.table is not None:  # readers see its epoch change before the slab goes
                self.table.close()
                self.table = None
            for s in self._slabs:
                s.close()
            self._cache.index.clear()

    # ------------------------------------------------------------------ internals (lock held)

    def _payload(self, node: int) -> np.ndarray:
        c = self._cache
        return self._slabs[c.node_tier[node]].page(c.node_page[node])[: int(self._nbytes[node])]

    def _visible(self, node: int | None, t_idx: int) -> int | None:
        if node is None or not self._ready[node]:
            return None
        if self._tenant[node] == t_idx or self._shared[node]:
            return node
        return None

    def _acquire_for_read(self, key: ChunkKey, t_idx: int) -> int | None:
        """Leases the chunk for a read, promoting it to the top tier first when it can move."""
        node = self._visible(self._cache.index.get(key), t_idx)
        if node is None:
            return None
        cache = self._cache
        if cache.node_tier[node] > 0 and cache.res.leases[node] == 0:
            cache.promote(node)  # NOTE: under the lock; disk hits are the slow path
            if self._cache.index.get(key) != node:  # its bytes failed verification: dropped
                return None
        cache.res.leases[node] += 1
        return node

    def _touch(self, nodes: list[int]) -> None:
        if nodes:
            self._cache.access(nodes, Access(next(self._requests), time.monotonic(), len(nodes), len(nodes), len(nodes)))

    def _unlease(self, node: int) -> None:
        res = self._cache.res
        res.leases[node] -= 1
        assert res.leases[node] >= 0, node
        if res.leases[node] == 0 and self._doomed[node]:
            self._cache.drop(node, "removed")

    def _show(self, node: int, page: int | None = None) -> None:
        """Lists a ready chunk of the DRAM slab in the page table (``page``: where it is moving to)."""
        c = self._cache
        if self.table is not None and self._ready[node] and (page is not None or c.node_tier[node] == 0):
            page = c.node_page[node] if page is None else page
            self.table.publish(bytes(c.node_key[node]), page * self.config.page_bytes, int(self._nbytes[node]),
                               int(self._checksum[node]))

    def _unshow(self, node: int) -> None:
        """Takes a chunk out of the page table. NOTE: before its page is scrubbed, freed or reused: a
        same-node reader copying it then fails its validation (kvpool.node.table)."""
        key = self._cache.node_key[node]
        if self.table is not None and key is not None:
            self.table.withdraw(bytes(key))

    def _discard(self, node: int, reason: str) -> None:
        """Hides a chunk now; frees it now, or at its last release when leased."""
        self._unshow(node)
        if self._cache.res.leases[node]:
            self._cache.hide(node)
            self._doomed[node] = True
        else:
            self._cache.drop(node, reason)

    def _corrupt(self, node: int) -> None:
        if not self._doomed[node]:
            c = self._cache
            self.metrics.checksum_failures.inc(1, self.tier_names[c.node_tier[node]])
            self._discard(node, "removed")  # counted here, not again by the drop
