"""Writes: put / put_many, and making room for them (evicting, or cancelling the lowest-priority
request in flight when nothing can be evicted)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.buffers import as_byte_array
from kvpool.checksum import copy_with_checksum
from kvpool.errors import BadRequest, ChunkTooLarge, PoolFull, QuotaExceeded, RequestCancelled
from kvpool.keys import ChunkKey, as_key, as_keys
from kvpool.policies import NO_PARENT, Access
from kvpool.store.checks import _as_list, _check_flag, _check_position, _check_request
from kvpool.store.requests import ActiveRequest


class WritesMixin:
    # ------------------------------------------------------------------ writes

    @property
    def page_bytes(self) -> int:
        return self.config.page_bytes

    def put(self, key: ChunkKey, payload: object, tenant: str, *, shared: bool = False,
            parent: ChunkKey | None = None, request: ActiveRequest | None = None) -> bool:
        """Stores one chunk; True if stored, False if already resident or not admitted."""
        return self.put_many([key], [payload], tenant, shared=shared, parent=parent, request=request)[0]

    def put_many(
        self, keys: Sequence[ChunkKey], payloads: Sequence[object], tenant: str, *, shared: bool = False,
        parent: ChunkKey | None = None, first_position: int = 0, access: Access | None = None,
        request: ActiveRequest | None = None,
    ) -> list[bool]:
        """Stores consecutive chunks of one prompt (``keys[i]`` follows ``keys[i-1]``; ``parent`` is
        the chunk before ``keys[0]``, if any). A True per chunk stored.

        The quota is charged for the whole batch first: a 429 leaves the store as it was. The
        policy may decline a chunk (then nothing after it is stored: a suffix without its prefix
        is unreachable; nothing is stored under a ``parent`` no longer there either). When nothing
        can be evicted, the lowest-priority request in flight is cancelled (RequestCancelled, 429,
        to its owner); with no request in flight it is a 507 naming the pool's sizes. Either keeps the chunks stored before it, which are valid, and
        refunds the rest. A prompt longer than the pool (every tier together; the DRAM tier for
        chunks that stay leased) stops where it no longer fits, its leading chunks stored, and
        cancels no request for it. Chunks written for a ``request`` stay leased until it ends.
        """
        _check_request(request)
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        payloads = _as_list("payloads", payloads)
        shared = _check_flag("shared", shared)
        first_position = _check_position(first_position)
        if len(keys) != len(payloads):
            raise BadRequest(f"put_many got {len(keys)} keys but {len(payloads)} payloads")
        if parent is not None:
            parent = as_key(parent)
        srcs = [self._checked_payload(p) for p in payloads]
        stored = [False] * len(keys)
        cache = self._cache
        with self._lock:
            if len(set(keys)) != len(keys):
                raise BadRequest("put_many got the same key twice: keys of one prompt are all distinct")
            new_bytes = sum(s.shape[0] for k, s in zip(keys, srcs) if k not in cache.index)
            if new_bytes == 0 or (parent is not None and self._visible(cache.index.get(parent), t_idx) is None):
                return stored  # nothing new; or its prefix is gone: a suffix without it is unreachable
            try:
                self.tenants.charge(t_idx, new_bytes)
            except QuotaExceeded:
                self.metrics.rejected_quota.inc(1, tenant)
                raise
            report = access is None  # a standalone write tells the policy itself
            if access is None:
                access = self.new_access(first_position + len(keys), first_position + len(keys), first_position)
            held: list[int] = []  # leased to the end: the parent and chunks found resident
            nodes: list[int] = []
            prev = self._visible(cache.index.get(parent), t_idx) if parent is not None else None
            if prev is not None:
                cache.res.leases[prev] += 1
                held.append(prev)
                nodes.append(prev)
        charged = new_bytes
        top = self._slabs[0]
        writing = None  # inserted, leased, bytes not yet in place
        # NOTE: this loop is not TieredCache.serve (the simulator's and the concurrency
        # benchmark's routine). serve runs a whole request in one pass over a tree nothing else
        # changes meanwhile; here each chunk's bytes are copied with the lock released (between
        # inserting the chunk, leased and not ready, and marking it ready), so another writer may
        # evict the previous chunk meanwhile and the chain is re-checked under the lock at every
        # step. Calling serve would mean holding the lock across every copy, serialising all
        # readers and writers. The loop also chains only through chunks visible to the tenant,
        # starts at a parent given by key (no leading-run lookup, no promotion: a write is not a
        # read), meets PoolFull by cancelling the lowest-priority request and retrying
        # (self._insert), leaves a streaming request's chunks leased, and drops a chunk whose copy
        # never finished.
        try:
            for i, (k, src) in enumerate(zip(keys, srcs)):
                nb = src.shape[0]
                with self._lock:
                    if i and (prev is None or cache.index.get(keys[i - 1]) != prev):
                        break  # the previous chunk is gone (evicted by another writer): stop the chain
                    node = cache.index.get(k)
                    if node is not None:  # already resident (or a racing writer's): chain through it
                        if self._visible(node, t_idx) is None:
                            break
                        cache.res.leases[node] += 1
                        held.append(node)
                        nodes.append(node)
                        prev = node
                        continue
                    node = self._insert(k, prev, first_position + i, access, t_idx, request, len(keys) - i,
                                        request is not None)
                    if node is None:  # the policy declined it
                        break
                    writing = node
                    page = cache.node_page[node]
                # The node is leased and not yet ready: no reader finds it, nothing evicts it.
                cs = copy_with_checksum(top.page(page)[:nb], src)
                with self._lock:
                    self._nbytes[node] = nb
                    self._checksum[node] = cs
                    self._tenant[node] = t_idx
                    self._shared[node] = shared
                    self._ready[node] = True
                    self._show(node)
                    writing = None
                    if request is not None and not request.cancelled:
                        request.nodes.append(node)  # stays leased: the request is streaming
                    else:
                        self._unlease(node)
                    charged -= nb
                    stored[i] = True
                    nodes.append(node)
                    self.metrics.puts.inc(1, tenant)
                    self.metrics.put_bytes.inc(nb, tenant)
                    prev = node
        except PoolFull:
            with self._lock:
                self.metrics.rejected_full.inc(1, top.tier)
            raise
        finally:
            with self._lock:
                if report and nodes:  # NOTE: on a failure too: a policy that has not heard of a stored
                    cache.access(nodes, access)  # chunk (s3fifo's pending) would never offer it for eviction
                if charged:
                    self.tenants.refund(t_idx, charged)
                for n in held:
                    self._unlease(n)
                if writing is not None:  # the copy never finished: nothing may find it
                    self._unlease(writing)
                    cache.drop(writing, "removed")
                self._maybe_wake_evictor()
        return stored

    def _insert(self, key: ChunkKey, prev: int | None, position: int, access: Access, t_idx: int,
                request: ActiveRequest | None, need: int = 1, stays: bool = False) -> int | None:
        """Inserts under the lock; when nothing can be evicted, cancels the lowest-priority
        request in flight and tries again. ``need``: the chunks this write still stores, this one
        included; ``stays``: they stay leased (a reservation's, a request's)."""
        cache = self._cache
        guarded = self.tenants.any_guarantee
        while True:
            self._writer = t_idx
            if guarded:
                cache.res.guard = self._guard
            try:
                node = cache.insert(key, NO_PARENT if prev is None else prev, position, access, raise_full=True)
                if node is not None:
                    # NOTE: the writer owns the page from now on, before its bytes are in place (not
                    # ready: nobody finds it), so a write that is aborted, expires or fails frees it
                    # as the writer's page: scrubbed when the writer's tenant asks for it.
                    self._tenant[node] = t_idx
                return node
            except PoolFull:
                if not self._fits_whole(prev, need, stays):
                    # NOTE: a prompt longer than the pool (every tier, or the top one for chunks
                    # that stay leased) can never be stored whole: no request is cancelled for it,
                    # its chain stops here with its leading chunks stored (the rest refunded).
                    if prev is None:
                        raise self._full(need) from None
                    self.metrics.cut_writes.inc(1, self.tenants.by_index(t_idx).id)
                    return None
                victim = self._lowest_priority_request()
                if victim is None:
                    raise self._full(need) from None
                self._cancel(victim)
                if victim is request:
                    raise RequestCancelled(victim.id, victim.tenant, victim.priority) from None
            finally:
                cache.res.guard = None
                self._writer = -1

    def _fits_whole(self, prev: int | None, need: int, stays: bool) -> bool:
        """Could the chain under ``prev`` plus ``need`` more chunks be resident at once: in every
        tier together (a prefix is never dropped before its suffix), and those that cannot move
        (leased) in the top tier? Walks up the chain: the slow path only."""
        cache = self._cache
        res, tier = cache.res, cache.node_tier
        depth = held = 0
        n = NO_PARENT if prev is None else prev
        while n != NO_PARENT:
            depth += 1
            held += tier[n] == 0 and res.leases[n] > 0
            n = res.parent[n]
        return depth + need <= cache.capacity and held + (need if stays else 1) <= cache.tier_pages[0]

    def _full(self, need: int) -> PoolFull:
        """The 507 of a write that finds no room, naming the pool's sizes and the fixes."""
        cache = self._cache
        tiers = ", ".join(f"{name} {n} pages" for name, n in zip(self.tier_names, cache.tier_pages))
        holding = sum(1 for r in self._active.values() if r.nodes)
        return PoolFull(
            f"no room for a write of {need} more chunks: every page of the pool ({tiers}, of "
            f"{self.config.page_bytes} B each) holds a chunk that is leased (being read or written, or by one "
            f"of the {holding} requests in flight that hold pages), pinned, or a prefix of such a chunk. Retry "
            "when requests end, or give the pool more pages (kvpool up --dram / --dram-pages, a disk tier with "
            "--disk-dir); a prompt longer than the pool stores its leading chunks only"
        )

    def _guard(self, node: int) -> bool:
        """May a write by ``self._writer`` drop this node? Not when that would take another tenant
        below its guaranteed share."""
        owner = int(self._tenant[node])
        if owner == self._writer or not self._ready[node]:
            return True
        reg = self.tenants
        return reg.usage_of(owner) - int(self._nbytes[node]) >= reg.guarantee(owner)

    def _checked_payload(self, payload: object) -> np.ndarray:
        arr = as_byte_array(payload)
        n = arr.shape[0]
        if n == 0:
            raise BadRequest("payload is empty: a chunk has at least one byte")
        if n > self.config.page_bytes:
            raise ChunkTooLarge(
                f"payload of {n} B exceeds the page size of {self.config.page_bytes} B: "
                "store smaller chunks or configure a larger page_bytes"
            )
        return arr
