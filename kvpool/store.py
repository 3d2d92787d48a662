"""The chunk store of one node: put / get / read / contains / remove / lease over tiers of pages.

Memory roles: a key names a chunk; the TieredCache (kvpool.cache) maps it to a node and the node
to a page of a tier, and its policies decide what leaves; the page holds the payload, verified by
an xxh3-64 checksum on every read. This module owns the bytes and the tenants' accounting.

Rules this module keeps:
- bytes before index: a chunk is findable only once its bytes are in place and checksummed;
- a chunk is visible only to its tenant, or to everyone when it was stored as shared;
- bytes are verified at every read and every promotion; a mismatch is a miss, and the entry is
  dropped, refunded and counted;
- a leased chunk (being read, or belonging to a request in flight) is never evicted or moved;
- eviction demotes (DRAM -> disk) before it drops, and a hit on disk promotes back to DRAM;
- a write that would pass the tenant's quota is refused whole (429) and changes nothing.

Metadata changes happen under one lock; payload copies of reads and writes happen outside it,
under a lease, so readers do not serialize on each other's copies.
"""

from __future__ import annotations

import inspect
import itertools
import math
import numbers
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.buffers import as_byte_array
from kvpool.cache import CacheHooks, TieredCache
from kvpool.checksum import checksum, copy_with_checksum
from kvpool.errors import BadRequest, ChunkTooLarge, PoolFull, QuotaExceeded, RequestCancelled
from kvpool.keys import ChunkKey, as_key, as_keys
from kvpool.metrics import Metrics
from kvpool.policies import NO_PARENT, Access, make_policy, policy_class
from kvpool.slab import Slab
from kvpool.spec import DEFAULT_HIGH_WATERMARK
from kvpool.tenants import PRIORITY_CLASSES, TenantRegistry, priority_rank


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Sizes of the node's tiers and their eviction policy. ``page_bytes`` is the largest payload
    one chunk may have."""

    page_bytes: int
    dram_pages: int
    disk_pages: int = 0
    disk_dir: str | None = None
    pin_memory: bool | None = None  # None: pin when CUDA is present
    # Put the DRAM slab in a named file under this directory (e.g. /dev/shm) so that clients on
    # the same node map it and read and write pages directly (reserve/commit, lease_reads).
    dram_dir: str | None = None
    name: str = "store"
    policy: str = "default"
    policy_params: dict = field(default_factory=dict)
    # Background eviction: starts when a tier is fuller than high_watermark, stops at
    # low_watermark. None: the default of the storage format (DEFAULT_HIGH_WATERMARK), and 10
    # points below it.
    storage_format: str = "raw"
    high_watermark: float | None = None
    low_watermark: float | None = None
    background_eviction: bool = False

    def __post_init__(self) -> None:
        if self.disk_pages and not self.disk_dir:
            raise BadRequest("disk_pages > 0 needs disk_dir: the directory of the disk tier's file")
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,200}", self.name):
            raise BadRequest(
                f"store name {self.name!r} must be 1-200 letters, digits or _ . : @ - (it names slab files)"
            )
        if not isinstance(self.policy, str):
            raise BadRequest(f"policy must be a policy's name, got {type(self.policy).__name__}")
        cls = policy_class(self.policy)  # a clear error now rather than at the first eviction
        if not isinstance(self.policy_params, dict):
            raise BadRequest(
                f"policy_params must be a dict of keyword arguments, got {type(self.policy_params).__name__}"
            )
        try:
            inspect.signature(cls).bind(1, None, **self.policy_params)
        except TypeError:
            raise BadRequest(
                f"policy_params {sorted(self.policy_params)} do not fit policy {self.policy!r}: it takes "
                f"{list(inspect.signature(cls).parameters)[2:]}"
            ) from None
        if not isinstance(self.storage_format, str) or self.storage_format not in DEFAULT_HIGH_WATERMARK:
            raise BadRequest(f"storage_format {self.storage_format!r} is not one of {sorted(DEFAULT_HIGH_WATERMARK)}")
        for name in ("high_watermark", "low_watermark"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                raise BadRequest(f"{name} must be a fraction of a tier in (0, 1] or None, got {v!r}")
        high, low = self.watermarks
        if not 0 < low < high <= 1:
            raise BadRequest(f"watermarks must satisfy 0 < low < high <= 1, got low={low}, high={high}")

    @property
    def watermarks(self) -> tuple[float, float]:
        high = self.high_watermark if self.high_watermark is not None else DEFAULT_HIGH_WATERMARK[self.storage_format]
        low = self.low_watermark if self.low_watermark is not None else round(high - 0.10, 4)
        return high, low


@dataclass(slots=True)
class ActiveRequest:
    """A request in flight: its chunks are leased until it ends, or until the pool cancels it."""

    id: int
    tenant: str
    priority: int
    started: float
    nodes: list[int] = field(default_factory=list)
    cancelled: bool = False

    def check(self) -> None:
        if self.cancelled:
            raise RequestCancelled(self.id, self.tenant, self.priority)


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


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a chunk's bytes are in the DRAM slab, for a process that maps it (same node)."""

    key: ChunkKey
    offset: int
    nbytes: int
    checksum: int = 0


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise BadRequest(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_ttl(ttl_s: object) -> float:
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not (0 <= ttl_s and math.isfinite(ttl_s)):
        raise BadRequest(f"ttl_s must be a finite number of seconds >= 0, got {ttl_s!r}")
    return float(ttl_s)


def _check_position(first_position: object) -> int:
    if not isinstance(first_position, numbers.Integral) or isinstance(first_position, bool) or first_position < 0:
        raise BadRequest(f"first_position must be an int >= 0 (the chunk index of keys[0]), got {first_position!r}")
    return int(first_position)


def _as_list(name: str, value: object) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise BadRequest(f"{name} must be a list, one item per key, got {type(value).__name__}")
    return list(value)


def _check_request(request: object) -> None:
    if request is not None:
        if not isinstance(request, ActiveRequest):
            raise BadRequest(f"request must come from begin(), got {type(request).__name__}")
        request.check()


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


class ChunkStore(CacheHooks):
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
        self._gone: list[ChunkKey] = []  # findable chunks that left since take_gone(): the index forgets them
        self.track_gone = False  # a shard that publishes to an index turns this on
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
        is unreachable). When nothing can be evicted, the lowest-priority request in flight is
        cancelled (RequestCancelled, 429, to its owner); with no request in flight it is a 507.
        Either keeps the chunks stored before it, which are valid, and refunds the rest. Chunks
        written for a ``request`` stay leased until it ends.
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
            if new_bytes == 0:
                return stored
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
                    node = self._insert(k, prev, first_position + i, access, t_idx, request)
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
            if report:
                with self._lock:
                    cache.access(nodes, access)
        except PoolFull:
            with self._lock:
                self.metrics.rejected_full.inc(1, top.tier)
            raise
        finally:
            with self._lock:
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
                request: ActiveRequest | None) -> int | None:
        """Inserts under the lock; when nothing can be evicted, cancels the lowest-priority
        request in flight and tries again."""
        cache = self._cache
        guarded = self.tenants.any_guarantee
        while True:
            self._writer = t_idx
            if guarded:
                cache.res.guard = self._guard
            try:
                return cache.insert(key, NO_PARENT if prev is None else prev, position, access, raise_full=True)
            except PoolFull:
                victim = self._lowest_priority_request()
                if victim is None:
                    raise
                self._cancel(victim)
                if victim is request:
                    raise RequestCancelled(victim.id, victim.tenant, victim.priority) from None
            finally:
                cache.res.guard = None
                self._writer = -1

    def _guard(self, node: int) -> bool:
        """May a write by ``self._writer`` drop this node? Not when that would take another tenant
        below its guaranteed share."""
        owner = int(self._tenant[node])
        if owner == self._writer or not self._ready[node]:
            return True
        reg = self.tenants
        return reg.usage_of(owner) - int(self._nbytes[node]) >= reg.guarantee(owner)

    # ------------------------------------------------------------------ other processes' copies

    def reserve(self, keys: Sequence[ChunkKey], sizes: Sequence[int], tenant: str, *, shared: bool = False,
                parent: ChunkKey | None = None, first_position: int = 0, ttl_s: float = 30.0,
                request: ActiveRequest | None = None) -> tuple[int, list[Placement]]:
        """Makes room for consecutive chunks that another process on this node will copy into the
        DRAM slab itself: a hold id and a placement per new chunk, in order (chunks already
        resident are skipped; the run stops where the policy declines). The quota is charged now
        (429 changes nothing); ``commit`` makes the chunks findable, ``abort`` (or ``ttl_s``
        without a commit) gives the pages back."""
        t_idx = self.tenants.index(tenant)
        keys = as_keys(keys)
        sizes = _as_list("sizes", sizes)
        shared = _check_flag("shared", shared)
        first_position, ttl_s = _check_position(first_position), _check_ttl(ttl_s)
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
                    node = self._insert(k, prev, first_position + i, access, t_idx, None)
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
        return hid, out

    def commit(self, hold_id: int, checksums: Sequence[int]) -> int:
        """The copies of a reservation are done: its first ``len(checksums)`` chunks become findable
        with these checksums (computed by the writer as it copied); the rest are given back."""
        checksums = _as_list("checksums", checksums)
        for cs in checksums:  # all checked before any chunk becomes findable
            if not isinstance(cs, numbers.Integral) or isinstance(cs, bool) or not 0 <= cs < 2**64:
                raise BadRequest(f"a checksum is the xxh3-64 of a chunk, an int in [0, 2**64), got {cs!r}")
        with self._lock:
            hold = self._holds.get(hold_id)
            if hold is None or hold.kind != "write":
                raise BadRequest(f"no reservation {hold_id}: it was committed, aborted or expired (ttl)")
            tenant = self.tenants.by_index(hold.t_idx).id
            done = []
            for node, nb, cs in zip(hold.nodes, hold.sizes, checksums):
                self._checksum[node] = int(cs)
                self._tenant[node] = hold.t_idx
                self._shared[node] = hold.shared
                self._ready[node] = True
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
        ttl_s = _check_ttl(ttl_s)
        with self._lock:
            hold = _Hold("read", [], time.monotonic() + ttl_s)
            out: list[Placement | None] = []
            c = self._cache
            for k in keys:
                node = self._acquire_for_read(k, t_idx)
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

    def release(self, hold_id: int, corrupt: Sequence[ChunkKey] = ()) -> None:
        """Ends a read lease; ``corrupt`` names chunks whose bytes failed the reader's check (they
        are dropped, as a local read would)."""
        bad = set(as_keys(corrupt))
        with self._lock:
            hold = self._holds.get(hold_id)
            if hold is None:
                return
            for node in hold.nodes:
                if self._cache.node_key[node] in bad:
                    self._corrupt(node)
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
        for node in hold.nodes:
            ready = self._ready[node]
            self._unlease(node)
            if hold.kind == "write" and not ready:
                self._cache.drop(node, "removed")
        if hold.kind == "write" and hold.charged:
            self.tenants.refund(hold.t_idx, hold.charged)

    # ------------------------------------------------------------------ requests in flight

    def begin(self, tenant: str, keys: Sequence[ChunkKey] = (), priority: str | None = None) -> ActiveRequest:
        """Registers a request in flight and leases the leading run of its chunks that the tenant
        can see; they stay until ``end``. ``priority`` defaults to the tenant's class."""
        t_idx = self.tenants.index(tenant)
        if priority is not None and (not isinstance(priority, str) or priority not in PRIORITY_CLASSES):
            raise BadRequest(f"priority must be one of {PRIORITY_CLASSES} or None (the tenant's), got {priority!r}")
        rank = priority_rank(priority or self.tenants.by_index(t_idx).priority)
        keys = as_keys(keys)
        with self._lock:
            req = ActiveRequest(next(self._requests), tenant, rank, time.monotonic())
            for k in keys:
                node = self._visible(self._cache.index.get(k), t_idx)
                if node is None:
                    break
                self._cache.res.leases[node] += 1
                req.nodes.append(node)
            self._active[req.id] = req
        return req

    def end(self, request: ActiveRequest) -> None:
        """The request finished (or gave up): its chunks may be evicted again."""
        if not isinstance(request, ActiveRequest):
            raise BadRequest(f"end takes the request begin() returned, got {type(request).__name__}")
        with self._lock:
            if self._active.pop(request.id, None) is not None:
                for n in request.nodes:
                    self._unlease(n)
            request.nodes = []
            self._maybe_wake_evictor()

    def active_requests(self) -> list[ActiveRequest]:
        with self._lock:
            return list(self._active.values())

    def _lowest_priority_request(self) -> ActiveRequest | None:
        """The request to cancel when nothing else can be freed: the lowest priority class, and in
        it the youngest (it has done the least work). Only requests that hold pages count."""
        holding = [r for r in self._active.values() if r.nodes]
        if not holding:
            return None
        return min(holding, key=lambda r: (r.priority, -r.started, -r.id))

    def _cancel(self, request: ActiveRequest) -> None:
        request.cancelled = True
        del self._active[request.id]
        for n in request.nodes:
            self._unlease(n)
        request.nodes = []
        self.metrics.cancelled_requests.inc(1, request.tenant)

    # ------------------------------------------------------------------ watermarks

    def occupancy(self, tier: int = 0) -> float:
        return self._cache.tier_used(tier) / max(self._cache.tier_pages[tier], 1)

    def evict_to_low_watermark(self) -> int:
        """Makes room in every tier above its high watermark until it is at its low one; returns
        how many chunks moved down or left. What the background evictor runs."""
        high, low = self.config.watermarks
        done = 0
        with self._lock:
            for t in range(len(self._slabs)):
                if self.occupancy(t) <= high:
                    continue
                while self.occupancy(t) > low:
                    try:
                        self._cache._make_room(t)
                    except PoolFull:
                        break
                    done += 1
        return done

    def _maybe_wake_evictor(self) -> None:
        if self._evictor is not None and self.occupancy(0) > self.config.watermarks[0]:
            self._wake.notify()

    def _evict_loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait(timeout=1.0)
                if self._closing:
                    return
            self.evict_to_low_watermark()

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

    # ------------------------------------------------------------------ inspection

    def locate(self, key: ChunkKey) -> tuple[str, int] | None:
        """(tier name, page) of a resident chunk, for operators and tests; no tenant check."""
        node = self._cache.index.get(as_key(key))
        if node is None or not self._ready[node]:
            return None
        return self.tier_names[self._cache.node_tier[node]], self._cache.node_page[node]

    def take_gone(self) -> list[ChunkKey]:
        """Chunks that were findable and are not any more (evicted, removed, corrupt) since the
        last call: what the shard removes from the index."""
        with self._lock:
            gone, self._gone = self._gone, []
            return gone

    def index_entries(self, shard: str, keys: Sequence[ChunkKey] | None = None) -> list:
        """What this store holds (of ``keys``, or all), as index entries of ``shard``: what it
        publishes, and what it republishes when the index is rebuilt (reconcile)."""
        from kvpool.index.base import IndexEntry

        with self._lock:
            c = self._cache
            pairs = c.index.items() if keys is None else ((k, c.index.get(k)) for k in keys)
            return [
                IndexEntry(key, shard, self.tier_names[c.node_tier[n]], int(self._nbytes[n]),
                           self.tenants.by_index(int(self._tenant[n])).id, int(self._checksum[n]))
                for key, n in pairs if n is not None and self._ready[n]
            ]

    def slab(self, tier: str) -> Slab:
        for s in self._slabs:
            if s.tier == tier:
                return s
        raise BadRequest(f"no tier named {tier!r}; tiers: {self.tier_names}")

    def __len__(self) -> int:
        return len(self._cache.index)

    def metadata_bytes(self) -> int:
        """Bookkeeping bytes: per-node arrays, the cache's lists and the index."""
        cache = self._cache
        n = cache.capacity
        arrays = sum(a.nbytes for a in (self._nbytes, self._checksum, self._tenant, self._shared, self._ready, self._doomed))
        lists = 8 * n * 24  # node tables, residency and policy links: ~24 list slots per node
        keys = (49 + 28 + 3 * 8 * 3 // 2) * len(cache.index)  # key object, index entry, dict slack
        return arrays + lists + keys

    def stats(self) -> dict:
        with self._lock:
            cache = self._cache
            tiers = {}
            for t, s in enumerate(self._slabs):
                nodes = [n for n, k in enumerate(cache.node_key) if k is not None and cache.node_tier[n] == t]
                used = int(self._nbytes[nodes].sum()) if nodes else 0
                tiers[s.tier] = {
                    "page_bytes": s.page_bytes,
                    "pages_total": s.num_pages,
                    "pages_used": cache.tier_used(t),
                    "chunks": len(nodes),
                    "bytes": used,
                    "leased_pages": sum(1 for n in nodes if cache.res.leases[n]),
                }
                self.metrics.bytes.set(used, s.tier)
                self.metrics.chunks.set(len(nodes), s.tier)
            self.metrics.lease_waits.set_total(cache.res.lease_skips)
            tenants = {}
            for ten in self.tenants:
                used = self.tenants.usage(ten.id)
                tenants[ten.id] = {"bytes": used, "quota_bytes": ten.quota_bytes, "priority": ten.priority}
                self.metrics.tenant_bytes.set(used, ten.id)
            return {
                "tiers": tiers, "tenants": tenants, "chunks": len(cache.index), "policy": self.config.policy,
                "policy_stats": cache.policies[0].stats(), "metrics": self.metrics.snapshot(),
            }

    def close(self) -> None:
        if self._evictor is not None:
            with self._wake:
                self._closing = True
                self._wake.notify()
            self._evictor.join(timeout=5)
        with self._lock:
            assert not any(self._cache.res.leases), "closing a store with live leases"
            for s in self._slabs:
                s.close()
            self._cache.index.clear()

    # ------------------------------------------------------------------ cache hooks (lock held)

    def move(self, node: int, src_tier: int, src_page: int, dst_tier: int, dst_page: int) -> bool:
        nb = int(self._nbytes[node])
        src = self._slabs[src_tier].page(src_page)[:nb]
        dst = self._slabs[dst_tier].page(dst_page)[:nb]
        if dst_tier > src_tier:  # demotion: verified when it is read back
            np.copyto(dst, src)
            self.metrics.demotions.inc(1, self.tier_names[src_tier])
        else:
            if copy_with_checksum(dst, src) != int(self._checksum[node]):
                return False
            self.metrics.promotions.inc(1, self.tier_names[dst_tier])
        if self._scrubs(node):
            self._slabs[src_tier].page(src_page).fill(0)  # the page it left is free now
        return True

    def _scrubs(self, node: int) -> bool:
        return self._ready[node] and self.tenants.by_index(int(self._tenant[node])).scrub

    def dropped(self, node: int, tier: int, page: int, reason: str) -> None:
        name = self.tier_names[tier]
        if reason == "evicted":
            self.metrics.evictions.inc(1, name)
        elif reason == "corrupt":
            self.metrics.checksum_failures.inc(1, name)
        if self._scrubs(node):
            self._slabs[tier].page(page).fill(0)  # the whole page: no byte of it says anything
        if self._ready[node]:
            self.tenants.refund(int(self._tenant[node]), int(self._nbytes[node]))
            if self.track_gone:
                self._gone.append(self._cache.node_key[node])
        self._ready[node] = False
        self._doomed[node] = False
        self._nbytes[node] = 0

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

    def _discard(self, node: int, reason: str) -> None:
        """Hides a chunk now; frees it now, or at its last release when leased."""
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

    def _count_reads(self, tenant: str, result: Sequence[np.ndarray | None]) -> None:
        hits = sum(r is not None for r in result)
        m = self.metrics
        if hits:
            m.hits_chunks.inc(hits, tenant)
            m.get_bytes.inc(sum(r.shape[0] for r in result if r is not None), tenant)
        if len(result) - hits:
            m.misses_chunks.inc(len(result) - hits, tenant)
