"""``kvpool bench datapath`` (the node data path of issue 17) through the CLI, tiny: a 2-node pool,
two engine worker processes without Ray, every read checked byte for byte."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from kvpool.cluster.bench import node as bench_node

OPS = ("put", "get_same", "get_cross", "get_same_no_outs", "get_cross_no_outs")


def _positive(rng) -> bool:
    return (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, float) and math.isfinite(x) and x > 0
                                                             for x in rng) and rng[0] <= rng[1])


def test_node_datapath_bench_through_the_cli(tmp_path):
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    env.pop("CI", None)  # --no-peers: nothing to insist on
    p = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "datapath", "--rounds", "1", "--ops256", "5",
                        "--ops32", "1", "--large-mib", "4", "--no-peers", "--json"],
                       capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout)  # --json prints only JSON
    assert r["config"]["sizes"] == {"256KiB": 256 << 10, "4MiB": 4 << 20}
    assert r["config"]["ops"] == {"256KiB": 5, "4MiB": 1}
    kv = r["kvpool"]
    for op in OPS:
        assert _positive(kv["256KiB"][op]["p50_ms"]) and _positive(kv["256KiB"][op]["p99_ms"]), op
        assert _positive(kv["4MiB"][op]["gbps_median"]) and _positive(kv["4MiB"][op]["gbps_min"]), op
    assert (kv["wrong_bytes"], kv["missing"], kv["put_failed"], kv["wrong_path"]) == (0, 0, 0, 0)
    assert kv["put_forwarded"] == 0  # every put landed on the writer's node
    assert kv["workers_imported_ray"] is False
    assert kv["client_counts"]["reader"].get("get_remote", 0) >= 2 * (5 + 5 + 1 + 1)  # warm-up included
    assert r["memcpy"]["wrong_bytes"] == 0 and _positive(r["memcpy"]["4MiB"]["copy"]["gbps_median"])
    assert r["peers"] == {"skipped": "--no-peers"}
    assert set(r["ratios"]) == {"4MiB put kvpool/memcpy", "4MiB get_same kvpool/memcpy", "4MiB copy_checksum/memcpy"}
    assert _positive(r["memcpy"]["4MiB"]["copy_checksum"]["gbps_median"])
    for rtt in kv["node_rtt"].values():  # the node socket's round trip, on both shards
        assert _positive(rtt["p50_ms"])
    put = kv["breakdown_ms"]["256KiB"]["writer"]
    assert any(k.startswith("call put") and v["calls"] == 5 + 5 for k, v in put.items())  # one call a put
    assert all(_positive(v) for v in r["ratios"].values())
    by_ratio = {t["ratio"]: t for t in r["targets"]}
    assert by_ratio["4MiB put kvpool/memcpy"]["met"] in (True, False)
    assert by_ratio["256KiB p50 put kvpool/mooncake"]["met"] is None  # no peers: not measured
    table = bench_node.format_table(r)
    assert "get_cross" in table and "not measured" in table


def test_ratios_are_per_round_and_targets_use_the_worst_round():
    def kv(put_ms, same_ms, cross_ms, gbps):
        small = {op: {"p50_ms": ms, "p99_ms": 2 * ms} for op, ms in
                 (("put", put_ms), ("get_same", same_ms), ("get_cross", cross_ms))}
        large = {op: {"gbps_median": gbps, "gbps_min": gbps / 2} for op in ("put", "get_same", "get_cross")}
        return {"256KiB": small, "32MiB": large}

    def peer(ms, gbps):
        small = {op: {"p50_ms": [ms, ms], "p99_ms": [2 * ms, 2 * ms]} for op in ("put", "get_same", "get_cross")}
        large = {op: {"gbps_median": [gbps, gbps], "gbps_min": [gbps, gbps]} for op in ("put", "get_same", "get_cross")}
        return {"256KiB": small, "32MiB": large}

    mem = {"256KiB": {"copy": {"p50_ms": 0.02, "p99_ms": 0.03}}, "32MiB": {"copy": {"gbps_median": 10.0,
                                                                                   "gbps_min": 9.0}}}
    r1 = bench_node._round_ratios(kv(1.0, 0.1, 2.0, 8.0), mem, {"mooncake": peer(1.0, 4.0)}, "32MiB")
    r2 = bench_node._round_ratios(kv(3.0, 0.1, 2.0, 9.0), mem, {"mooncake": peer(1.0, 4.0)}, "32MiB")
    assert r1["256KiB p50 put kvpool/mooncake"] == 1.0 and r2["256KiB p50 put kvpool/mooncake"] == 3.0
    assert r1["32MiB put kvpool/memcpy"] == 0.8 and r1["32MiB get_cross kvpool/mooncake"] == 2.0
    ratios = {k: [min(r1[k], r2[k]), max(r1[k], r2[k])] for k in r1}
    t = {x["ratio"]: x for x in bench_node._targets(ratios, "32MiB")}
    assert t["256KiB p50 put kvpool/mooncake"]["met"] is False  # round 2 is 3x
    assert t["256KiB p50 get_same kvpool/mooncake"]["met"] is True
    assert t["32MiB put kvpool/memcpy"]["met"] is True and t["32MiB put kvpool/memcpy"]["worst"] == 0.8
