"""A shard without its host: one node's chunk store, its service and its two doors, and the
membership loop that keeps the index true -- the same whether Ray hosts it (cluster/shard.py, one
actor per node of a pool) or it runs as the pool's one process on one machine (cluster/solo.py).

- Bytes before index: the service publishes a chunk only after it is committed, and removes from
  the index what the store evicted, removed or found corrupt.
- A heartbeat thread renews its membership, reconciles with the index and ends holds and
  requests of clients that never came back.
- Fenced by incarnation: when the index has forgotten it, it rejoins only if its host does not
  answer "dropped" for its incarnation (``standing``); a dropped shard stops serving and
  publishing instead of coming back as a zombie.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from kvpool.auth import Authority
from kvpool.cluster.node_server import NodeServer, sweep_node_files
from kvpool.cluster.service import ShardService
from kvpool.errors import BadRequest, Forbidden, KvPoolError
from kvpool.index.operator_state import OperatorState
from kvpool.keys import ChunkKey
from kvpool.node.paths import run_dir
from kvpool.node.trust import ensure_run_dir
from kvpool.sizing import resolve_store
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry

log = logging.getLogger("kvpool.shard")
RECONCILE_EVERY = 6  # heartbeats (ttl/3 each) between two reconciles with the index


def tenants_to_register(config: list[dict], known: set[str]) -> list[dict]:
    """The tenants a joining shard writes to the index: new ones, and known ones whose quota or
    priority its config names; a known tenant otherwise keeps what the operator set."""
    return [t for t in config if t["id"] not in known or "quota_bytes" in t or "priority" in t]


class Shard:
    """``index`` (kvpool.index contract), ``members`` (the other shards and where engines' reports
    go: cluster.members.Members on Ray, cluster.solo.Alone on its own), ``standing(incarnation)``
    ("member" or "dropped"; raises when it cannot tell) and ``export`` (metrics, each heartbeat)
    come from the host."""

    def __init__(self, shard_id: str, pool: str, store: dict, tenants: list[dict], index, members, *,
                 node_id: str, host: str, ttl_s: float = 5.0, request_ttl_s: float = 600.0,
                 standing: Callable[[str], str] | None = None, export: Callable[[], None] | None = None) -> None:
        self.shard_id = shard_id
        self.pool = pool
        self.started = time.monotonic()
        self.incarnation = uuid.uuid4().hex
        self.refused = 0  # chunks the index refused at a reconcile (over quota), dropped here
        self.auth = Authority.from_env()  # the pool secret: a file its host names in the environment
        cfg = resolve_store(store)  # a tier asked for in bytes or as a share of memory: pages on THIS node
        run = run_dir()  # the node files and the slab: engines map them from there
        ensure_run_dir(run)  # private, or refused with the fix (kvpool.node.trust)
        cfg["dram_dir"] = run
        cfg["name"] = f"{pool}-{shard_id}"
        from kvpool.slab import sweep_orphans

        for path in sweep_orphans(run, f"kvpool-{pool}-"):
            log.warning("shard %s: removed the slab %s of a pool process that is gone", shard_id, path)
        sweep_node_files(run, pool, shard_id)
        reg = TenantRegistry([Tenant(**t) for t in tenants])
        self.store = ChunkStore(StoreConfig(**cfg), reg)
        self.store.track_gone = True
        self.index = index
        self.ttl_s = ttl_s
        self.node_id = node_id
        self.tenant_config = tenants
        self.operator = OperatorState()  # the operator's quotas and priorities, as last seen in the index
        self.members = members
        self._standing = standing
        self._export = export or self.store.stats
        self.service = ShardService(shard_id, pool, self.store, self.auth, self.index, self.members, request_ttl_s)
        self._join()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="kvpool-heartbeat")
        self._beat.start()
        # Engines of this node reach the service on its socket, other shards on its peer port.
        self.node = NodeServer(self.service, run, self.incarnation, self.stats, host=host, pool_stats=self.pool_stats)

    @property
    def fenced(self) -> bool:
        return self.service.fenced

    @fenced.setter
    def fenced(self, value: bool) -> None:
        self.service.fenced = value

    # ---------------------------------------------------------------- membership
    def _join(self) -> None:
        """Registers the tenants it serves and itself (again, after the index lost them).

        NOTE: a tenant the index already knows keeps its quota and priority (an operator may have
        set them with `kvpool tenants`) unless this shard's config names them explicitly: a node
        joining must not reset a quota to unlimited. One the index lost (it restarted empty) is
        created with the quota and priority this shard last saw there (kvpool.index.operator_state):
        its Redis user creates a tenant but never changes a quota, so the first values are final."""
        for t in tenants_to_register(self.tenant_config, {t.id for t in self.index.tenants()}):
            quota, priority = self.operator.wanted(t["id"], t)
            try:
                self.index.add_tenant(t["id"], quota, priority)
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
                    self.reconcile(self.auth.pool_credential())
                try:
                    self.index.heartbeat(self.shard_id, self.ttl_s)
                    self.fenced = False
                except BadRequest:  # the index forgot us (restarted empty, or we were dropped)
                    self._rejoin()
                else:
                    self._observe_operator()
                self.store.expire_holds()
                self.service.writes.expire_reservations()
                self.service.expire_requests()
                self.service.forget_gone()
                self._export()  # refreshes the gauges (and exports them, where the host does)
            except KvPoolError as e:  # the index is down: keep serving, retry next beat
                log.warning("shard %s: heartbeat failed: %s", self.shard_id, e)
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("shard %s: heartbeat loop", self.shard_id)

    def _rejoin(self) -> None:
        """Rejoins the index and republishes, unless its host dropped this incarnation: then it is
        fenced (serves nothing, publishes nothing) until registered again."""
        if self._standing is not None:
            try:
                standing = self._standing(self.incarnation)
            except Exception as e:  # noqa: BLE001 - cannot confirm: do not rejoin this beat
                log.warning("shard %s: the index forgot it and the controller did not answer (%s); not rejoining "
                            "yet", self.shard_id, type(e).__name__)
                return
            if standing == "dropped":
                if not self.fenced:
                    log.error("shard %s: the controller dropped it; fenced: serving and publishing nothing",
                              self.shard_id)
                self.fenced = True
                return
        self.fenced = False
        self._join()
        log.warning("shard %s: rejoined the index, republished %s", self.shard_id,
                    self.reconcile(self.auth.pool_credential()))

    def _observe_operator(self) -> None:
        """What the index says of the tenants' quotas and priorities now (the operator may have set
        them since): what a tenant the index loses is created with again."""
        try:
            self.operator.observe(self.index.tenants())
        except KvPoolError as e:  # the index is down: the values seen last stay
            log.debug("shard %s: tenants not read from the index (%s)", self.shard_id, e)

    def info(self, challenge: str = "") -> dict:
        """What the controller registers; ``proof`` answers its ``challenge`` with the pool secret
        (kvpool.auth.Authority.prove): a process that merely took a shard's name cannot."""
        st = self.store
        return {"proof": self.auth.prove("shard", self.shard_id, self.incarnation, challenge),
                "shard": self.shard_id, "node_id": self.node_id, "slab": st.slab("dram").path,
                "page_bytes": st.page_bytes, "dram_pages": st.config.dram_pages, "disk_pages": st.config.disk_pages,
                "incarnation": self.incarnation, "peer": self.node.peer_address}

    def reconcile(self, credential: str = "") -> dict:
        """Makes the index list what this shard holds. What the index refuses (a tenant over its
        quota) is dropped here: bytes it will never list would hold the tenant's pages. The pool's
        own processes and operators only."""
        self.auth.require(credential, "reconciling a shard with the index")
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

    def stats(self) -> dict:
        st = self.store.stats()
        st["shard"] = self.shard_id
        st["node_id"] = self.node_id
        st["uptime_s"] = time.monotonic() - self.started
        st["active_requests"] = len(self.store.active_requests())
        st["reconcile_refused"] = self.refused
        st["operator_state"] = {t: list(v) for t, v in self.operator.seen().items()}  # re-applied if the index loses it
        st["fenced"] = self.fenced
        st["node_socket"] = self.node.info["socket"] if getattr(self, "node", None) else None
        st["staging"] = self.service.writes.room.stats()  # engines' staging files here; those refused
        st["open"] = self.service.open_stats()  # what each tenant keeps open here, against its caps
        return st

    def pool_stats(self) -> dict:
        """The whole pool's stats as `kvpool stats` shows them: a pool of this one shard (its host
        gathers the other shards' where there are any)."""
        from kvpool.cluster.pool_stats import summarize

        return summarize(0, {self.shard_id: self.stats()}, self.members.engines(), "single-node")

    def node_stats(self) -> dict:
        """:meth:`stats` and the doors' own figures (operations served, time in each, peer reads)."""
        return self.node.stats()

    def drain(self, credential: str = "") -> int:
        """Leaves gracefully: ends the requests and read holds still open (their chunks become
        misses for those clients), forgets its entries in the index and closes its slabs. The
        pool's own processes and operators only."""
        self.auth.require(credential, "draining a shard")
        self._stop.set()
        for rid in list(self.service.requests):
            self.service.end_here(rid, None)
        self.store.expire_holds(now=float("inf"))
        self.node.close()
        self.service.close()
        self.members.close()
        keys = list(self.index.shard_keys(self.shard_id))
        n = self.index.remove(keys, shard=self.shard_id) if keys else 0
        self.store.close()
        return n

    def ping(self) -> float:
        return time.time()

    def free_pages(self) -> int:  # of its DRAM tier: a node without room spills to one with room
        return self.service.free_pages()
