"""The pool in the Ray dashboard: local Ray started with its dashboard, traffic from two tenants,
and kvpool's metrics on the node's Prometheus endpoint with their labels (shard, tier, tenant);
the dashboard's state API lists the pool's actors."""

from __future__ import annotations

import pytest
import ray
from conftest import free_port, make_keys, payload, scrape_metrics, wait_for

PAGE = 4096


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from kvpool.cluster.bootstrap import down, shard_id_of, up
    from kvpool.node.client import NodeClient
    from kvpool.node.paths import own_run_dir

    with own_run_dir(str(tmp_path_factory.mktemp("run"))) as run:  # before ray.init: the shard inherits it
        ray.init(num_cpus=2, include_dashboard=True, dashboard_port=free_port(), namespace="kvpool-obs",
                 _system_config={"metrics_report_interval_ms": 1000}, logging_level="ERROR")
        try:
            up(store={"page_bytes": PAGE, "dram_pages": 32}, tenants=[{"id": "a"}, {"id": "b"}],
               namespace="kvpool-obs", ttl_s=1.5)
            client = NodeClient(shard=shard_id_of(ray.get_runtime_context().get_node_id()), directory=run,
                                timeout_s=5.0)
            yield client
            client.close()
            down(namespace="kvpool-obs")
        finally:
            ray.shutdown()


def series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_kvpool_metrics_reach_the_endpoint_with_shard_tier_and_tenant_labels(pool):
    for tenant, seed in (("a", 1), ("b", 2)):
        keys = make_keys(12, seed=seed)
        assert pool.put(tenant, keys, [payload(i, PAGE) for i in range(12)]) == 12
        assert len(pool.get(tenant, keys)) == 12  # from shared memory: the shard hears of them as touches
    pool.touches.flush()
    # 40 more chunks than the 32 pages hold: evictions
    flood = make_keys(40, seed=3)
    pool.put("b", flood, [payload(i, PAGE) for i in range(40)])
    text = scrape_metrics(["ray_kvpool_hits_chunks_total", "ray_kvpool_evictions_total", "ray_kvpool_tenant_bytes",
                   'tenant="b"'])
    hits = series(text, "ray_kvpool_hits_chunks_total")
    assert any('tenant="a"' in s for s in hits) and any('tenant="b"' in s for s in hits)
    assert all('shard="node-' in s for s in hits)
    assert any('tier="dram"' in s for s in series(text, "ray_kvpool_evictions_total"))
    assert any('tenant="a"' in s for s in series(text, "ray_kvpool_tenant_bytes"))
    assert any('tier="dram"' in s for s in series(text, "ray_kvpool_bytes"))


def test_the_dashboard_lists_the_pool_actors(pool):
    from ray.util.state import list_actors

    address = ray.get_runtime_context().gcs_address  # this test's Ray, whatever else runs here
    names = {a.name for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], timeout=30)}
    assert any(n.startswith("kvpool-shard-default-node-") for n in names)
    assert "kvpool-controller" in names


def test_connectors_report_their_break_even_to_kvpool_stats(pool):
    import torch

    from kvpool.cluster.controller import CONTROLLER
    from kvpool.cluster.stats_view import format_stats
    from kvpool.connectors.hf import HFConnector
    from kvpool.connectors.hf_model import model_spec, tiny_llama
    from kvpool.errors import LayoutMismatch
    from kvpool.node.pool import NodePool
    from kvpool.tenants import Tenant

    with pytest.raises(LayoutMismatch, match=r"kvpool up --model MODEL --dtype float32.*kvpool up --page-size 65536"):  # 64 KiB chunks, 4 KiB pages
        NodePool(model_spec(tiny_llama(0), model_id="obs/big", chunk_tokens=32), pool, [Tenant("a")])
    model = tiny_llama(0, layers=1, hidden=64, heads=2, kv_heads=1)
    spec = model_spec(model, model_id="obs/tiny", chunk_tokens=16)
    assert spec.chunk_nbytes == PAGE
    conn = HFConnector(model, NodePool(spec, pool, [Tenant("a")]), tenant="a")
    ids = torch.randint(0, 1024, (1, 4 * 16 + 1), generator=torch.Generator().manual_seed(0))
    assert conn.prefill(ids).saved_chunks == 4  # computes and saves
    assert conn.prefill(ids).loaded_tokens == 4 * 16  # loads: both sides are measured now
    conn.breakeven.maybe_report(conn.pool, "transformers obs", spec.chunk_nbytes // 16, every_s=0)
    controller = ray.get_actor(CONTROLLER, namespace="kvpool-obs")
    wait_for(lambda: "transformers obs" in ray.get(controller.reports.remote()), 10,
             what="the controller to hold the engine's report")  # the report is fire and forget
    figures = ray.get(controller.reports.remote())["transformers obs"]
    assert figures["load_gbps"] > 0 and figures["prefill_ms_per_token"] > 0 and figures["loads"] >= 1
    assert figures["load_advantage"] > 1  # loading a token of this model beats computing it
    text = format_stats({"version": 1, "shards": {}, "engines": {"transformers obs": figures}})
    assert "\n  transformers obs" in text and "cheaper than computing it" in text
