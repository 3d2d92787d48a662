"""Reads: get / get_many (copies), read (a zero-copy view), contains, and telling the policy which
chunks a request used."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvpool.buffers import as_byte_array
from kvpool.checksum import checksum, copy_with_checksum
from kvpool.errors import BadRequest
from kvpool.keys import ChunkKey, as_key, as_keys
from kvpool.policies import Access
from kvpool.store.checks import _as_list, _check_flag
from kvpool.store.leases import ChunkView


class ReadsMixin:
    # ------------------------------------------------------------------ reads

    def get(self, key: ChunkKey, tenant: str, out: object | None = None) -> np.ndarray | None:
        """The chunk's bytes copied into ``out`` (or a new array), verified; None on a miss."""
        return self.get_many([key], tenant, None if out is None else [out])[0]

    def get_many(
        self, keys: Sequence[ChunkKey], tenant: str, outs: Sequence[object] | None = None, *, touch: bool = True
    ) -> list[np.ndarray | None]:
        """Each chunk copied out and verified, or None. ``touch`` tells the policy they were used
        (a request-level caller that reports the whole request once passes False)."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        if outs is not None:
            outs = _as_list("outs", outs)
            if len(outs) != len(keys):
                raise BadRequest(f"get_many got {len(keys)} keys but {len(outs)} output buffers")
        dsts = [None if outs is None else as_byte_array(o, writable=True) for o in (outs or keys)]
        result: list[np.ndarray | None] = [None] * len(keys)
        bad = [False] * len(keys)
        with self._lock:
            for i, dst in enumerate(dsts):  # before anything is leased, moved or counted
                node = None if dst is None else self._visible(self._cache.index.get(keys[i]), t_idx)
                if node is not None and dst.shape[0] < self._nbytes[node]:
                    raise BadRequest(f"output buffer {i} holds {dst.shape[0]} B; the chunk has "
                                     f"{int(self._nbytes[node])} B: pass buffers of the chunk's size")
            nodes = [self._acquire_for_read(k, t_idx) for k in keys]
            if touch:
                self._touch([n for n in nodes if n is not None])
        try:
            for i, node in enumerate(nodes):
                if node is None:
                    continue
                src = self._payload(node)
                dst = dsts[i]
                if dst is None:
                    dst = np.empty(src.shape[0], dtype=np.uint8)
                else:
                    dst = dst[: src.shape[0]]  # sizes were checked above, under the lock
                if copy_with_checksum(dst, src) == int(self._checksum[node]):
                    result[i] = dst
                else:
                    bad[i] = True
        finally:
            with self._lock:
                for i, node in enumerate(nodes):
                    if node is None:
                        continue
                    if bad[i]:
                        self._corrupt(node)
                    self._unlease(node)
                self._count_reads(tenant, result)
        return result

    def read(self, key: ChunkKey, tenant: str, *, touch: bool = True) -> ChunkView | None:
        """A verified zero-copy view of the chunk, leased until released; None on a miss.

        Use as ``view = store.read(k, t)`` then ``with view: ...``; the bytes must not be used
        after release. ``touch=False`` keeps the read from the eviction policy (a request that
        reports its whole prefix once, when it saves).
        """
        t_idx = self.tenants.index(tenant)
        key = as_key(key)
        touch = _check_flag("touch", touch)
        with self._lock:
            node = self._acquire_for_read(key, t_idx)
            if node is not None and touch:
                self._touch([node])
        if node is None:
            with self._lock:
                self._count_reads(tenant, [None])
            return None
        data = self._payload(node)
        ok = checksum(data) == int(self._checksum[node])
        with self._lock:
            self._count_reads(tenant, [data if ok else None])
            if not ok:
                self._corrupt(node)
                self._unlease(node)
                return None
        data = data.view()
        data.flags.writeable = False
        return ChunkView(self, node, key, data)

    def contains(self, key: ChunkKey, tenant: str) -> bool:
        return self.contains_many([key], tenant)[0]

    def contains_many(self, keys: Sequence[ChunkKey], tenant: str) -> list[bool]:
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        index = self._cache.index
        with self._lock:
            return [self._visible(index.get(k), t_idx) is not None for k in keys]

    def touch(self, keys: Sequence[ChunkKey], tenant: str) -> int:
        """Hits the caller read itself (an engine, from the node's slab): counted and told to the
        eviction policy as any read here; how many of ``keys`` it holds."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        with self._lock:
            nodes = [n for n in (self._visible(self._cache.index.get(k), t_idx) for k in keys) if n is not None]
            self._touch(nodes)
            if nodes:
                self.metrics.hits_chunks.inc(len(nodes), tenant)
                self.metrics.get_bytes.inc(int(sum(self._nbytes[n] for n in nodes)), tenant)
        return len(nodes)

    def new_access(self, num_blocks: int, full_blocks: int, hit_blocks: int = 0) -> Access:
        """A request as the policy sees it, with an id from the store's one counter.

        NOTE: every request id comes from here: two counters (a pool's and the store's) minted the
        same ids for different requests, and whole-request policies merged their groups."""
        return Access(next(self._requests), time.monotonic(), num_blocks, full_blocks, hit_blocks)

    def access(self, keys: Sequence[ChunkKey], tenant: str, access: Access) -> None:
        """Tells the policy that one request used these chunks (root to leaf)."""
        t_idx = self.tenants.index(tenant)
        with self._lock:
            nodes = []
            for k in keys:
                n = self._visible(self._cache.index.get(as_key(k)), t_idx)
                if n is None:
                    break
                nodes.append(n)
            self._cache.access(nodes, access)

    def _count_reads(self, tenant: str, result: Sequence[np.ndarray | None]) -> None:
        hits = sum(r is not None for r in result)
        m = self.metrics
        if hits:
            m.hits_chunks.inc(hits, tenant)
            m.get_bytes.inc(sum(r.shape[0] for r in result if r is not None), tenant)
        if len(result) - hits:
            m.misses_chunks.inc(len(result) - hits, tenant)
