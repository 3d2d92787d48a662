"""``kvpool bench placement`` on Mooncake's published trace: the pool's rule (locality + spill)
against the hash ring, same requests, same capacity."""

import json
import subprocess
import sys

import pytest
from conftest import shared_data

from kvpool.cluster.bench import placement


@pytest.fixture(scope="module")
def result():
    return placement.run(shared_data("mooncake", "conversation_trace.jsonl"), nodes=4, capacity=2048, limit=4000)


def test_every_rule_and_router_is_measured_within_range(result):
    assert set(result["rows"]) == {f"{r} / {t}" for r in placement.RULES for t in placement.ROUTERS}
    for v in result["rows"].values():
        assert set(v) == {"hit_rate", "locality", "balance", "lost_share", "hit_rate_after_loss"}
        assert 0 < v["hit_rate"] < 1 and 0 <= v["locality"] <= 1 and v["balance"] >= 1
        assert 0 <= v["hit_rate_after_loss"] < 1


def test_the_ring_reads_about_one_in_n_locally_and_locality_far_more_with_a_prefix_router(result):
    rows = result["rows"]
    for router in placement.ROUTERS:
        assert abs(rows[f"ring / {router}"]["locality"] - 1 / 4) < 0.1  # its owner is anywhere
    assert rows["locality / prefix"]["locality"] > 0.7  # written where its conversation's engine runs
    assert rows["locality / prefix"]["locality"] > rows["ring / prefix"]["locality"] + 0.4


def test_a_node_loss_takes_its_share_under_either_rule(result):
    for v in result["rows"].values():
        assert abs(v["lost_share"] - 1 / 4) < 0.05


def test_the_replay_is_deterministic_and_the_cli_prints_it(result):
    trace = shared_data("mooncake", "conversation_trace.jsonl")
    assert placement.run(trace, nodes=4, capacity=2048, limit=4000) == result
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "placement", "--trace", trace, "--nodes", "3",
                        "--capacity", "512", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["nodes"] == 3 and out["requests"] == 12031
    bad = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "placement", "--nodes", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--nodes" in bad.stderr
