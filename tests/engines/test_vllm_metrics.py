"""The connector's own Prometheus series (connectors/vllm_metrics.py), built as vLLM builds them
(``build_prom_metrics`` with prometheus_client's classes) and fed what the scheduler's connector
stats carry; the same series through a real server are checked by tests/engines/test_quickstart.py."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import need_engines

need_engines("vllm")

from functools import partial  # noqa: E402

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvpool.connectors.vllm import KVPoolConnector  # noqa: E402
from kvpool.connectors.vllm_metrics import FAILURE, PoolXferStats, cause_of  # noqa: E402
from kvpool.errors import Unauthorized, Unavailable  # noqa: E402


def test_failures_by_cause_loads_and_their_times_reach_prometheus():
    # a registry of its own: an engine test before this one in the process registered the series already
    registry = CollectorRegistry()
    prom = KVPoolConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),
                                              {Counter: partial(Counter, registry=registry),
                                               Gauge: partial(Gauge, registry=registry),
                                               Histogram: partial(Histogram, registry=registry)},
                                              ["model_name", "engine"], {0: ["m", "0"]})
    got = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})  # noqa: E731
    assert got("kvpool:loads_total") == 0 and got("kvpool:misses_total") == 0  # there from the start, at 0
    # two steps' stats, aggregated as vLLM aggregates them: counts summed, load times joined
    a = PoolXferStats({"lookups": 2, "misses": 1, "loads": 1, "loaded_tokens": 512, "load_seconds": [0.004]})
    b = PoolXferStats({"lookups": 1, "declined": 1, "load_failures": 1, "failed_tokens": 256, FAILURE + cause_of(None): 1,
                       FAILURE + cause_of(Unavailable("x")): 0, "degraded": 0})
    data = a.aggregate(b).to_dict()
    assert a.reduce()["load_seconds"] == 1  # the log line shows how many
    prom.observe(data, 0)
    prom.observe({"loads": 1, "loaded_tokens": 256, "load_seconds": [0.02], FAILURE + "unauthorized": 1}, 0)
    assert got("kvpool:lookups_total") == 3 and got("kvpool:misses_total") == 1 and got("kvpool:declined_total") == 1
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
    import socket

    from kvpool.node.inplace import ChunkChanged
    from kvpool.node.wire import Timeout

    assert cause_of(None) == "missing" and cause_of(Unavailable("slow")) == "unavailable"
    assert cause_of(ChunkChanged("changed")) == "checksum"  # a chunk read in place that did not verify
    assert cause_of(TimeoutError()) == "timeout" and cause_of(Timeout("deadline")) == "timeout"
    try:  # the node client wraps a socket's timeout in Unavailable (from None): still a timeout
        try:
            raise socket.timeout("timed out")
        except OSError:
            raise Unavailable("the node's shard did not answer get (TimeoutError)") from None
    except Unavailable as e:
        assert cause_of(e) == "timeout"
    assert cause_of(Unauthorized("no")) == "unauthorized" and cause_of(ValueError("x")) == "valueerror"
