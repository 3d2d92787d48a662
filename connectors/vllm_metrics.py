"""kvpool's connector figures in vLLM's own metrics: its connector stats (the "KV Transfer metrics"
log line) and Prometheus series on the server's ``/metrics``, beside vLLM's:

- ``kvpool:lookups_total``: requests the connector looked up in the pool (each once, at admission);
- ``kvpool:loads_total``: loads that brought at least one chunk (hits that happened, not planned);
- ``kvpool:loaded_tokens_total``: tokens loaded from the pool (vLLM's own
  ``vllm:prompt_tokens_cached_by_source_total{source="host"}`` counts the tokens planned at
  admission, failed loads included; this one only what landed);
- ``kvpool:load_failures_total{cause}``: loads that fell short, by cause (``missing``: the pool
  returned fewer chunks than looked up: evicted since, or a checksum that failed; ``unavailable``:
  the pool did not answer in time; ``unauthorized``; else the error's type), and
  ``kvpool:failed_tokens_total``: their tokens, recomputed;
- ``kvpool:load_seconds``: a histogram of each load's time (read, verify, copy into vLLM's blocks);
- ``kvpool:degraded``: 1 while the pool does not answer (a connector started ``degraded``).

Each series carries vLLM's own labels (``model_name``, ``engine``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

LOAD_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
FAILURE = "failed_by_"  # a worker counter's prefix: loads that fell short, by cause


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
                          for k, doc in (("lookups", "requests kvpool's connector looked up in the pool"),
                                         ("loads", "loads from the pool that brought at least one chunk"),
                                         ("loaded_tokens", "tokens loaded from the pool (only loads that landed)"),
                                         ("failed_tokens", "tokens of failed loads, recomputed"))}
        self._failures = counter(name="kvpool:load_failures_total", labelnames=[*labelnames, "cause"],
                                 documentation="loads from the pool that fell short, by cause")
        self._seconds = hist(name="kvpool:load_seconds", documentation="time of one load from the pool",
                             labelnames=labelnames, buckets=LOAD_BUCKETS_S)
        self._degraded = gauge(name="kvpool:degraded", documentation="1 while the pool does not answer",
                               labelnames=labelnames, multiprocess_mode="mostrecent")

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


def cause_of(e: BaseException | None) -> str:
    """Why a load fell short: ``missing`` (no error: the pool had fewer chunks), else the error's kind."""
    from kvpool.errors import Unauthorized, Unavailable

    if e is None:
        return "missing"
    if isinstance(e, Unavailable) or isinstance(e, TimeoutError):
        return "unavailable"
    if isinstance(e, Unauthorized):
        return "unauthorized"
    return type(e).__name__.lower()
