from kvpool.bench import datapath


def test_datapath_bench_runs_and_reports_its_baselines():
    r = datapath.run(nodes=2, chunk_mib=1, chunks=2, trials=1, progress=False)
    for k in ("same_node_get_vs_copy", "same_node_put_vs_copy", "cross_node_get_vs_ray",
              "same_node_get_gbps", "cross_node_get_gbps", "raw_ray_gbps"):
        assert r[k] > 0, k
