import json
import math

import pytest

from kvpool.cluster.bench import datapath

# What `kvpool bench datapath --json` promises (docs/benchmarks.md): the three ratios and the GB/s
# of each path, beside the run's shape.
RATIOS = {  # ratio -> (figure, its baseline)
    "same_node_get_vs_copy": ("same_node_get_gbps", "copy_gbps"),
    "same_node_put_vs_copy": ("same_node_put_gbps", "copy_gbps"),
    "cross_node_get_vs_ray": ("cross_node_get_gbps", "raw_ray_gbps"),
    "cross_node_get_vs_copy": ("cross_node_get_gbps", "copy_gbps"),
}
GBPS = {"copy_gbps", "same_node_put_gbps", "same_node_get_gbps", "cross_node_put_gbps", "cross_node_get_gbps",
        "raw_ray_gbps"}


def test_datapath_bench_runs_and_reports_its_baselines():
    r = datapath.run(nodes=2, chunk_mib=1, chunks=2, trials=1, progress=False)
    assert set(r) == {"nodes", "chunk_bytes", "chunks", "trials"} | GBPS | set(RATIOS)
    assert (r["nodes"], r["chunk_bytes"], r["chunks"], r["trials"]) == (2, 1 << 20, 2, 1)
    assert json.loads(json.dumps(r)) == r  # the --json output, as is
    for k in GBPS | set(RATIOS):
        assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] > 0, (k, r[k])
    # Each ratio is the path's time against its baseline's in the same trial: with one trial (the
    # same bytes moved by both), the quotient of their GB/s.
    for k, (figure, baseline) in RATIOS.items():
        assert r[k] == pytest.approx(r[figure] / r[baseline], rel=1e-9), k
    table = datapath.format_table(r)
    assert f"{r['same_node_get_gbps']:.2f}" in table and f"{r['cross_node_get_vs_ray']:.2f}" in table
    assert "raw Ray transfer between raylets" in table  # 2 nodes: the cross-node rows are there


def test_aggregate_bench_grows_the_cluster_and_moves_every_byte():
    rows = datapath.run_aggregate(max_nodes=2, chunk_mib=1, chunks=2, rounds=1, progress=False)
    assert [r["nodes"] for r in rows] == [1, 2]
    assert [r["clients"] for r in rows] == [1, 2]  # one client per node
    # every client put and got back its chunks (verified inside): 2 chunks x 2 directions each
    assert [r["bytes"] for r in rows] == [4 << 20, 8 << 20]
    assert all(r["gbps"] > 0 for r in rows)
    for r in rows:  # the figure is the bytes over the wall time it reports
        assert r["seconds"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9, rel=1e-9)
    assert len(datapath.format_aggregate(rows).splitlines()) == 1 + len(rows)
