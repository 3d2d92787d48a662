"""kvpool's connector figures in vLLM's own metrics: its connector stats (the "KV Transfer metrics"
log line) and Prometheus series on the server's ``/metrics``, beside vLLM's:

- ``kvpool:lookups_total``: requests the connector looked up in the pool (each once, at admission),
  of which ``kvpool:misses_total`` found nothing in the pool beyond vLLM's own cache (a pool that
  did not answer included) and ``kvpool:declined_total`` found chunks the break-even said to
  recompute; the rest were loads planned;
- ``kvpool:loads_total``: loads that brought tokens vLLM kept (the pool's hits, not the loads
  planned);
- ``kvpool:loaded_tokens_total``: those tokens. vLLM's own
  ``vllm:prompt_tokens_cached_by_source_total{source="host"}`` counts the tokens planned at
  admission, failed loads included; this one only what landed;
- ``kvpool:load_failures_total{cause}``: loads that fell short, by cause (``missing``: the pool
  returned fewer chunks than the lookup listed: evicted since, or failing a checksum inside the
  pool; ``checksum``: a chunk read in place from the node's memory did not verify; ``timeout``:
  the pool did not answer in time; ``unavailable``: it did not answer; ``unauthorized``; else the
  error's type), and ``kvpool:failed_tokens_total``: their tokens, recomputed;
- ``kvpool:load_seconds``: a histogram of the time of each load in ``loads_total`` (read,
  verify, copy into vLLM's blocks; the slowest rank's);
- ``kvpool:degraded``: 1 while the pool does not answer (a connector started ``degraded``).

Each series carries vLLM's own labels (``model_name``, ``engine``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

LOAD_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
FAILURE = "failed_by_"  # a worker counter's prefix: loads that fell short, by cause
COUNTERS = (("lookups", "requests kvpool's connector looked up in the pool"),
            ("misses", "lookups that found nothing in the pool to load"),
            ("declined", "lookups whose hit the break-even declined (recomputed)"),
            ("loads", "loads from the pool that brought tokens vLLM kept"),
            ("loaded_tokens", "tokens loaded from the pool (only loads that landed)"),
            ("failed_tokens", "tokens of loads that fell short, recomputed"))


class PoolXferStats(KVConnectorStats):
    """kvpool's figures in vLLM's connector stats: counts summed, lists joined, ``degraded`` the worst seen."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if k == "degraded":
                self.data[k] = max(self.data.get(k, 0), v)
            else:
                self.data[k] = self.data.get(k, [] if isinstance(v, list) else 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: (len(v) if isinstance(v, list) else v) for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


class PoolPromMetrics(KVConnectorPromMetrics):
    """The series of the module docstring, one child per vLLM engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, gauge, hist = self._counter_cls, self._gauge_cls, self._histogram_cls
        self._counters = {k: counter(name=f"kvpool:{k}_total", documentation=doc, labelnames=labelnames)
                          for k, doc in COUNTERS}
        self._failures = counter(name="kvpool:load_failures_total", labelnames=[*labelnames, "cause"],
                                 documentation="loads from the pool that fell short, by cause")
        self._seconds = hist(name="kvpool:load_seconds", documentation="time of one load from the pool",
                             labelnames=labelnames, buckets=LOAD_BUCKETS_S)
        self._degraded = gauge(name="kvpool:degraded", documentation="1 while the pool does not answer",
                               labelnames=labelnames, multiprocess_mode="mostrecent")
        for labels in per_engine_labelvalues.values():  # 0 from the start: a rate over a fresh server works
            for c in self._counters.values():
                c.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        data = transfer_stats_data or {}
        for k, c in self._counters.items():
            if data.get(k):
                c.labels(*labels).inc(data[k])
        for k, v in data.items():
            if k.startswith(FAILURE) and v:
                self._failures.labels(*labels, k[len(FAILURE):]).inc(v)
        for s in data.get("load_seconds") or []:
            self._seconds.labels(*labels).observe(s)
        self._degraded.labels(*labels).set(1 if data.get("degraded") else 0)


class ConnectorMetrics:
    """The vLLM connector's side of vLLM's metrics: its figures since vLLM last asked (``_xfer``,
    filled by the scheduler's half), the stats class vLLM rebuilds them with, and the series above."""

    _xfer: dict[str, Any]

    def _xfer_add(self, name: str, n: int = 1) -> None:
        self._xfer[name] = self._xfer.get(name, 0) + n

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM's connector stats since it last asked ("KV Transfer metrics"); ``degraded``: 1 while down."""
        data, self._xfer = self._xfer, {}
        if getattr(self, "tenancy", None) is not None and not self.health.up():
            data["degraded"] = 1
        return PoolXferStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PoolXferStats(dict(data or {}))  # vLLM's logger rebuilds the stats from their dict

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> PoolPromMetrics:
        return PoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # kvpool:* on /metrics


def cause_of(e: BaseException | None) -> str:
    """Why a load fell short: ``missing`` (no error: the pool had fewer chunks), else the error's kind
    (a socket's timeout is wrapped in Unavailable: its context says so)."""
    from kvpool.errors import Unauthorized, Unavailable
    from kvpool.node.inplace import ChunkChanged
    from kvpool.node.wire import Timeout

    if e is None:
        return "missing"
    if isinstance(e, ChunkChanged):
        return "checksum"
    if isinstance(e, (Timeout, TimeoutError)) or isinstance(e.__cause__ or e.__context__, TimeoutError):
        return "timeout"
    if isinstance(e, Unavailable):
        return "unavailable"
    if isinstance(e, Unauthorized):
        return "unauthorized"
    return type(e).__name__.lower()
