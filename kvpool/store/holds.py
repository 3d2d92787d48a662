"""The reserve/commit protocol of other processes on this node that map the DRAM slab: a writer
reserves pages, copies into them and commits; a reader leases chunks, copies them out and
releases. Each is a hold, which ends by itself when its owner never comes back (ttl)."""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.errors import BadRequest, ChunkTooLarge, QuotaExceeded, ReservationGone
from kvpool.keys import ChunkKey, as_key, as_keys
from kvpool.policies import Access
from kvpool.store.checks import _as_list, _check_flag, _check_position, _check_request, _check_ttl
from kvpool.store.requests import ActiveRequest


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a chunk's bytes are in the DRAM slab, for a process that maps it (same node)."""

    key: ChunkKey
    offset: int
    nbytes: int
    checksum: int = 0


@dataclass(slots=True)
class _Hold:
    kind: str  # "read" | "write"
    nodes: list[int]
    deadline: float
    t_idx: int = -1
    sizes: list[int] = field(default_factory=list)
    shared: bool = False
    charged: int = 0
    access: Access | None = None
    request: ActiveRequest | None = None  # a write's chunks stay leased with it after the commit


class HoldsMixin:
    # ------------------------------------------------------------------ other processes' copies

    def reserve(self, keys: Sequence[ChunkKey], sizes: Sequence[int], tenant: str, *, shared: bool = False,
                parent: ChunkKey | None = None, first_position: int = 0, ttl_s: float = 30.0,
                request: ActiveRequest | None = None) -> tuple[int, list[Placement]]:
        """Makes room for consecutive chunks that another process on this node will copy into the
        DRAM slab itself: a hold id and a placement per new chunk, in order (chunks already
        resident are skipped; the run stops where the policy declines, or where the prompt's chain
        outgrows the pool). The quota is charged now (429 changes nothing); ``commit`` makes the
        chunks findable, ``abort`` (or ``ttl_s`` without a commit) gives the pages back. A
        reservation of nothing holds nothing: its id is 0."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        sizes = _as_list("sizes", sizes)
        shared = _check_flag("shared", shared)
        first_position = _check_position(first_position)
        ttl_s = min(_check_ttl(ttl_s), self.config.max_hold_ttl_s)
        if parent is not None:
            parent = as_key(parent)
        if len(keys) != len(sizes) or len(set(keys)) != len(keys):
            raise BadRequest("reserve needs one size per key and distinct keys")
        for n in sizes:
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise BadRequest(f"a chunk size is a whole number of bytes > 0, got {n!r}")
            if n > self.config.page_bytes:
                raise ChunkTooLarge(f"a chunk of {n} B does not fit a page of {self.config.page_bytes} B: "
                                    "store smaller chunks or configure a larger page_bytes")
        _check_request(request)
        cache = self._cache
        with self._lock:
            if parent is not None and self._visible(cache.index.get(parent), t_idx) is None:
                return 0, []  # its prefix is gone: a suffix without it is unreachable
            new_bytes = sum(n for k, n in zip(keys, sizes) if k not in cache.index)
            try:
                self.tenants.charge(t_idx, new_bytes)
            except QuotaExceeded:
                self.metrics.rejected_quota.inc(1, tenant)
                raise
            access = self.new_access(first_position + len(keys), first_position + len(keys), first_position)
            hold = _Hold("write", [], time.monotonic() + ttl_s, t_idx, [], shared, new_bytes, access, request)
            hid = next(self._requests)
            self._holds[hid] = hold
            out: list[Placement] = []
            prev = self._visible(cache.index.get(parent), t_idx) if parent is not None else None
            try:
                for i, (k, n) in enumerate(zip(keys, sizes)):
                    node = cache.index.get(k)
                    if node is not None:
                        if self._visible(node, t_idx) is None:
                            break
                        prev = node
                        continue
                    node = self._insert(k, prev, first_position + i, access, t_idx, None, len(keys) - i, True)
                    if node is None:
                        break
                    self._nbytes[node] = n
                    hold.nodes.append(node)
                    hold.sizes.append(n)
                    out.append(Placement(k, cache.node_page[node] * self.config.page_bytes, n))
                    prev = node
            except BaseException:
                self._end_hold(hid)
                raise
            unused = new_bytes - sum(hold.sizes)
            if unused:
                self.tenants.refund(t_idx, unused)
                hold.charged -= unused
            if not hold.nodes:  # nothing to copy: nothing is held (hold 0; committing it stores nothing)
                self._end_hold(hid)
                return 0, out
        return hid, out

    def commit(self, hold_id: int, checksums: Sequence[int]) -> int:
        """The copies of a reservation are done: its first ``len(checksums)`` chunks become findable
        with these checksums (computed by the writer as it copied); the rest are given back."""
        checksums = _as_list("checksums", checksums)
        for cs in checksums:  # all checked before any chunk becomes findable
            if not isinstance(cs, numbers.Integral) or isinstance(cs, bool) or not 0 <= cs < 2**64:
                raise BadRequest(f"a checksum is the xxh3-64 of a chunk, an int in [0, 2**64), got {cs!r}")
        if hold_id == 0 and not checksums:
            return 0  # the reservation of nothing
        with self._lock:
            hold = self._holds.get(hold_id)
            if hold is None or hold.kind != "write":
                raise ReservationGone(f"no reservation {hold_id}: it was committed, aborted or expired (ttl)")
            tenant = self.tenants.by_index(hold.t_idx).id
            done = []
            for node, nb, cs in zip(hold.nodes, hold.sizes, checksums):
                self._checksum[node] = int(cs)
                self._tenant[node] = hold.t_idx
                self._shared[node] = hold.shared
                self._ready[node] = True
                self._show(node)
                hold.charged -= nb
                done.append(node)
                self.metrics.puts.inc(1, tenant)
                self.metrics.put_bytes.inc(nb, tenant)
            self._cache.access(done, hold.access)
            if hold.request is not None and not hold.request.cancelled:
                hold.request.nodes.extend(done)  # their leases pass to the request, until it ends
                hold.nodes = hold.nodes[len(done):]
            self._end_hold(hold_id)
            return len(done)

    def hold_owner(self, hold_id: int) -> str | None:
        """The tenant whose reservation or read lease ``hold_id`` is (None: no such hold)."""
        with self._lock:
            hold = self._holds.get(hold_id)
            return None if hold is None else self.tenants.by_index(hold.t_idx).id

    def abort(self, hold_id: int) -> None:
        with self._lock:
            self._end_hold(hold_id)

    def lease_reads(self, keys: Sequence[ChunkKey], tenant: str, ttl_s: float = 30.0,
                    leading: bool = True) -> tuple[int, list[Placement | None]]:
        """Leases chunks for another process on this node to copy out of the DRAM slab (promoting
        disk hits first); a hold id and a placement per chunk, with the checksum the reader
        verifies. ``leading``: the leading run only; else a placement or None for every key (a
        client that asks the index at the same time). ``release`` (or ``ttl_s``) ends the lease."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        ttl_s = min(_check_ttl(ttl_s), self.config.max_hold_ttl_s)
        with self._lock:
            hold = _Hold("read", [], time.monotonic() + ttl_s, t_idx)
            out: list[Placement | None] = []
            c = self._cache
            room = max(1, int(self.config.max_read_hold_fraction * c.capacity)) - self._read_held.get(t_idx, 0)
            for k in keys:
                # beyond the tenant's share of leased pages a read is a miss (see StoreConfig)
                node = self._acquire_for_read(k, t_idx) if len(hold.nodes) < room else None
                if node is not None and c.node_tier[node] != 0:  # not promoted: not mappable
                    self._unlease(node)
                    node = None
                if node is None:
                    if leading:
                        break
                    out.append(None)
                    continue
                hold.nodes.append(node)
                out.append(Placement(k, c.node_page[node] * self.config.page_bytes, int(self._nbytes[node]),
                                     int(self._checksum[node])))
            self._touch(hold.nodes)
            self._read_held[t_idx] = self._read_held.get(t_idx, 0) + len(hold.nodes)
            hid = next(self._requests)
            self._holds[hid] = hold
            m = self.metrics
            found = [p for p in out if p is not None]
            if found:
                m.hits_chunks.inc(len(found), tenant)
                m.get_bytes.inc(sum(p.nbytes for p in found), tenant)
            if len(keys) > len(found):
                m.misses_chunks.inc(1 if leading else len(keys) - len(found), tenant)
        return hid, out

    def release(self, hold_id: int) -> None:
        """Ends a read lease. (A reader that found a chunk corrupt says so with the shard's verify,
        which reads and checks it again: a reader's word alone drops nothing.)"""
        with self._lock:
            if hold_id in self._holds:
                self._end_hold(hold_id)

    def expire_holds(self, now: float | None = None) -> int:
        """Ends holds whose owner never came back (a client that died); the shard calls this."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [h for h, hold in self._holds.items() if hold.deadline < now]
            for h in stale:
                self._end_hold(h)
            return len(stale)

    def _end_hold(self, hold_id: int) -> None:
        hold = self._holds.pop(hold_id, None)
        if hold is None:
            return
        if hold.kind == "read":
            self._read_held[hold.t_idx] -= len(hold.nodes)
        for node in hold.nodes:
            ready = self._ready[node]
            self._unlease(node)
            if hold.kind == "write" and not ready:
                self._cache.drop(node, "removed")
        if hold.kind == "write" and hold.charged:
            self.tenants.refund(hold.t_idx, hold.charged)
