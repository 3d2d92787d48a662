from kvpool.bench import datapath


def test_datapath_bench_runs_and_reports_its_baselines():
    r = datapath.run(nodes=2, chunk_mib=1, chunks=2, trials=1, progress=False)
    for k in ("same_node_get_vs_copy", "same_node_put_vs_copy", "cross_node_get_vs_ray",
              "same_node_get_gbps", "cross_node_get_gbps", "raw_ray_gbps"):
        assert r[k] > 0, k


def test_aggregate_bench_grows_the_cluster_and_moves_every_byte():
    rows = datapath.run_aggregate(max_nodes=2, chunk_mib=1, chunks=2, rounds=1, progress=False)
    assert [r["nodes"] for r in rows] == [1, 2]
    # every client put and got back its chunks (verified inside): 2 chunks x 2 directions each
    assert [r["bytes"] for r in rows] == [4 << 20, 8 << 20]
    assert all(r["gbps"] > 0 for r in rows)
