"""PoolClient: what connectors call. Batched lookup, put and get over every shard of the pool.

- ``lookup`` asks the index (one round trip) how many leading chunks exist and where.
- ``put`` places new chunks with the ring (bounded load) and talks to each owner in parallel;
  ``get`` reads from wherever the index says a chunk is, so data placed before a ring change
  is still found.
- A shard on this node is reached through its shared-memory slab: the bytes are copied once,
  straight into or out of its pages, and verified (transport ``shm``). Other shards are reached
  through Ray (transport ``ray``).
- Every call has one deadline, whatever its round trips: ``timeout_s`` from its start, or longer
  while measured round trips are slow (``srtt + 4 rttvar``, as TCP's RTO; at most
  ``max_timeout_s``, 2 x ``timeout_s`` by default); and it works on one snapshot of the ring and its shards (``View``), so a ring change mid-call is a miss or a
  failed put, never an exception. Bad input (a key that is not 16 bytes, a payload larger than a
  page, an unknown tenant) is a typed error on writes and changes nothing; an empty ring (the
  controller restarting) is ``Unavailable`` (503) on writes and a miss on reads.
- A failed, slow or dead shard makes its chunks misses (the engine
  recomputes), never an exception on the read path and never a hang. A chunk the index lists but
  its shard does not have is removed from the index (``invalidate``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import ray

from kvpool.auth import claimed_tenant, scope_tag, scoped
from kvpool.buffers import as_byte_array
from kvpool.cluster.client_state import (
    RAY_FAIL,
    ClusterRequest,
    Deadline,
    RoundTrips,
    View,
    cause,
    check_put,
    raise_bad_write,
    raise_refused,
)
from kvpool.cluster.controller import CONTROLLER
from kvpool.cluster.messages import Get, Got, Put, WireMismatch, Write, check_version
from kvpool.cluster.ring import HashRing
from kvpool.cluster.shard import shard_name
from kvpool.cluster.transport import TRANSPORTS, SharedMemoryTransport
from kvpool.errors import BadRequest, KvPoolError, Unavailable, UnknownTenant
from kvpool.index import PrefixHit, open_index
from kvpool.keys import ChunkKey, is_shared
from kvpool.slab import Slab

log = logging.getLogger("kvpool.client")


class PoolClient:
    def __init__(self, pool: str = "default", index_url: str | None = None, timeout_s: float = 2.0,
                 namespace: str | None = None, refresh: bool = True, replicas: int = 1,
                 transport: str = "ray", max_timeout_s: float | None = None) -> None:
        if transport not in TRANSPORTS:
            raise BadRequest(f"transport {transport!r} is not one of {sorted(TRANSPORTS)}")
        self.transport = TRANSPORTS[transport]()
        self.pool = pool
        self.replicas = replicas  # copies of each chunk put (hot prefixes may ask for more)
        self.timeout_s = timeout_s
        # A call's timeout follows the measured round trips (RoundTrips), between timeout_s and this.
        self.max_timeout_s = 2 * timeout_s if max_timeout_s is None else max(timeout_s, max_timeout_s)
        self.round_trips = RoundTrips()
        self.namespace = namespace
        self.controller = ray.get_actor(CONTROLLER, namespace=namespace)
        if index_url:
            self.index = open_index(index_url)
            ping = getattr(self.index, "ping", None)
            if ping is not None and not ping():
                raise Unavailable(f"the index at {getattr(self.index, 'url', index_url)} did not answer a ping: is "
                                  "Redis up at that URL (kvpool up --index-url)?")
        else:
            from kvpool.cluster.index_actor import ActorIndex

            self.index = ActorIndex(timeout_s=timeout_s, namespace=namespace)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._view = View(HashRing())
        self._mapped: dict[tuple[str, str], Slab] = {}  # this node's slabs, mapped once
        self._loads: Counter[str] = Counter()
        self._apply(self._first_state())
        self._stop = threading.Event()
        self._follower = None
        if refresh:
            self._follower = threading.Thread(target=self._follow, daemon=True, name="kvpool-ring")
            self._follower.start()

    # ---------------------------------------------------------------- ring and shards
    def _first_state(self, timeout_s: float = 30.0) -> dict:
        """The controller's state; a controller that is restarting is waited for (up to
        ``timeout_s``), not an error: clients may start while Ray brings it back."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(self.controller.state.remote(), timeout=timeout_s)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise Unavailable("the pool's controller did not come back within "
                                      f"{timeout_s:.0f} s: is the pool up (kvpool up)?") from None
                time.sleep(0.2)

    def _apply(self, state: dict) -> None:
        """Builds the new view aside and swaps it in as one object: a call in flight keeps the
        view it started with."""
        old = self._view
        ring = HashRing.from_dict(state["ring"])
        handles, slabs = {}, {}
        for sid, info in state["shards"].items():
            handles[sid] = old.handles.get(sid) or ray.get_actor(shard_name(self.pool, sid), namespace=self.namespace)
            if info["node_id"] == self.node_id and info.get("slab"):
                where = (sid, info["slab"])  # a shard back with a new slab is mapped anew
                if where not in self._mapped:
                    self._mapped[where] = Slab.attach(info["slab"], info["page_bytes"], info["dram_pages"])
                slabs[sid] = self._mapped[where]
        with self._lock:
            self._view = View(ring, dict(state["shards"]), handles, slabs, bool(state.get("secured")))

    # The view's parts, for callers that read one of them (a call reads ``self._view`` once).
    ring = property(lambda self: self._view.ring)
    shards = property(lambda self: self._view.shards)
    secured = property(lambda self: self._view.secured)
    _handles = property(lambda self: self._view.handles)
    _slabs = property(lambda self: self._view.slabs)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                state = ray.get(self.controller.wait.remote(self.ring.version, 2.0), timeout=10)
                if state["version"] != self.ring.version:
                    self._apply(state)
            except BaseException as e:  # noqa: BLE001 - keep following; the data path does not depend on it
                if self._stop.is_set() or isinstance(e, (SystemExit, KeyboardInterrupt)):
                    return  # closing, or Ray is shutting down
                log.warning("client: ring refresh failed (%s); retrying", type(e).__name__)
                self._stop.wait(1.0)

    def refresh(self) -> None:
        self._apply(ray.get(self.controller.state.remote(), timeout=self.timeout_s))

    def close(self) -> None:
        """Stops following the ring; waits for the follower (its long poll ends within seconds)
        so that no thread is inside a Ray call when Ray shuts down."""
        self._stop.set()
        if self._follower is not None and self._follower is not threading.current_thread():
            self._follower.join(timeout=20)

    def _deadline(self) -> Deadline:
        """A call's one deadline (its timeout: ``timeout_s``, longer while round trips are slow)."""
        return Deadline(self.round_trips.timeout(self.timeout_s, self.max_timeout_s))

    # ---------------------------------------------------------------- lookups
    @staticmethod
    def addresses(credential: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Where the index lists a caller's chunks of ``keys``: its own scope (the tenant its
        credential names), or the shared one for shared keys (kvpool.auth: scopes). The shards
        compute the same from the verified credential, so a liar's addresses lead nowhere."""
        return scoped(keys, scope_tag(None if is_shared(keys) else claimed_tenant(credential)))

    def lookup(self, credential: str, keys: Sequence[ChunkKey]) -> PrefixHit:
        """The leading run of ``keys`` the index lists in the caller's scope (one round trip)."""
        return self.index.lookup(self.addresses(credential, keys))

    # ---------------------------------------------------------------- requests in flight
    def begin(self, credential: str, keys: Sequence[ChunkKey], priority: str | None = None,
              hit: PrefixHit | None = None) -> "ClusterRequest":
        """Leases, on every shard that holds some, the leading run of a request's cached chunks
        until ``end``: eviction passes them over while the engine loads them. Best effort: a shard
        that does not answer in time just leaves its chunks unleased (a later miss, a recompute)."""
        view, deadline = self._view, self._deadline()
        hit = hit if hit is not None else self.lookup(credential, keys)
        shared = is_shared(keys)
        by_shard: dict[str, list[bytes]] = {}
        for i in range(hit.count):
            by_shard.setdefault(hit.shards[i], []).append(bytes(keys[i]))
        refs = [(sid, view.handles[sid].begin.remote(ks, credential, priority, shared))
                for sid, ks in by_shard.items() if sid in view.handles]
        ids = {}
        for sid, ref in refs:
            try:
                ids[sid] = ray.get(ref, timeout=deadline.left())  # bad input (unknown tenant) raises
            except RAY_FAIL as e:
                raise_refused(e)
                self.counts["begin_failed"] += 1
        return ClusterRequest(credential, ids, hit.count)

    def end(self, request: "ClusterRequest | None") -> None:
        """Ends the request on its shards (fire and forget: leases also expire on their own)."""
        if request is None:
            return
        for sid, rid in request.shard_requests.items():
            h = self._handles.get(sid)
            if h is not None:
                h.end.remote(rid, request.credential)
        request.shard_requests = {}

    def pin(self, credential: str, keys: Sequence[ChunkKey]) -> int:
        """Pins the leading run of chunks on the shards that hold them (warm-up, an operator's);
        how many were pinned (each shard's policy caps its pinned zone)."""
        view, deadline = self._view, self._deadline()
        hit = self.lookup(credential, keys)
        shared = is_shared(keys)
        by_shard: dict[str, list[bytes]] = {}
        for i in range(hit.count):
            by_shard.setdefault(hit.shards[i], []).append(bytes(keys[i]))
        refs = [view.handles[sid].pin.remote(ks, credential, shared)
                for sid, ks in by_shard.items() if sid in view.handles]
        pinned = 0
        for ref in refs:
            try:
                pinned += ray.get(ref, timeout=deadline.left())
            except RAY_FAIL as e:
                raise_refused(e)
                self.counts["pin_failed"] += 1
        return pinned

    # ---------------------------------------------------------------- writes
    def put(self, credential: str, keys: Sequence[ChunkKey], payloads: Sequence[object], *, shared: bool = False,
            first_position: int = 0, request: "ClusterRequest | None" = None) -> int:
        """Stores each chunk on its owner (and ``replicas - 1`` more shards); how many copies were
        stored. A shard's failure is logged and counted, not raised (a chunk not stored is a future
        miss); what reaches the caller: bad input (400, 404, 413: checked here before anything is
        sent where it can be, and refused alike by every shard), a refused credential (401, 403),
        a tenant's own 429, and an empty ring (503). With ``request`` (from ``begin``) the new
        chunks stay leased on their shards until the request ends."""
        view, deadline = self._view, self._deadline()
        arrays = [as_byte_array(p) for p in payloads]
        raw = check_put(keys, arrays, view.page_bytes, shared)
        groups: dict[str, list[int]] = {}
        with self._lock:
            for i, k in enumerate(raw):
                for owner in view.ring.place(k, self._loads, replicas=self.replicas):  # empty ring: 503
                    self._loads[owner] += 1
                    groups.setdefault(owner, []).append(i)
        stored = 0
        pending = []
        for sid, idx in groups.items():
            handle = view.handles.get(sid)
            if handle is None:  # not in this view's shards (a ring ahead of its shards): a future miss
                self.counts["put_failed"] += 1
                continue
            write = Write([raw[i] for i in idx], credential, shared, first_position + idx[0],
                          self._request_on(view, sid, request, deadline))
            transport = self._transport_to(view, sid)
            pending.append((sid, transport, transport.send(handle, Put(write, [arrays[i] for i in idx]))))
        for sid, transport, future in pending:
            try:
                stored += transport.wait(future, deadline.left(), deadline=deadline.at)
                self.round_trips.observe(deadline.elapsed())
                self.counts["put_" + transport.name] += 1
            except Exception as e:  # noqa: BLE001 - a shard's failure of any kind is a failed put
                raise_bad_write(e, lambda h=view.handles[sid]: self._unknown_tenant(h, credential, deadline))  # bad input, a refused credential, a spent quota, other wire versions
                self.counts["put_failed"] += 1
                log.warning("client: put to shard %s failed (%s)", sid, type(e).__name__)
        return stored

    @staticmethod
    def _unknown_tenant(handle, credential: str, deadline: Deadline) -> bool:
        """Whether the shard itself does not serve the caller's tenant (it verifies the caller of
        any call, a release of no hold included); False when it does not say in time."""
        try:
            ray.get(handle.release.remote(-1, [], credential), timeout=deadline.left())
        except Exception as e:  # noqa: BLE001 - only the shard's own 404 counts
            return isinstance(cause(e), UnknownTenant)
        return False

    def _transport_to(self, view: View, sid: str):
        """Shared memory for the shard on this node, the configured transport for the others."""
        slab = view.slabs.get(sid)
        return self.transport if slab is None else SharedMemoryTransport(slab.buf)

    def _request_on(self, view: View, sid: str, request: "ClusterRequest | None", deadline: Deadline) -> int | None:
        """The request's id on shard ``sid``, begun there (leasing nothing yet) the first time the
        request writes to it; None without a request, or when the shard does not answer in time
        (the write goes on, unleased)."""
        if request is None or sid not in view.handles:
            return None
        rid = request.shard_requests.get(sid)
        if rid is None:
            try:
                rid = request.shard_requests[sid] = ray.get(view.handles[sid].begin.remote([], request.credential),
                                                            timeout=deadline.left())
            except RAY_FAIL:
                self.counts["begin_failed"] += 1
        return rid

    # ---------------------------------------------------------------- reads
    def get(self, credential: str, keys: Sequence[ChunkKey], hit: PrefixHit | None = None,
            outs: Sequence[object] | None = None) -> list[np.ndarray]:
        """The leading run of chunks, each verified, from wherever they are. Never raises on a
        shard's failure: the run just ends there. ``outs`` (one writable buffer per key) receive
        the chunks read through shared memory, instead of fresh arrays.

        NOTE: the lease on this node's shard is asked for at the same time as the index lookup
        (for every key, misses allowed), so a same-node read costs one round trip, not two."""
        view, deadline = self._view, self._deadline()
        local = next((sid for sid in view.slabs if sid in view.handles), None)
        shared = is_shared(keys)
        pending = []
        if local is not None:
            shm = self._transport_to(view, local)
            pending.append((local, [], shm, shm.fetch(view.handles[local],
                                                      Get([bytes(k) for k in keys], credential, shared), outs)))
        where = self.addresses(credential, keys)
        hit = hit if hit is not None else self.index.lookup(where)
        n = hit.count
        got: dict[int, np.ndarray] = {}
        by_shard: dict[str, list[int]] = {}
        for i in range(n):
            by_shard.setdefault(hit.shards[i], []).append(i)
        if local is not None:
            pending[0][1].extend(by_shard.get(local, []))
            pending[0][3].want(pending[0][1])
        for sid, idx in by_shard.items():
            handle = view.handles.get(sid)
            if handle is None or sid == local:
                continue  # gone from the ring (misses), or served from the lease above
            pending.append((sid, idx, self.transport,
                            self.transport.fetch(handle, Get([bytes(keys[i]) for i in idx], credential, shared))))
        for sid, idx, transport, future in pending:
            try:
                reply = self._got(transport.wait(future, deadline.left(), deadline=deadline.at))
                self.round_trips.observe(deadline.elapsed())
                arrays = reply.arrays
                if idx:
                    self.counts["get_" + transport.name] += 1
            except Exception as e:  # noqa: BLE001 - reads never raise: a shard's failure is a miss
                raise_refused(e)
                self.counts["get_failed"] += 1
                log.warning("client: get from shard %s failed (%s): trying replicas", sid, type(e).__name__)
                got.update(self._from_replicas(view, credential, keys, idx, sid, deadline))
                continue
            for i, a in zip(idx, arrays):
                got[i] = a
            if len(arrays) < len(idx):
                if not reply.corrupt:  # the index listed a chunk the shard does not have
                    self._invalidate(where[idx[len(arrays)]], sid)
                got.update(self._from_replicas(view, credential, keys, idx[len(arrays):], sid, deadline))
        out = []
        for i in range(n):
            if i not in got:
                break
            out.append(got[i])
        return out

    @staticmethod
    def _got(reply) -> Got:
        """A ``Got`` whose version was checked (a mismatch is logged: reads never raise)."""
        try:
            check_version(reply, "this client")
        except WireMismatch as e:
            log.error("client: %s", e)
            raise
        return reply

    def _from_replicas(self, view: View, credential: str, keys: Sequence[ChunkKey], idx: list[int],
                       failed: str, deadline: Deadline) -> dict[int, np.ndarray]:
        """Reads positions ``idx`` (in order) from the other owners the ring gives their keys, when
        the shard the index named failed. Stops at the first position no replica serves."""
        if self.replicas < 2 or not len(view.ring):
            return {}
        out: dict[int, np.ndarray] = {}
        for i in idx:
            # NOTE: bounded-load placement may have skipped a full shard and put a copy further
            # along the ring, so the search walks every shard in ring order, not just the first
            # ``replicas`` owners (a round trip per shard that lacks it, on the failure path only).
            for sid in view.ring.owners(bytes(keys[i]), len(view.ring.weights)):
                h = view.handles.get(sid)
                if sid == failed or h is None:
                    continue
                if deadline.passed:
                    return out
                try:
                    get = Get([bytes(keys[i])], credential, is_shared(keys))
                    (a,) = self._got(self.transport.wait(self.transport.fetch(h, get), deadline.left(),
                                                         deadline=deadline.at)).arrays or [None]
                except Exception:  # noqa: BLE001 - other wire versions, a dead or slow shard: a miss here too
                    continue
                if a is not None:
                    out[i] = a
                    self.counts["get_replica"] += 1
                    break
            if i not in out:
                break
        return out

    def _invalidate(self, key: ChunkKey, shard: str) -> None:
        try:
            self.index.invalidate(ChunkKey(bytes(key)), shard)
            self.counts["invalidated"] += 1
        except KvPoolError:
            pass
