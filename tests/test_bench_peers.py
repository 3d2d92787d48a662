"""``kvpool bench peers``: Mooncake Store and Redis beside memcpy in one run, every read checked."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import IN_CI, redis_reachable

from kvpool.bench import cli as bench_cli
from kvpool.bench import peers

OPS = ("put", "get_same", "get_cross")


def test_byte_pattern_is_deterministic_and_differs_by_seed():
    a = peers.byte_pattern(1 << 20, 7)
    assert a.dtype == np.uint8 and a.size == 1 << 20
    assert np.array_equal(a, peers.byte_pattern(1 << 20, 7))
    assert np.count_nonzero(a != peers.byte_pattern(1 << 20, 8)) > 0.9 * a.size
    assert np.array_equal(peers.byte_pattern(13, 3), peers.byte_pattern(16, 3)[:13])


def test_count_wrong_bytes_sees_a_flipped_byte_and_a_short_read():
    good = peers.byte_pattern(4096, 5).copy()
    assert peers.count_wrong_bytes(good, 5) == 0
    assert peers.count_wrong_bytes(good.tobytes(), 5, 4096) == 0
    good[1234] ^= 1
    assert peers.count_wrong_bytes(good, 5) == 1
    assert peers.count_wrong_bytes(peers.byte_pattern(4000, 5).tobytes(), 5, 4096) == 96
    assert peers.count_wrong_bytes(b"", 5, 4096) == 4096


def test_summaries():
    xs = [i / 1000 for i in range(1, 201)]  # 1..200 ms
    s = peers.latency_summary(xs)
    assert s["p50_ms"] == pytest.approx(100) and s["p99_ms"] == pytest.approx(198)
    t = peers.throughput_summary([0.01, 0.02, 0.04], 10**8)
    assert t == {"gbps_median": pytest.approx(5.0), "gbps_min": pytest.approx(2.5)}
    assert peers.range_over_rounds([{"a": 2.0}, {"a": 1.0}, {"a": 3.0}]) == {"a": [1.0, 3.0]}


class _FakeWorker:
    def __init__(self, endpoint, wrong=0):
        self.hello = {"endpoint": endpoint}
        self.wrong = wrong

    def call(self, **msg):
        return {"put": {"s": 1e-3}, "get": {"s": 1e-3, "wrong": self.wrong}, "remove": {"ok": True},
                "where": {"endpoint": "w"}}[msg["op"]]


def test_a_wrong_byte_is_counted_and_fails_the_command(monkeypatch):
    ops, warmup = {"256KiB": 2, "32MiB": 1}, {"256KiB": 0, "32MiB": 0}
    r, wrong = peers._peer_round(_FakeWorker("w"), _FakeWorker("r", wrong=1), 0, ops, warmup, True, False, "x")
    assert wrong == 3 and set(r) == {"256KiB", "32MiB"} and set(r["256KiB"]) == set(OPS)
    with pytest.raises(RuntimeError, match="writer's segment"):  # a read that would not cross processes
        peers._peer_round(_FakeWorker("elsewhere"), _FakeWorker("r"), 0, ops, warmup, True, False, "x")
    result = {"config": {}, "memcpy": {"wrong_bytes": 0}, "redis": {"wrong_bytes": 3}}
    monkeypatch.setattr(peers, "run", lambda **kw: result)
    args = argparse.Namespace(peers="redis", rounds=1, ops256=1, ops32=1, redis="redis://x", json=True)
    assert bench_cli._bench_peers(args) == 1


def test_a_missing_peer_is_skipped_outside_ci_and_an_error_in_ci(monkeypatch):
    monkeypatch.setattr(peers, "_availability", lambda peer: f"{peer} is not here")
    small = dict(rounds=1, peers=("mooncake",), progress=False, ops={"256KiB": 1, "32MiB": 1},
                 warmup={"256KiB": 0, "32MiB": 0})
    monkeypatch.setenv("CI", "false")
    assert peers.run(**small)["mooncake"] == {"skipped": "mooncake is not here"}
    monkeypatch.setenv("CI", "true")
    with pytest.raises(peers.PeerMissing):
        peers.run(**small)


def test_bench_peers_json_reports_positive_figures_and_no_wrong_bytes():
    cmd = [sys.executable, "-m", "kvpool.cli", "bench", "peers", "--json", "--rounds", "1", "--ops256", "20",
           "--ops32", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)  # --json: nothing but JSON on stdout
    expect = {"memcpy"}
    if IN_CI or redis_reachable() or shutil.which("redis-server"):
        expect.add("redis")
    if IN_CI:
        expect.add("mooncake")
    elif importlib.util.find_spec("mooncake") is None:
        assert "skipped" in r["mooncake"]
    ran = {p for p in ("memcpy", *peers.PEERS) if "skipped" not in r[p]}
    assert expect <= ran, {p: r[p].get("skipped") for p in expect - ran}
    for p in ran:
        assert r[p]["wrong_bytes"] == 0
        ops = ("copy",) if p == "memcpy" else OPS
        for op in ops:
            lat, bw = r[p]["256KiB"][op], r[p]["32MiB"][op]
            assert all(0 < lo <= hi for lo, hi in lat.values()), (p, op, lat)
            assert all(0 < lo <= hi for lo, hi in bw.values()), (p, op, bw)
            assert set(lat) == {"p50_ms", "p99_ms"} and set(bw) == {"gbps_median", "gbps_min"}
