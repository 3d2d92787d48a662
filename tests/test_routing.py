"""Prefix-aware routing (kvpool/routing.py) and its cluster simulator (kvpool/sim/cluster.py)."""

import json
import subprocess
import sys

import pytest
from conftest import shared_data

from kvpool import BadRequest
from kvpool.routing import POLICIES, CostModel, Instance, Router, tiers
from kvpool.sim.cluster import Shape, simulate
from kvpool.sim.routes import parse_instances, run
from kvpool.sim.trace import load_mooncake
from kvpool.sim.workloads import generate

COST = CostModel(prefill_s=1e-4, node_s=1e-5, remote_s=5e-5)


def test_each_chunk_is_counted_in_the_cheapest_tier_holding_it_and_a_miss_ends_the_chain():
    pool = {0: "n0", 1: "n1", 2: None, 3: "n0"}  # chunk 3 is in the pool, but its parent is not
    t = tiers([512, 512, 512, 100], lambda j: j == 1, pool.get, "n0")
    assert t == {"gpu": 512, "node": 512, "remote": 0, "miss": 612}
    assert tiers([512, 512], lambda j: False, pool.get, "n1") == {"gpu": 0, "node": 512, "remote": 512, "miss": 0}
    assert COST.seconds(t) == pytest.approx(512 * 1e-5 + 612 * 1e-4)


def test_each_policy_picks_what_it_should():
    instances = [Instance("a", "n0", backlog_s=0.5), Instance("b", "n0"), Instance("c", "n1")]
    on_node = {"gpu": 0, "node": 4096, "remote": 0, "miss": 0}
    remote = {"gpu": 0, "node": 0, "remote": 4096, "miss": 0}
    cold = {"gpu": 0, "node": 0, "remote": 0, "miss": 4096}
    in_gpu = {"gpu": 4096, "node": 0, "remote": 0, "miss": 0}
    rr = Router("round-robin", COST)
    assert [rr.choose(instances, [cold] * 3) for _ in range(4)] == [0, 1, 2, 0]
    least = Router("least-loaded", COST)
    assert least.choose(instances, [in_gpu, cold, cold]) == 1
    assert [least.choose(instances[1:], [cold] * 2) for _ in range(4)] == [1, 0, 1, 0]  # idle ones in turn
    # the prefix on b's node shard, and in c's GPU cache: only the tier-aware router sees the shard
    assert Router("tier-aware", COST).choose(instances, [in_gpu, on_node, remote]) == 1  # a's queue costs more
    assert Router("gpu-prefix", COST).choose(instances, [cold, on_node, in_gpu]) == 2
    assert Router("tier-aware", COST).choose(instances[1:], [on_node, remote]) == 0  # the node's shard beats the network
    assert Router("gpu-prefix", COST).choose(instances[1:], [on_node, remote]) == 0  # blind to both: a tie, the first


def test_a_prefix_router_passes_over_an_instance_that_took_more_than_its_share():
    router = Router("tier-aware", COST, balance=1.25)
    instances = [Instance("a", "n0"), Instance("b", "n0")]
    hot = [{"gpu": 4096, "node": 0, "remote": 0, "miss": 512}, {"gpu": 0, "node": 0, "remote": 0, "miss": 4608}]
    picks = [router.choose(instances, hot) for _ in range(20)]
    assert picks[0] == 0 and 1 in picks  # the GPU hit first, but not every time: a's share went past the bound
    assert picks.count(0) > picks.count(1)


def test_bad_settings_name_the_fix():
    with pytest.raises(BadRequest, match="choose one of"):
        Router("random", COST)
    with pytest.raises(BadRequest, match="never negative"):
        CostModel(prefill_s=-1, node_s=0, remote_s=0)
    with pytest.raises(BadRequest, match="comma-separated"):
        parse_instances("eight")
    with pytest.raises(BadRequest, match="at least 1"):
        Shape(0)


@pytest.fixture(scope="module")
def mooncake():
    return load_mooncake(shared_data("mooncake", "conversation_trace.jsonl"))


def test_at_32_instances_the_tier_aware_router_is_fastest_and_most_local_and_balanced(mooncake):
    rows = {r["policy"]: r for r in run(mooncake, "mooncake", [32], progress=False)}
    ours = rows["tier-aware"]
    for other in set(POLICIES) - {"tier-aware"}:
        assert ours["mean_ttft_s"] < rows[other]["mean_ttft_s"], (other, ours, rows[other])
    assert ours["local_share"] > rows["gpu-prefix"]["local_share"]  # own GPU cache + node shard
    assert ours["max_load_vs_mean"] <= 1.5
    assert rows["round-robin"]["cached_share"] == pytest.approx(ours["cached_share"], abs=0.02)  # the pool serves any
    assert all(abs(sum(r[f"{k}_share"] for k in ("gpu", "node", "remote", "miss")) - 1) < 1e-9 for r in rows.values())


def test_the_simulation_is_deterministic_and_tenants_share_nothing():
    reqs = generate("tenants", n_requests=600, seed=3)
    a = simulate(reqs, "tier-aware", Shape(8, gpu_blocks=50, node_blocks=200))
    assert a == simulate(reqs, "tier-aware", Shape(8, gpu_blocks=50, node_blocks=200))
    roots = {r.tenant: r.blocks[0] for r in reqs if r.blocks}  # every tenant's chain starts at its own root
    assert len(set(roots.values())) == len(roots) > 1


def test_cli_routes_a_trace_and_prints_only_json():
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "sim", "--workload", "chat", "--requests", "400",
                        "--instances", "4,8", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["instances"], x["policy"]) for x in rows] == [(n, p) for n in (4, 8) for p in POLICIES]
