"""The connector's own Prometheus series (connectors/vllm_metrics.py), built as vLLM builds them
(``build_prom_metrics`` with prometheus_client's classes) and fed what the scheduler's connector
stats carry; the same series through a real server are checked by tests/engines/test_quickstart.py."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import need_engines

need_engines("vllm")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram  # noqa: E402

from kvpool.connectors.vllm import KVPoolConnector  # noqa: E402
from kvpool.connectors.vllm_metrics import FAILURE, PoolXferStats, cause_of  # noqa: E402
from kvpool.errors import Unauthorized, Unavailable  # noqa: E402


def test_failures_by_cause_loads_and_their_times_reach_prometheus():
    prom = KVPoolConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),
                                              {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                                              ["model_name", "engine"], {0: ["m", "0"]})
    # two steps' stats, aggregated as vLLM aggregates them: counts summed, load times joined
    a = PoolXferStats({"lookups": 2, "loads": 1, "loaded_tokens": 512, "load_seconds": [0.004]})
    b = PoolXferStats({"lookups": 1, "load_failures": 1, "failed_tokens": 256, FAILURE + cause_of(None): 1,
                       FAILURE + cause_of(Unavailable("x")): 0, "degraded": 0})
    data = a.aggregate(b).to_dict()
    assert a.reduce()["load_seconds"] == 1  # the log line shows how many
    prom.observe(data, 0)
    prom.observe({"loads": 1, "loaded_tokens": 256, "load_seconds": [0.02], FAILURE + "unauthorized": 1}, 0)
    got = lambda name, **labels: REGISTRY.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})  # noqa: E731
    assert got("kvpool:lookups_total") == 3 and got("kvpool:loads_total") == 2
    assert got("kvpool:loaded_tokens_total") == 768 and got("kvpool:failed_tokens_total") == 256
    assert got("kvpool:load_failures_total", cause="missing") == 1
    assert got("kvpool:load_failures_total", cause="unauthorized") == 1
    assert got("kvpool:load_failures_total", cause="unavailable") is None  # never counted
    assert got("kvpool:load_seconds_count") == 2 and abs(got("kvpool:load_seconds_sum") - 0.024) < 1e-9
    assert got("kvpool:degraded") == 0
    prom.observe({"degraded": 1}, 0)
    assert got("kvpool:degraded") == 1


def test_causes():
    assert cause_of(None) == "missing" and cause_of(Unavailable("slow")) == "unavailable"
    assert cause_of(TimeoutError()) == "unavailable" and cause_of(Unauthorized("no")) == "unauthorized"
    assert cause_of(ValueError("x")) == "valueerror"
