import json
import subprocess
import sys

import pytest
from conftest import shared_data

from kvpool import BadRequest
from kvpool.bench import concurrency
from kvpool.sim.replay import belady, infinite, replay
from kvpool.sim.run import parse_capacities, parse_policies
from kvpool.sim.trace import load_mooncake
from kvpool.sim.workloads import generate


@pytest.fixture(scope="module")
def mooncake():
    return load_mooncake(shared_data("mooncake", "conversation_trace.jsonl"))


def test_mooncake_trace_loads_whole(mooncake):
    assert len(mooncake) == 12031
    assert sum(len(r.blocks) for r in mooncake) == 288500
    assert infinite(mooncake)["hit_rate"] == pytest.approx(0.3664, abs=5e-4)


def test_lru_and_belady_match_the_published_figures(mooncake):
    for cap, lru_want, belady_want in ((1000, 0.045, 0.191), (4000, 0.086, 0.322), (16000, 0.263, 0.366)):
        assert replay(mooncake, "lru", cap)["hit_rate"] == pytest.approx(lru_want, abs=1e-3)
        assert belady(mooncake, cap)["hit_rate"] == pytest.approx(belady_want, abs=1e-3)


def test_default_policy_meets_its_targets_on_the_conversation_trace(mooncake):
    """Never below LRU; at 4k blocks 1.6x LRU and 44% of Belady (the goal was 50%: docs/eviction.md)."""
    for cap, factor in ((1000, 1.5), (4000, 1.6), (16000, 1.05)):
        lru = replay(mooncake, "lru", cap)["hit_rate"]
        ours = replay(mooncake, "default", cap)["hit_rate"]
        assert ours >= factor * lru, (cap, ours, lru)
        if cap == 4000:
            assert ours >= 0.44 * belady(mooncake, cap)["hit_rate"]


@pytest.mark.parametrize("workload", ["chat", "rag", "agent", "tenants"])
def test_default_policy_never_loses_to_lru_on_generated_workloads(workload):
    trace = generate(workload, n_requests=3000, seed=11)
    for cap in (250, 1000, 4000):
        lru = replay(trace, "lru", cap)["hit_rate"]
        ours = replay(trace, "default", cap)["hit_rate"]
        assert ours >= lru - 1e-9, (workload, cap, ours, lru)


def test_workloads_share_exactly_the_blocks_a_pool_would():
    trace = generate("rag", n_requests=200, seed=2)
    roots = {r.blocks[0] for r in trace}
    assert len(roots) == 1  # every query starts with the shared system prompt's first block
    assert all(r.input_tokens <= 512 * len(r.blocks) < r.input_tokens + 512 for r in trace)
    ten = generate("tenants", n_requests=300, seed=2)
    by_tenant = {}
    for r in ten:
        by_tenant.setdefault(r.tenant, set()).update(r.blocks)
    tenants = list(by_tenant.values())
    assert all(not (a & b) for i, a in enumerate(tenants) for b in tenants[i + 1:])


def test_bad_trace_lines_name_the_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(BadRequest, match=":2: not a Mooncake trace line"):
        load_mooncake(str(p))
    p.write_text('{"timestamp": 0, "input_length": 9000, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(BadRequest, match="does not fit"):
        load_mooncake(str(p))


def test_capacity_and_policy_arguments():
    assert parse_capacities("1k,4000,16_000") == [1000, 4000, 16000]
    with pytest.raises(BadRequest, match="positive"):
        parse_capacities("0")
    with pytest.raises(BadRequest, match="unknown policy"):
        parse_policies("lru,mru")
    assert "tiered-memory" in parse_policies("all")


def test_sim_command_json_and_plot(tmp_path):
    png = tmp_path / "p.png"
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "sim", "--workload", "chat", "--requests", "400", "--capacity",
         "100,400", "--policy", "lru,default", "--json", "--plot", str(png)],
        capture_output=True, text=True, check=True, timeout=300,
    )
    rows = json.loads(out.stdout)
    names = {(r["policy"], r["capacity"]) for r in rows}
    assert names == {(p, c) for p in ("lru", "density", "infinite", "belady") for c in (100, 400)}
    for r in rows:
        assert 0 <= r["hit_rate"] <= 1 and 0 <= r["token_hit_rate"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_command_bad_input_exits_with_a_clear_message():
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "sim", "--workload", "chat", "--capacity", "-3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "positive number of blocks" in r.stderr


def test_concurrency_bench_eviction_sustains_more_than_no_eviction():
    setup = concurrency.Setup(hbm_gib=2.0, horizon_s=240.0, tenants=2)
    result = concurrency.run(setup, ["lru", "tiered-memory"], progress=False, seeds=(0,))
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"reject", "no-cache", "lru", "tiered-memory"}
    assert rows["lru"]["max_concurrency"] > rows["reject"]["max_concurrency"] >= 1
    assert rows["lru"]["vs_no_eviction"] == rows["lru"]["max_concurrency"] / rows["reject"]["max_concurrency"]
    # the lower tiers keep what HBM cannot: more reuse at the same concurrency bound
    assert rows["tiered-memory"]["token_hit_rate"] > rows["lru"]["token_hit_rate"]


def test_merged_blocks_keep_the_chain_and_the_partial_tail():
    from kvpool.sim.trace import SimRequest, merge_blocks

    a = SimRequest(0.0, (1, 2, 3), 1300)
    b = SimRequest(1.0, (1, 2, 4, 5), 2000)
    ma, mb = merge_blocks([a, b], 2)
    assert ma.blocks == (2, 3) and mb.blocks == (2, 5)  # the first 1024 tokens are one shared chunk
    assert (ma.full_blocks, mb.full_blocks) == (1, 1)  # 1300 and 2000 tokens hold one whole 1024-token chunk
    assert ma.block_tokens(1) == 276
    merged = replay(merge_blocks([a, b, a], 2), "lru", 8)
    assert merged["hit_rate"] == (0 + 1 + 2) / (2 + 2 + 2)  # b hits the shared chunk, a's repeat both of its


def test_explain_breaks_the_whole_gap_down_on_every_dimension():
    from kvpool.sim.gap import BINS, explain
    from kvpool.sim.replay import belady_runs

    trace = generate("chat", n_requests=1500, seed=4)
    rows = explain(trace, "lru", 300)
    bel = sum(belady_runs(trace, 300))
    lru = replay(trace, "lru", 300)["hit_rate"] * sum(len(r.blocks) for r in trace)
    for dim in BINS:
        rs = [r for r in rows if r["dimension"] == dim]
        assert [r["bin"] for r in rs] == list(BINS[dim])
        assert sum(r["belady_hits"] for r in rs) == bel
        assert sum(r["policy_hits"] for r in rs) == pytest.approx(lru)
        assert sum(r["share_of_gap"] for r in rs) == pytest.approx(1.0)
    gap = sum(r["gap_blocks"] for r in rows if r["dimension"] == "turn")
    assert gap > 0.1 * bel  # LRU at 300 blocks leaves much on the table
    turn0 = next(r for r in rows if r["dimension"] == "turn" and r["bin"] == "0 (new)")
    assert turn0["gap_blocks"] < 0.2 * gap  # the system prompt is shared: new conversations cost little


def test_policy_params_reach_the_policies_that_take_them():
    from kvpool.sim.run import parse_params, simulate

    trace = generate("chat", n_requests=600, seed=3)
    rows = simulate(trace, "t", ["density", "lru"], [150], progress=False, with_belady=False, workers=1,
                    params=parse_params(["margin=0"]))
    by = {r["policy"]: r for r in rows}
    assert by["density"]["params"] == {"margin": 0.0} and "params" not in by["lru"]
    with pytest.raises(BadRequest, match="no policy of this run takes it"):
        simulate(trace, "t", ["lru"], [150], progress=False, with_belady=False, workers=1, params={"margin": 0.0})
    with pytest.raises(BadRequest, match="NAME=NUMBER"):
        parse_params(["margin"])
