"""The shard actor: a shard (cluster/shard_core.py) hosted by Ray, one per node of the pool.

The Ray actor is the control plane only: the shard's data operations go through its node's
socket and peer port (cluster/node_server.py); Ray gives it the embedded index's actor (when the
pool has no Redis), the controller (membership, engines' reports, whether a forgotten shard was
dropped), its node's id and address, and the Ray dashboard's metrics.
"""

from __future__ import annotations

import ray

from kvpool.cluster.members import Members
from kvpool.cluster.shard_core import Shard, tenants_to_register
from kvpool.cluster.shard_drills import DRILLS_ENV, Drills
from kvpool.index import open_index

__all__ = ["DRILLS_ENV", "ShardActor", "shard_name", "tenants_to_register"]


def shard_name(pool: str, shard_id: str) -> str:
    return f"kvpool-shard-{pool}-{shard_id}"


@ray.remote(num_cpus=0, max_concurrency=8)
class ShardActor(Shard, Drills):
    def __init__(self, shard_id: str, pool: str, store: dict, tenants: list[dict], index_url: str | None,
                 ttl_s: float = 5.0, request_ttl_s: float = 600.0) -> None:
        from kvpool.auth import Authority

        if index_url:
            index = open_index(index_url)
        else:
            from kvpool.cluster.index_actor import ActorIndex

            index = ActorIndex(credential=Authority.from_env().pool_credential())
        self.exporter = None
        super().__init__(shard_id, pool, store, tenants, index, Members(pool, shard_id, ray.get_runtime_context().namespace),
                         node_id=ray.get_runtime_context().get_node_id(), host=ray.util.get_node_ip_address(),
                         ttl_s=ttl_s, request_ttl_s=request_ttl_s, standing=self._controller_standing,
                         export=self.export_metrics)

    def _controller_standing(self, incarnation: str) -> str:
        from kvpool.cluster.controller import CONTROLLER

        ctl = ray.get_actor(CONTROLLER)
        return ray.get(ctl.member.remote(self.shard_id, incarnation), timeout=max(self.ttl_s, 2.0))

    def pool_stats(self, timeout_s: float = 5.0) -> dict:
        """Every member shard's stats (asked in parallel), the controller's engine reports and the
        health verdicts: what `kvpool stats` prints, gathered inside the cluster."""
        from kvpool.cluster.controller import CONTROLLER
        from kvpool.cluster.pool_stats import summarize

        state = ray.get(ray.get_actor(CONTROLLER).state.remote(), timeout=timeout_s)
        refs, shards = {}, {}
        for sid in state["shards"]:
            if sid == self.shard_id:
                continue
            try:
                refs[sid] = ray.get_actor(shard_name(self.pool, sid)).stats.remote()
            except Exception as e:  # noqa: BLE001 - a dead shard is reported, not fatal
                shards[sid] = {"error": f"{type(e).__name__}: {e}"}
        for sid in state["shards"]:
            if sid == self.shard_id:
                shards[sid] = self.stats()
            elif sid in refs:
                try:
                    shards[sid] = ray.get(refs[sid], timeout=timeout_s)
                except Exception as e:  # noqa: BLE001
                    shards[sid] = {"error": f"{type(e).__name__}: {e}"}
        try:
            engines = self.members.engines(timeout_s)
        except Exception:  # noqa: BLE001 - the controller is restarting: shards still shown
            engines = {}
        return summarize(state["version"], shards, engines, "ray")

    def export_metrics(self) -> None:
        """The store's counters to the Ray dashboard (each heartbeat; the gauges refreshed first)."""
        self.store.stats()
        if self.exporter is None and getattr(self, "service", None) is not None:
            from kvpool.cluster.metrics import RayExporter

            self.exporter = RayExporter(self.store.metrics, self.shard_id)
            self.service.observe_get = lambda ms: self.exporter.observe_get(ms, "node")
        if self.exporter is not None:
            self.exporter.export()
