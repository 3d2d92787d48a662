"""`kvpool bench pool-modes`' pools (connectors/bench/pool_modes.py): the single-node pool and the
pool on a local Ray head, each started, measured and stopped by the real CLI. The vLLM half of the
benchmark runs in docs/benchmarks.md's command; here, what it measures of the pools must hold."""

from __future__ import annotations

import json

from kvpool.connectors.bench.pool_modes import CliPool, format_table


def test_each_mode_starts_reports_and_stops_leaving_nothing():
    figures = {}
    for mode in ("single-node", "ray"):
        pool = CliPool(mode, page_bytes=1 << 20, dram_pages=8, progress=False)
        try:
            pool.start()
            cfg = pool.connector_config(64)
            # vLLM's connector is on the node path unless told otherwise: connect names no backend
            assert cfg.get("backend", "node") == "node" and cfg["run_dir"] == pool.run_dir and cfg["chunk_tokens"] == 64
            assert list(json.load(open(cfg["credentials_file"]))) == ["default"]
        finally:
            pool.close()
        figures[mode] = pool.figures
    one, ray = figures["single-node"], figures["ray"]
    assert one["processes"] == 1 and ray["processes"] > 3, (one, ray)  # the pool's process; a Ray head's many
    what = {p["what"] for p in ray["process_list"]}
    assert {"gcs server", "raylet", "worker ray::ShardActor"} <= what, what  # the head's session and the shard
    assert one["pss_less_slab_mib"] == one["pss_mib"] - 8 and one["rss_mib"] >= 8  # the slab is committed at start
    assert one["stats_mode"] == "single-node" and ray["stats_mode"] == "ray"
    assert one["cpu_s"] >= 0 and ray["cpu_s"] >= 0 and ray["cpu_over_s"] > 0
    assert one["left_running"] == 0 and ray["left_running"] == 0  # `kvpool down` (--stop-ray) stopped it all
    assert 0 < one["pss_mib"] < ray["pss_mib"] and one["up_s"] < ray["up_s"]
    ttft = {"median": 0.02, "min": 0.02, "max": 0.02}
    out = {"context": 512, "repeats": 1, "modes": {m: {**f, "ttft_pool_s": ttft, "ttft_native_s": ttft,
                                                       "ttft_cold_s": ttft, "pool_vs_native": ttft, "valid": True,
                                                       "same_answers": True} for m, f in figures.items()},
           "ray_vs_single_node": {"processes": ray["processes"], "ttft_pool": 1.0}}
    text = format_table(out)
    assert "processes" in text and f"{ray['processes']:>14}" in text
