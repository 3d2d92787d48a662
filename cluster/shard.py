"""The shard actor: one per node, holding that node's chunk store and keeping the index true.

- Its DRAM slab is a named file in /dev/shm, so clients on the same node copy in and out of it
  directly (``reserve``/``commit``, ``lease_reads``/``release``): one copy, no Ray in the data path.
- Clients on other nodes send and receive bytes through Ray (``put``, ``get``).
- Bytes before index: it publishes a chunk to the index only after the chunk is committed, and
  removes from the index what its store evicted, removed or found corrupt.
- A heartbeat thread renews its membership and ends holds of clients that never came back.
- Fenced by incarnation: when the index has forgotten it, it rejoins only if the controller does
  not answer "dropped" for its incarnation; a dropped shard (its node declared dead, say) stops
  serving and publishing instead of coming back as a zombie.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import ray

from kvpool.auth import Authority, Principal
from kvpool.cluster.messages import (
    Commit,
    Get,
    Got,
    Leased,
    LeaseReads,
    Placement,
    Put,
    Reserve,
    Reserved,
    check_version,
)
from kvpool.cluster.shard_access import joined_request, where, who, writer
from kvpool.cluster.shard_drills import DRILLS_ENV, Drills
from kvpool.errors import BadRequest, Forbidden, KvPoolError, QuotaExceeded, ReservationGone, Unavailable
from kvpool.index import open_index
from kvpool.keys import ChunkKey
from kvpool.node.paths import run_dir
from kvpool.sizing import resolve_store
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry

__all__ = ["DRILLS_ENV", "ShardActor", "shard_name", "tenants_to_register"]
log = logging.getLogger("kvpool.shard")
RECONCILE_EVERY = 6  # heartbeats (ttl/3 each) between two reconciles with the index


def shard_name(pool: str, shard_id: str) -> str:
    return f"kvpool-shard-{pool}-{shard_id}"


def tenants_to_register(config: list[dict], known: set[str]) -> list[dict]:
    """The tenants a joining shard writes to the index: new ones, and known ones whose quota or
    priority its config names; a known tenant otherwise keeps what the operator set."""
    return [t for t in config if t["id"] not in known or "quota_bytes" in t or "priority" in t]


@ray.remote(num_cpus=0, max_concurrency=8)
class ShardActor(Drills):
    def __init__(self, shard_id: str, pool: str, store: dict, tenants: list[dict], index_url: str | None,
                 ttl_s: float = 5.0, request_ttl_s: float = 600.0) -> None:
        self.shard_id = shard_id
        self.pool = pool
        self.started = time.monotonic()
        self._stall_s = 0.0
        self.incarnation = uuid.uuid4().hex
        self.fenced = False
        self.refused = 0  # chunks the index refused at a reconcile (over quota), dropped here
        # The pool secret comes with the actor's environment (bootstrap.up) or a mounted file.
        self.auth = Authority.from_env()
        cfg = resolve_store(store)  # a tier asked for in bytes or as a share of memory: pages on THIS node
        run = run_dir()  # beside the node files: engines map it from there
        cfg.setdefault("dram_dir", run if os.path.isdir(run) else None)
        cfg["name"] = f"{pool}-{shard_id}"
        if cfg["dram_dir"]:
            from kvpool.slab import sweep_orphans

            for path in sweep_orphans(cfg["dram_dir"], f"kvpool-{pool}-"):
                log.warning("shard %s: removed the slab %s of a pool process that is gone", shard_id, path)
        reg = TenantRegistry([Tenant(**t) for t in tenants])
        self.store = ChunkStore(StoreConfig(**cfg), reg)
        self.store.track_gone = True
        if index_url:
            self.index = open_index(index_url)
        else:
            from kvpool.cluster.index_actor import ActorIndex

            self.index = ActorIndex(credential=self.auth.pool_credential())
        self.ttl_s = ttl_s
        self.node_id = ray.get_runtime_context().get_node_id()
        self.tenant_config = tenants
        self.request_ttl_s = request_ttl_s
        self._requests: dict[int, tuple[object, float]] = {}  # id -> (ActiveRequest, deadline)
        self._reserved: dict[int, list[ChunkKey]] = {}  # reservation id -> the addresses it placed
        self._join()
        from kvpool.cluster.metrics import RayExporter

        self.exporter = RayExporter(self.store.metrics, shard_id)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="kvpool-heartbeat")
        self._beat.start()
        from kvpool.cluster.node_server import serve_node

        self.node = serve_node(self, index_url) if cfg["dram_dir"] else None  # engines reach it here, without Ray

    # ---------------------------------------------------------------- membership
    def _join(self) -> None:
        """Registers the tenants it serves and itself (again, after the index lost them).

        NOTE: a tenant the index already knows keeps its quota and priority (an operator may have
        set them with `kvpool tenants`) unless this shard's config names them explicitly: a node
        joining must not reset a quota to unlimited."""
        for t in tenants_to_register(self.tenant_config, {t.id for t in self.index.tenants()}):
            try:
                self.index.add_tenant(t["id"], t.get("quota_bytes", 2**62), t.get("priority", "normal"))
            except Forbidden as e:  # a shard's Redis user creates tenants, never changes a quota
                log.warning("shard %s: tenant %s keeps the index's quota and priority (%s): set them with "
                            "`kvpool tenants` as an operator", self.shard_id, t["id"], e)
        self.index.register_shard(self.shard_id, self.node_id, self.ttl_s)

    def _heartbeat(self) -> None:
        beats = 0
        while not self._stop.wait(self.ttl_s / 3):
            beats += 1
            try:
                if beats % RECONCILE_EVERY == 0 and not self.fenced:
                    # Republishes what it holds and the index forgot (a replica whose primary died
                    # and was purged), and drops index entries it no longer backs.
                    self.reconcile()
                try:
                    self.index.heartbeat(self.shard_id, self.ttl_s)
                    self.fenced = False
                except BadRequest:  # the index forgot us (restarted empty, or we were dropped)
                    self._rejoin()
                self.store.expire_holds()
                for hid in [h for h in self._reserved if self.store.hold_owner(h) is None]:
                    self._reserved.pop(hid, None)  # expired uncommitted
                self._expire_requests()
                self._forget_gone()
                self.store.stats()  # refreshes the gauges
                self.exporter.export()
            except KvPoolError as e:  # the index is down: keep serving, retry next beat
                log.warning("shard %s: heartbeat failed: %s", self.shard_id, e)
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("shard %s: heartbeat loop", self.shard_id)

    def _rejoin(self) -> None:
        """Rejoins the index and republishes, unless the controller dropped this incarnation: then
        it is fenced (serves nothing, publishes nothing) until registered again."""
        from kvpool.cluster.controller import CONTROLLER

        try:
            ctl = ray.get_actor(CONTROLLER)
            standing = ray.get(ctl.member.remote(self.shard_id, self.incarnation), timeout=max(self.ttl_s, 2.0))
        except Exception as e:  # noqa: BLE001 - cannot confirm: do not rejoin this beat
            log.warning("shard %s: the index forgot it and the controller did not answer (%s); not rejoining yet",
                        self.shard_id, type(e).__name__)
            return
        if standing == "dropped":
            if not self.fenced:
                log.error("shard %s: the controller dropped it; fenced: serving and publishing nothing", self.shard_id)
            self.fenced = True
            return
        self.fenced = False
        self._join()
        log.warning("shard %s: rejoined the index, republished %s", self.shard_id, self.reconcile())

    def _forget_gone(self) -> None:
        gone = self.store.take_gone()
        if gone:
            self.index.remove(gone, shard=self.shard_id)

    def _publish(self, keys: list[ChunkKey]) -> None:
        """Publishes the committed chunks among ``keys`` (bytes are in place)."""
        entries = self.store.index_entries(self.shard_id, keys)
        if entries and self.fenced:
            raise Unavailable(f"shard {self.shard_id} was dropped from the pool (fenced): its chunks are not listed")
        if entries:
            try:
                self.index.publish(entries)
            except QuotaExceeded:
                # NOTE: the index charges the tenant's quota across every shard and published
                # nothing; bytes it will never list would hold the tenant's pages past its quota.
                for tenant in {e.tenant for e in entries}:
                    self.store.remove_many([e.key for e in entries if e.tenant == tenant], tenant)
                raise
        self._forget_gone()

    def info(self) -> dict:
        st = self.store
        return {"shard": self.shard_id, "node_id": self.node_id, "slab": st.slab("dram").path,
                "page_bytes": st.page_bytes, "dram_pages": st.config.dram_pages, "disk_pages": st.config.disk_pages,
                "incarnation": self.incarnation,
                "peer": None if self.node is None else self.node.peer_address}

    def reconcile(self) -> dict:
        """Makes the index list what this shard holds. What the index refuses (a tenant over its
        quota) is dropped here: bytes it will never list would hold the tenant's pages."""
        r = self.index.reconcile(self.shard_id, self.store.index_entries(self.shard_id))
        by_tenant: dict[str, list[ChunkKey]] = {}
        for e in r.refused:
            by_tenant.setdefault(e.tenant, []).append(e.key)
        for tenant, keys in by_tenant.items():
            self.store.remove_many(keys, tenant)
        if r.refused:
            self.refused += len(r.refused)
            log.warning("shard %s: the index refused %d chunks at reconcile (tenants %s over quota); dropped them",
                        self.shard_id, len(r.refused), sorted(by_tenant))
        return {"published": r.published, "removed": r.removed, "refused": len(r.refused)}

    # ---------------------------------------------------------------- same node (shared memory)
    # ---------------------------------------------------------------- who and where
    def _who(self, credential: str) -> Principal:
        return who(self, credential)

    def _where(self, p: Principal, raw, shared: bool) -> list[ChunkKey]:
        return where(p, raw, shared)

    def _writer(self, w) -> tuple[Principal, list[ChunkKey], ChunkKey | None]:
        return writer(self, w.credential, w.keys, w.shared, w.parent)

    def _own_hold(self, hold_id: int, credential: str) -> bool:
        """Whether ``hold_id`` is the caller's (another tenant's hold is left alone, silently)."""
        return self.store.hold_owner(hold_id) == self._who(credential).tenant

    # ---------------------------------------------------------------- same node (shared memory)
    def reserve(self, msg: Reserve) -> Reserved:
        check_version(msg, "this shard")
        check_version(msg.write, "this shard")
        w = msg.write
        self._maybe_stall()
        p, where, parent = self._writer(w)
        raw = dict(zip(where, (bytes(k) for k in w.keys)))
        hid, places = self.store.reserve(where, list(msg.sizes), p.tenant, shared=w.shared, parent=parent,
                                         first_position=w.first_position, request=self._request(w.request_id, p.tenant))
        self._reserved[hid] = [pl.key for pl in places]  # what its commit publishes
        return Reserved(hid, [Placement(raw[pl.key], pl.offset, pl.nbytes) for pl in places])

    def commit(self, msg: Commit) -> int:
        check_version(msg, "this shard")
        if not self._own_hold(msg.hold_id, msg.credential):
            raise ReservationGone(f"no reservation {msg.hold_id} of this caller: it was committed, aborted or expired")
        n = self.store.commit(msg.hold_id, msg.checksums)
        self._publish(self._reserved.pop(msg.hold_id, [])[:n])
        return n

    def abort(self, hold_id: int, credential: str = "") -> None:
        if self._own_hold(hold_id, credential):
            self.store.abort(hold_id)
            self._reserved.pop(hold_id, None)

    def lease_reads(self, msg: LeaseReads) -> Leased:
        check_version(msg, "this shard")
        self._maybe_stall()
        t0 = time.perf_counter()
        p = self._who(msg.credential)
        hid, places = self.store.lease_reads(self._where(p, msg.keys, msg.shared), p.tenant, leading=msg.leading)
        self.exporter.observe_get((time.perf_counter() - t0) * 1e3, "shm")
        return Leased(hid, [None if pl is None else Placement(bytes(k), pl.offset, pl.nbytes, pl.checksum)
                            for k, pl in zip(msg.keys, places)])

    def release(self, hold_id: int, corrupt=(), credential: str = "", shared: bool = False) -> None:
        if self._own_hold(hold_id, credential):
            p = self._who(credential)
            self.store.release(hold_id, self._where(p, corrupt, shared))

    # ---------------------------------------------------------------- requests in flight
    def begin(self, keys, credential: str, priority: str | None = None, shared: bool = False) -> int:
        """Leases the leading run of ``keys`` held here until ``end`` (or ``request_ttl_s``, so a
        client that died does not pin chunks forever); the request id."""
        p = self._who(credential)
        req = self.store.begin(p.tenant, self._where(p, keys, shared), priority)
        self._requests[req.id] = (req, time.monotonic() + self.request_ttl_s)
        return req.id

    def _request(self, request_id: int | None, tenant: str):
        return joined_request(self, request_id, tenant)

    def end(self, request_id: int, credential: str) -> bool:
        """Ends the caller's request; False when it was unknown (expired, or the shard restarted)
        or another tenant's."""
        entry = self._requests.get(request_id)
        if entry is not None and entry[0].tenant != self._who(credential).tenant:
            return False
        return self._end(request_id)

    def _end(self, request_id: int) -> bool:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.store.end(entry[0])
        return entry is not None

    def requests(self) -> list[int]:
        return sorted(self._requests)

    def _expire_requests(self) -> None:
        now = time.monotonic()
        for rid, (req, deadline) in list(self._requests.items()):
            if deadline < now or req.cancelled:
                log.warning("shard %s: request %d %s", self.shard_id, rid, "cancelled" if req.cancelled else "expired")
                self._end(rid)

    # ---------------------------------------------------------------- other nodes (bytes over Ray)
    def put(self, msg: Put) -> int:
        """Chunks whose bytes came with the call (from another node)."""
        check_version(msg, "this shard")
        check_version(msg.write, "this shard")
        w = msg.write
        self._maybe_stall()
        p, keys, parent = self._writer(w)
        stored = self.store.put_many(keys, msg.payloads, p.tenant, shared=w.shared, parent=parent,
                                     first_position=w.first_position, request=self._request(w.request_id, p.tenant))
        self._publish([k for k, s in zip(keys, stored) if s])
        return sum(stored)

    def get(self, msg: Get) -> Got:
        """The leading run of chunks, verified (a bad one ends the run)."""
        check_version(msg, "this shard")
        self._maybe_stall()
        t0 = time.perf_counter()
        p = self._who(msg.credential)
        out = []
        for got in self.store.get_many(self._where(p, msg.keys, msg.shared), p.tenant):
            if got is None:
                break
            out.append(got)
        self.exporter.observe_get((time.perf_counter() - t0) * 1e3, "ray")
        return Got(out)

    def pin(self, keys, credential: str, shared: bool = False) -> int:
        """Pins chunks held here (warm-up, an operator's), up to the policy's pinned cap; how many."""
        p = self.auth.require(credential, "pinning (warm-up)")
        return self.store.pin(self._where(p, keys, shared), p.tenant)

    def remove(self, keys, credential: str, shared: bool = False) -> int:
        """Removes the caller's own chunks of ``keys`` (the shared ones: an operator)."""
        p = self._who(credential)
        if shared:
            self.auth.require(credential, "removing shared chunks")
        n = self.store.remove_many(self._where(p, keys, shared), p.tenant)
        self._forget_gone()
        return n

    def export_metrics(self) -> None:
        self.store.stats()
        self.exporter.export()

    def stats(self) -> dict:
        st = self.store.stats()
        st["shard"] = self.shard_id
        st["node_id"] = self.node_id
        st["uptime_s"] = time.monotonic() - self.started
        st["active_requests"] = len(self.store.active_requests())
        st["reconcile_refused"] = self.refused
        st["fenced"] = self.fenced
        st["node_socket"] = None if self.node is None else self.node.info["socket"]
        st["node_served"] = 0 if self.node is None else self.node.served
        return st

    def drain(self, credential: str = "") -> int:
        """Leaves gracefully: ends the requests and read holds still open (their chunks become
        misses for those clients), forgets its entries in the index and closes its slabs. The
        pool's own processes and operators only."""
        self.auth.require(credential, "draining a shard")
        self._stop.set()
        for rid in list(self._requests):
            self._end(rid)
        self.store.expire_holds(now=float("inf"))
        if self.node is not None:
            self.node.close()
        keys = list(self.index.shard_keys(self.shard_id))
        n = self.index.remove(keys, shard=self.shard_id) if keys else 0
        self.store.close()
        return n

    def ping(self) -> float:
        return time.time()

    def free_pages(self) -> int:  # of its DRAM tier: a node without room spills to one with room
        return self.store._cache.tier_pages[0] - self.store._cache.tier_used(0)
