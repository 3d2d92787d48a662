"""The chunk store of one node: put / get / contains / remove over tiers of preallocated pages.

Memory roles: a key names a chunk; the index maps it to a location (tier, page); the page holds
the payload bytes, verified by an xxh3-64 checksum on every read.

Rules this module keeps:
- a chunk is visible only to its tenant, or to everyone when it was stored as shared;
- bytes are verified at every read; a mismatch is a miss, the entry is dropped and counted;
- a leased chunk (being read, or belonging to a request in flight) is never evicted or moved;
- when a lower tier exists, eviction demotes (DRAM -> disk) instead of dropping; a hit on a
  lower tier promotes the chunk back to the top tier;
- a write that would pass the tenant's quota is refused whole (429) and changes nothing.

Metadata changes happen under one lock; payload copies of the read path happen outside it,
under a lease, so readers do not serialize on each other's copies.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.buffers import as_byte_array
from kvpool.checksum import checksum, copy_with_checksum
from kvpool.errors import BadRequest, ChunkTooLarge, PoolFull, QuotaExceeded
from kvpool.keys import ChunkKey, as_key
from kvpool.metrics import Metrics
from kvpool.slab import Slab
from kvpool.tenants import TenantRegistry
from kvpool.tier import Tier

_PAGE_BITS = 40  # a location is tier << 40 | page
_PAGE_MASK = (1 << _PAGE_BITS) - 1


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Sizes of the node's tiers. ``page_bytes`` is the largest payload one chunk may have."""

    page_bytes: int
    dram_pages: int
    disk_pages: int = 0
    disk_dir: str | None = None
    pin_memory: bool | None = None  # None: pin when CUDA is present

    def __post_init__(self) -> None:
        if self.disk_pages and not self.disk_dir:
            raise BadRequest("disk_pages > 0 needs disk_dir: the directory of the disk tier's file")


class Lease:
    """Pins chunks in place until released: they are neither evicted nor moved meanwhile."""

    __slots__ = ("_store", "_locs", "keys")

    def __init__(self, store: "ChunkStore", locs: list[int], keys: list[ChunkKey]) -> None:
        self._store = store
        self._locs = locs
        self.keys = keys

    def release(self) -> None:
        locs, self._locs = self._locs, []
        if locs:
            with self._store._lock:
                for loc in locs:
                    self._store._unlease(loc)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __len__(self) -> int:
        return len(self._locs)


class ChunkView(Lease):
    """A verified, read-only view of one stored payload, valid until released (zero-copy read)."""

    __slots__ = ("data",)

    def __init__(self, store: "ChunkStore", loc: int, key: ChunkKey, data: np.ndarray) -> None:
        super().__init__(store, [loc], [key])
        self.data = data


class ChunkStore:
    def __init__(
        self, config: StoreConfig, tenants: TenantRegistry | None = None, metrics: Metrics | None = None
    ) -> None:
        self.config = config
        self.tenants = tenants if tenants is not None else TenantRegistry()
        self.metrics = metrics if metrics is not None else Metrics()
        self._lock = threading.Lock()
        self._index: dict[ChunkKey, int] = {}
        tiers = [Tier("dram", Slab.dram(config.page_bytes, config.dram_pages, config.pin_memory))]
        if config.disk_pages:
            tiers.append(Tier("disk", Slab.mapped_file("disk", config.disk_dir, config.page_bytes, config.disk_pages)))
        self._tiers = tiers
        for t in tiers:
            self.metrics.pages_total.set(t.num_pages, t.name)

    # ------------------------------------------------------------------ public API

    @property
    def page_bytes(self) -> int:
        return self.config.page_bytes

    def put(self, key: ChunkKey, payload: object, tenant: str, *, shared: bool = False) -> bool:
        """Stores one chunk; True if stored, False if the key was already resident."""
        return self.put_many([key], [payload], tenant, shared=shared)[0]

    def put_many(
        self, keys: Sequence[ChunkKey], payloads: Sequence[object], tenant: str, *, shared: bool = False
    ) -> list[bool]:
        """Stores chunks of one tenant; a True per chunk that was new. The quota is charged for the
        whole batch first: a 429 leaves the store as it was. A 507 (every resident chunk leased)
        keeps the chunks stored before it, which are valid, and refunds the rest."""
        t_idx = self.tenants.index(tenant)
        keys = [as_key(k) for k in keys]
        if len(keys) != len(payloads):
            raise BadRequest(f"put_many got {len(keys)} keys but {len(payloads)} payloads")
        srcs = [self._checked_payload(p) for p in payloads]
        stored = [False] * len(keys)
        with self._lock:
            todo: list[int] = []
            seen: set[ChunkKey] = set()
            for i, k in enumerate(keys):
                if k not in self._index and k not in seen:
                    seen.add(k)
                    todo.append(i)
            total = sum(srcs[i].shape[0] for i in todo)
            if not todo:
                return stored
            try:
                self.tenants.charge(t_idx, total)
            except QuotaExceeded:
                self.metrics.rejected_quota.inc(1, tenant)
                raise
        top = self._tiers[0]
        done = 0
        page = None
        try:
            for i in todo:
                k, src = keys[i], srcs[i]
                nb = src.shape[0]
                with self._lock:
                    page = self._alloc(0)
                # The page is in no list yet, so nothing can evict it while we copy.
                cs = copy_with_checksum(top.slab.page(page)[:nb], src)
                with self._lock:
                    done += nb
                    held, page = page, None
                    if k in self._index:  # a racing writer stored it first
                        top.alloc.free(held)
                        self.tenants.refund(t_idx, nb)
                        continue
                    top.set_entry(held, k, nb, cs, t_idx, shared)
                    top.lru.push_mru(held)
                    self._index[k] = held  # tier 0
                    stored[i] = True
                    self.metrics.puts.inc(1, tenant)
                    self.metrics.put_bytes.inc(nb, tenant)
        except BaseException as e:
            # NOTE: chunks stored before a 507 stay (they are valid); the rest is refunded.
            with self._lock:
                if page is not None:
                    top.alloc.free(page)
                self.tenants.refund(t_idx, total - done)
                if isinstance(e, PoolFull):
                    self.metrics.rejected_full.inc(1, top.name)
            raise
        return stored

    def get(self, key: ChunkKey, tenant: str, out: object | None = None) -> np.ndarray | None:
        """The chunk's bytes copied into ``out`` (or a new array), verified; None on a miss."""
        return self.get_many([key], tenant, None if out is None else [out])[0]

    def get_many(
        self, keys: Sequence[ChunkKey], tenant: str, outs: Sequence[object] | None = None
    ) -> list[np.ndarray | None]:
        t_idx = self.tenants.index(tenant)
        keys = [as_key(k) for k in keys]
        if outs is not None and len(outs) != len(keys):
            raise BadRequest(f"get_many got {len(keys)} keys but {len(outs)} output buffers")
        dsts = [None if outs is None else as_byte_array(o, writable=True) for o in (outs or keys)]
        result: list[np.ndarray | None] = [None] * len(keys)
        bad = [False] * len(keys)
        with self._lock:
            locs = [self._acquire_for_read(k, t_idx) for k in keys]
        try:
            for i, loc in enumerate(locs):
                if loc is None:
                    continue
                tier, page = self._tiers[loc >> _PAGE_BITS], loc & _PAGE_MASK
                src = tier.payload(page)
                dst = dsts[i]
                if dst is None:
                    dst = np.empty(src.shape[0], dtype=np.uint8)
                elif dst.shape[0] < src.shape[0]:
                    raise BadRequest(f"output buffer {i} holds {dst.shape[0]} B; the chunk has {src.shape[0]} B")
                else:
                    dst = dst[: src.shape[0]]
                if copy_with_checksum(dst, src) == int(tier.checksum[page]):
                    result[i] = dst
                else:
                    bad[i] = True
        finally:
            with self._lock:
                for i, loc in enumerate(locs):
                    if loc is None:
                        continue
                    if bad[i]:
                        self._corrupt(loc)
                    self._unlease(loc)
                self._count_reads(tenant, result)
        return result

    def read(self, key: ChunkKey, tenant: str) -> ChunkView | None:
        """A verified zero-copy view of the chunk, leased until released; None on a miss.

        Use as ``view = store.read(k, t)`` then ``with view: ...``; the bytes must not be used
        after release.
        """
        t_idx = self.tenants.index(tenant)
        key = as_key(key)
        with self._lock:
            loc = self._acquire_for_read(key, t_idx)
        if loc is None:
            with self._lock:
                self._count_reads(tenant, [None])
            return None
        tier, page = self._tiers[loc >> _PAGE_BITS], loc & _PAGE_MASK
        data = tier.payload(page)
        ok = checksum(data) == int(tier.checksum[page])
        with self._lock:
            self._count_reads(tenant, [data if ok else None])
            if not ok:
                self._corrupt(loc)
                self._unlease(loc)
                return None
        data = data.view()
        data.flags.writeable = False
        return ChunkView(self, loc, key, data)

    def contains(self, key: ChunkKey, tenant: str) -> bool:
        return self.contains_many([key], tenant)[0]

    def contains_many(self, keys: Sequence[ChunkKey], tenant: str) -> list[bool]:
        t_idx = self.tenants.index(tenant)
        keys = [as_key(k) for k in keys]
        with self._lock:
            return [self._visible(self._index.get(k), t_idx) is not None for k in keys]

    def remove(self, key: ChunkKey, tenant: str) -> bool:
        return self.remove_many([key], tenant) == 1

    def remove_many(self, keys: Sequence[ChunkKey], tenant: str) -> int:
        """Removes the tenant's own chunks (shared ones only by their owner); returns how many."""
        t_idx = self.tenants.index(tenant)
        keys = [as_key(k) for k in keys]
        n = 0
        with self._lock:
            for k in keys:
                loc = self._index.get(k)
                if loc is None:
                    continue
                tier, page = self._tiers[loc >> _PAGE_BITS], loc & _PAGE_MASK
                if tier.tenant[page] != t_idx:
                    continue
                self._unlink(tier, page)
                n += 1
        return n

    def lease(self, keys: Sequence[ChunkKey], tenant: str) -> Lease:
        """Leases the resident chunks among ``keys`` that the tenant can see (a request in flight)."""
        t_idx = self.tenants.index(tenant)
        keys = [as_key(k) for k in keys]
        locs, held = [], []
        with self._lock:
            for k in keys:
                loc = self._visible(self._index.get(k), t_idx)
                if loc is not None:
                    self._tiers[loc >> _PAGE_BITS].leases[loc & _PAGE_MASK] += 1
                    locs.append(loc)
                    held.append(k)
        return Lease(self, locs, held)

    def locate(self, key: ChunkKey) -> tuple[str, int] | None:
        """(tier name, page) of a resident chunk, for operators and tests; no tenant check."""
        loc = self._index.get(as_key(key))
        if loc is None:
            return None
        return self._tiers[loc >> _PAGE_BITS].name, loc & _PAGE_MASK

    def tier(self, name: str) -> Tier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise BadRequest(f"no tier named {name!r}; tiers: {[t.name for t in self._tiers]}")

    def __len__(self) -> int:
        return len(self._index)

    def metadata_bytes(self) -> int:
        """Bytes of bookkeeping: per-page arrays plus the index (a dict entry and a location each)."""
        index = 8 * 3 * max(8, len(self._index)) * 3 // 2 + 28 * len(self._index)
        return index + sum(t.metadata_bytes() for t in self._tiers)

    def stats(self) -> dict:
        with self._lock:
            tiers = {}
            for t in self._tiers:
                tiers[t.name] = {
                    "page_bytes": t.slab.page_bytes,
                    "pages_total": t.num_pages,
                    "pages_used": t.alloc.num_used,
                    "chunks": len(t.lru),
                    "bytes": t.used_bytes,
                    "leased_pages": int(np.count_nonzero(t.leases)),
                }
                self.metrics.bytes.set(t.used_bytes, t.name)
                self.metrics.chunks.set(len(t.lru), t.name)
            tenants = {}
            for ten in self.tenants:
                used = self.tenants.usage(ten.id)
                tenants[ten.id] = {"bytes": used, "quota_bytes": ten.quota_bytes, "priority": ten.priority}
                self.metrics.tenant_bytes.set(used, ten.id)
            return {"tiers": tiers, "tenants": tenants, "chunks": len(self._index), "metrics": self.metrics.snapshot()}

    def close(self) -> None:
        with self._lock:
            assert not any(int(t.leases.sum()) for t in self._tiers), "closing a store with live leases"
            for t in self._tiers:
                t.slab.close()
            self._index.clear()

    # ------------------------------------------------------------------ internals (lock held)

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

    def _visible(self, loc: int | None, t_idx: int) -> int | None:
        if loc is None:
            return None
        tier, page = self._tiers[loc >> _PAGE_BITS], loc & _PAGE_MASK
        if tier.tenant[page] == t_idx or tier.shared[page]:
            return loc
        return None

    def _acquire_for_read(self, key: ChunkKey, t_idx: int) -> int | None:
        """Leases the chunk for a read, promoting it to the top tier first when it can move."""
        loc = self._visible(self._index.get(key), t_idx)
        if loc is None:
            return None
        ti, page = loc >> _PAGE_BITS, loc & _PAGE_MASK
        tier = self._tiers[ti]
        if ti > 0 and tier.leases[page] == 0:
            loc = self._promote(ti, page)
            if loc is None:
                return None
            ti, page = loc >> _PAGE_BITS, loc & _PAGE_MASK
            tier = self._tiers[ti]
        tier.lru.touch(page)
        tier.leases[page] += 1
        return loc

    def _promote(self, ti: int, page: int) -> int | None:
        """Moves a chunk from tier ``ti`` to the top tier, verifying its bytes on the way.

        NOTE: runs under the lock; disk hits are the slow path and a shard serves them in order.
        """
        low, top = self._tiers[ti], self._tiers[0]
        low.leases[page] += 1  # so making room in the top tier cannot demote-evict it
        try:
            dest = self._alloc(0)
        except PoolFull:
            return (ti << _PAGE_BITS) | page  # serve it from where it is
        finally:
            low.leases[page] -= 1
        nb = int(low.nbytes[page])
        cs = copy_with_checksum(top.slab.page(dest)[:nb], low.payload(page))
        if cs != int(low.checksum[page]):
            top.alloc.free(dest)
            self.metrics.checksum_failures.inc(1, low.name)
            self._unlink(low, page)
            return None
        key = low.keys[page]
        top.set_entry(dest, key, nb, cs, int(low.tenant[page]), bool(low.shared[page]))
        top.lru.push_mru(dest)
        low.lru.remove(page)
        low.clear_entry(page)
        self._index[key] = dest
        self.metrics.promotions.inc(1, top.name)
        return dest

    def _alloc(self, ti: int) -> int:
        tier = self._tiers[ti]
        page = tier.alloc.alloc()
        if page is None:
            self._make_room(ti)
            page = tier.alloc.alloc()
            assert page is not None
        return page

    def _make_room(self, ti: int) -> None:
        """Frees one page of tier ``ti``: demotes its least recently used unleased chunk to the next
        tier, or drops it from the last tier. PoolFull when every chunk is leased."""
        tier = self._tiers[ti]
        victim = None
        for page in tier.lru.iter_lru():
            if tier.leases[page]:
                self.metrics.lease_waits.inc(1, tier.name)
                continue
            victim = page
            break
        if victim is None:
            raise PoolFull(
                f"{tier.name} tier is full ({tier.num_pages} pages) and every resident chunk is "
                "leased: finish or cancel requests in flight, or give the tier more pages"
            )
        if ti + 1 < len(self._tiers):
            self._demote(ti, victim)
        else:
            self.metrics.evictions.inc(1, tier.name)
            self._unlink(tier, victim)

    def _demote(self, ti: int, page: int) -> None:
        high, low = self._tiers[ti], self._tiers[ti + 1]
        high.leases[page] += 1  # not a victim of the room-making below
        try:
            dest = self._alloc(ti + 1)
        finally:
            high.leases[page] -= 1
        nb = int(high.nbytes[page])
        np.copyto(low.slab.page(dest)[:nb], high.payload(page))  # verified when read back
        key = high.keys[page]
        low.set_entry(dest, key, nb, int(high.checksum[page]), int(high.tenant[page]), bool(high.shared[page]))
        low.lru.push_mru(dest)
        high.lru.remove(page)
        high.clear_entry(page)
        self._index[key] = ((ti + 1) << _PAGE_BITS) | dest
        self.metrics.demotions.inc(1, high.name)

    def _unlink(self, tier: Tier, page: int) -> None:
        """Makes a chunk invisible and frees its page now, or when its last lease ends."""
        key = tier.keys[page]
        del self._index[key]
        tier.lru.remove(page)
        if tier.leases[page]:
            tier.doomed[page] = True
        else:
            self._free(tier, page)

    def _free(self, tier: Tier, page: int) -> None:
        self.tenants.refund(int(tier.tenant[page]), int(tier.nbytes[page]))
        tier.clear_entry(page)

    def _unlease(self, loc: int) -> None:
        tier, page = self._tiers[loc >> _PAGE_BITS], loc & _PAGE_MASK
        tier.leases[page] -= 1
        assert tier.leases[page] >= 0, (tier.name, page)
        if tier.leases[page] == 0 and tier.doomed[page]:
            self._free(tier, page)

    def _corrupt(self, loc: int) -> None:
        tier, page = self._tiers[loc >> _PAGE_BITS], loc & _PAGE_MASK
        self.metrics.checksum_failures.inc(1, tier.name)
        if not tier.doomed[page]:
            self._unlink(tier, page)

    def _count_reads(self, tenant: str, result: Sequence[np.ndarray | None]) -> None:
        hits = sum(r is not None for r in result)
        m = self.metrics
        if hits:
            m.hits_chunks.inc(hits, tenant)
            m.get_bytes.inc(sum(r.shape[0] for r in result if r is not None), tenant)
        if len(result) - hits:
            m.misses_chunks.inc(len(result) - hits, tenant)
