"""Exports a store's metrics (kvpool.metrics) through ``ray.util.metrics``, so they show in the
Ray dashboard's metrics view and on every node's Prometheus endpoint as ``ray_kvpool_*``.

The store keeps its own counters (cheap, on the hot path); the shard copies them out every
heartbeat: counters by their increase since the last export, gauges by value. Every series is
tagged with the shard, plus the metric's own labels (tier, tenant).
"""

from __future__ import annotations

from ray.util import metrics as ray_metrics

from kvpool.metrics import Metrics

GET_LATENCY_BUCKETS_MS = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000]


class RayExporter:
    def __init__(self, metrics: Metrics, shard: str) -> None:
        self.metrics = metrics
        self.shard = shard
        self._out: dict[str, object] = {}
        self._last: dict[tuple[str, tuple], float] = {}
        for m in metrics:
            tags = ("shard", *m.labels)
            cls = ray_metrics.Counter if m.kind == "counter" else ray_metrics.Gauge
            self._out[m.name] = cls(f"kvpool_{m.name}", description=m.help, tag_keys=tags)
        self.get_latency = ray_metrics.Histogram(
            "kvpool_get_latency_ms", description="time a shard takes to serve a get or a read lease",
            boundaries=GET_LATENCY_BUCKETS_MS, tag_keys=("shard", "transport"))

    def export(self) -> None:
        for m in self.metrics:
            out = self._out[m.name]
            for labels, value in list(m.values.items()):
                tags = {"shard": self.shard, **dict(zip(m.labels, labels))}
                if m.kind == "counter":
                    delta = value - self._last.get((m.name, labels), 0)
                    if delta > 0:
                        out.inc(delta, tags=tags)
                    self._last[(m.name, labels)] = value
                else:
                    out.set(value, tags=tags)

    def observe_get(self, ms: float, transport: str) -> None:
        self.get_latency.observe(ms, tags={"shard": self.shard, "transport": transport})
