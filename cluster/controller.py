"""The controller: one named actor that owns membership (which shards are in the pool, and where
their peer ports are), under a version number that changes with every join and leave.

It never sits on the data path. Shards follow it by long-polling ``wait`` for a new version
(cluster/members.py); nobody calls it per request. Its loop reconciles actual to target state
every ``interval_s``: shards whose heartbeat lapsed in the index for ``grace_s`` as measured by the
controller while the index answered (an index that does not answer is an index outage, not dead
shards), or whose node Ray declares dead, leave the membership and their index entries are purged; live
shards the index lists and the membership lacks (after the controller itself restarted) are adopted, and
one it cannot reach in ``ADOPT_TRIES`` passes is purged. A dropped shard is fenced: it asks
``member`` before rejoining the index and stops serving when the answer is "dropped". The operator
state (quotas, priorities) it last saw is re-applied when the index comes back empty, as each
shard re-applies what it saw when it rejoins (kvpool.index.operator_state): whichever comes first,
the same values. Every step is idempotent, and the loop logs and survives every exception.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import ray

from kvpool.auth import Authority
from kvpool.cluster.reports import Reports
from kvpool.index import open_index
from kvpool.index.operator_state import OperatorState

log = logging.getLogger("kvpool.controller")
CONTROLLER = "kvpool-controller"
ADOPT_TRIES = 5  # passes a shard the index lists may stay unreachable before it is purged


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=32)
class Controller:
    def __init__(self, pool: str, index_url: str | None, interval_s: float = 1.0,
                 grace_s: float | None = None) -> None:
        self.pool = pool
        self.auth = Authority.from_env()  # the pool secret, from bootstrap.up or a mounted file
        self.index_url = index_url
        self.interval_s = interval_s
        self.version = 0  # of the membership: one more at every join and leave
        self.shards: dict[str, dict] = {}
        self._changed = threading.Condition()
        self._index = None
        self._stop = threading.Event()
        self.passes = 0
        self.errors = 0
        self._missing: dict[str, int] = {}  # passes a shard has been absent from the index
        self.grace_s = max(2 * interval_s, 1.0) if grace_s is None else grace_s
        self._lapsed: dict[str, float] = {}  # shard -> when an answering index first showed it lapsed
        self._adopt_failed: dict[str, int] = {}
        self._dropped: set[str] = set()  # shards this controller took out: fenced until registered again
        self._operator = OperatorState()  # tenant -> (quota, priority), as last seen in the index
        self.purged = 0
        self._reports = Reports()
        self.incarnation = uuid.uuid4().hex  # a restarted controller (Ray restarts it empty) has a new one
        # NOTE: after a restart, adopt the live shards before answering anyone: a shard that took
        # the empty membership of a controller that has not reconciled yet would see no peers.
        try:
            self._adopt(self._idx().shards())
        except Exception as e:  # noqa: BLE001 - the index may be down: the loop adopts them later
            log.warning("controller: no shard adopted at start (%s)", type(e).__name__)
        self._loop = threading.Thread(target=self._run, daemon=True, name="kvpool-controller")
        self._loop.start()
        log.info("controller: started on node %s", ray.get_runtime_context().get_node_id()[:12])

    def _idx(self):
        if self._index is None:
            if self.index_url:
                self._index = open_index(self.index_url)
            else:
                from kvpool.cluster.index_actor import ActorIndex

                self._index = ActorIndex(credential=self.auth.pool_credential())
        return self._index

    # ---------------------------------------------------------------- membership
    def register(self, shard_id: str, info: dict, credential: str = "") -> int:
        """A shard joins: only the pool's own processes (`kvpool up`) may add one."""
        self.auth.require(credential, "registering a shard", "pool")
        return self._register(shard_id, info)

    def _register(self, shard_id: str, info: dict) -> int:
        with self._changed:
            self._dropped.discard(shard_id)
            self.shards[shard_id] = info
            self.version += 1
            self._changed.notify_all()
            return self.version

    def deregister(self, shard_id: str, credential: str = "") -> int:
        self.auth.require(credential, "taking a shard out of the pool")
        with self._changed:
            self._dropped.add(shard_id)  # fenced: it rejoins the index only when registered again
        version = self._deregister(shard_id)
        try:  # its listing goes too, so the next pass cannot adopt it back from the index
            self.purged += self._idx().forget_shard(shard_id)
        except Exception as e:  # noqa: BLE001 - the index is down: _adopt skips dropped shards anyway
            log.warning("controller: dropped shard %s; its index entries stay until the index answers (%s)",
                        shard_id, e)
        return version

    def _deregister(self, shard_id: str) -> int:
        with self._changed:
            if self.shards.pop(shard_id, None) is not None:
                self.version += 1
                self._changed.notify_all()
            return self.version

    def drain(self, shard_id: str, pool: str | None = None, timeout_s: float = 30.0, credential: str = "") -> int:
        """Takes a shard out gracefully: out of the membership first (no spills go there), then its
        index entries are removed and its slabs closed. Its chunks become misses, never errors.
        Operators only."""
        from kvpool.cluster.shard import shard_name

        self.auth.require(credential, "draining a shard")
        self._deregister(shard_id)
        h = ray.get_actor(shard_name(pool or self.pool, shard_id))
        n = ray.get(h.drain.remote(self.auth.pool_credential()), timeout=timeout_s)
        ray.kill(h)
        log.info("controller: drained shard %s (%d index entries)", shard_id, n)
        return n

    def member(self, shard_id: str, incarnation: str = "") -> str:
        """A shard's standing, asked before it rejoins the index: "member" (this incarnation is a
        member), "dropped" (taken out, or another incarnation is: it must stop serving), or
        "unknown" (this controller has not seen it yet: it may rejoin, and is adopted)."""
        with self._changed:
            info = self.shards.get(shard_id)
            if info is not None:
                theirs = info.get("incarnation")
                return "member" if not theirs or theirs == incarnation else "dropped"
            return "dropped" if shard_id in self._dropped else "unknown"

    def state(self) -> dict:
        with self._changed:
            return {"version": self.version, "shards": dict(self.shards), "secured": self.auth.secured}

    def wait(self, version: int, timeout_s: float = 5.0) -> dict:
        """Long poll: returns as soon as the membership's version differs from ``version``."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != version, timeout=timeout_s)
        return self.state()

    def report(self, name: str, figures: dict, credential: str = "") -> None:
        """An engine connector's measured figures (load bandwidth, prefill cost, break-even),
        shown by `kvpool stats`; the latest per connector (``Reports``: kept while it reports, then
        listed silent until its goodbye or a day passes). Only from the pool's own processes (401 without a
        credential, 403 with a tenant's): a shard forwards what an engine reported on its socket,
        the engine's credential verified there and its tenant in ``figures``; the name and the
        figures are checked as the socket checks them (400)."""
        from kvpool.node.messages import WIRE_VERSION, Report

        self.auth.require(credential, "reporting an engine's figures", "pool")
        plain = {k: v for k, v in figures.items() if k != "tenant"} if isinstance(figures, dict) else figures
        Report.decode(WIRE_VERSION, [credential, name, plain])
        self._reports.add(name, figures)

    def reports(self) -> dict:
        return self._reports.live()

    def health(self) -> dict:
        return {"passes": self.passes, "errors": self.errors, "shards": sorted(self.shards),
                "version": self.version, "incarnation": self.incarnation, "purged": self.purged,
                "dropped": sorted(self._dropped), "operator_state": self._operator.seen()}

    # ---------------------------------------------------------------- reconcile loop
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reconcile_once()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                self.errors += 1
                log.exception("controller: reconcile pass failed; will retry")

    def reconcile_once(self) -> list[str]:
        """Drops shards that are dead (index heartbeat lapsed for ``grace_s``, or their node is
        dead) from the membership and purges their index entries. Returns the shards dropped."""
        idx = self._idx()
        try:
            alive = idx.shards()
        except Exception:
            self._lapsed.clear()  # an outage: heartbeats lapse while nobody can write them
            raise
        now = time.monotonic()
        for s in [s for s in self._lapsed if alive.get(s) is not False]:
            del self._lapsed[s]
        for s, live in alive.items():
            if not live:
                self._lapsed.setdefault(s, now)
        dead_nodes = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
        gone = []
        for s, info in list(self.shards.items()):
            # Absent from the index (e.g. Redis restarted empty): the shard re-registers at its next
            # heartbeat, so only a long absence counts as death.
            self._missing[s] = self._missing.get(s, 0) + 1 if s not in alive else 0
            if self._missing[s] > 5 or info.get("node_id") in dead_nodes or self._lapsed_long(s, now):
                gone.append(s)
        for s in gone:
            log.warning("controller: shard %s is dead; removing it from the pool", s)
            self._drop(idx, s)
        for s in [s for s in alive if s not in self.shards and self._lapsed_long(s, now)]:
            self._drop(idx, s)  # listed, not ours, and its heartbeat lapsed long ago
        self._adopt(alive, idx, dead_nodes)
        self._keep_operator_state(idx)
        self.passes += 1
        return gone

    def _lapsed_long(self, s: str, now: float) -> bool:
        since = self._lapsed.get(s)
        return since is not None and now - since >= self.grace_s

    def _drop(self, idx, s: str) -> None:
        self._deregister(s)
        with self._changed:
            self._dropped.add(s)
        self._missing.pop(s, None)
        self._lapsed.pop(s, None)
        self._adopt_failed.pop(s, None)
        n = idx.forget_shard(s)
        self.purged += n
        log.info("controller: purged shard %s from the index (%d entries)", s, n)

    def _keep_operator_state(self, idx) -> None:
        """Remembers the tenants' quotas and priorities; an index without this controller's epoch
        restarted empty (or was flushed): the operator state comes back from memory."""
        if idx.epoch() is not None:
            self._operator.observe(idx.tenants())
            return
        from kvpool.errors import Forbidden

        seen = self._operator.seen()
        for tenant, (quota, priority) in seen.items():
            try:  # NOTE: one a shard re-created first has these values already: nothing is written
                idx.add_tenant(tenant, quota, priority)
            except Forbidden as e:
                log.error("controller: cannot restore tenant %s's quota and priority (%s)", tenant, e)
        if seen:
            log.warning("controller: the index came back empty; restored %d tenants' quotas and priorities",
                        len(seen))
        idx.set_epoch(self.incarnation)

    def _adopt(self, alive: dict[str, bool], idx=None, dead_nodes=frozenset()) -> None:
        """Live shards the index knows and the membership does not: after this controller restarted
        (Ray restarts it empty) its membership comes back from the index within one pass. One it
        cannot reach in ADOPT_TRIES passes, or on a dead node, is purged (a zombie)."""
        from kvpool.cluster.shard import shard_name

        for s, live in alive.items():
            if not live or s in self.shards or s in self._dropped:  # dropped: back only by registering
                continue
            try:
                h = ray.get_actor(shard_name(self.pool, s))
                challenge = uuid.uuid4().hex
                info = ray.get(h.info.remote(challenge), timeout=max(self.interval_s * 5, 5.0))
                if not self.auth.proven(info.get("proof"), "shard", s, str(info.get("incarnation")), challenge):
                    raise RuntimeError("it did not prove it holds the pool secret: not one of the pool's shards")
                if info.get("node_id") in dead_nodes:
                    raise RuntimeError("its node is dead")
            except Exception as e:  # noqa: BLE001 - not reachable now: maybe next pass
                n = self._adopt_failed[s] = self._adopt_failed.get(s, 0) + 1
                log.warning("controller: cannot adopt shard %s yet (%s; try %d of %d)", s, e, n, ADOPT_TRIES)
                if n >= ADOPT_TRIES and idx is not None:
                    self._drop(idx, s)
                continue
            self._adopt_failed.pop(s, None)
            log.info("controller: adopted shard %s from the index", s)
            self._register(s, info)
