"""``kvpool bench auth`` runs both sides of each figure and prints only JSON with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpool.auth import Authority, new_secret
from kvpool.bench import auth as bench
from kvpool.errors import Unauthorized


def test_the_checked_side_checks_and_the_baseline_does_not():
    (secured, cred), (plain, name) = bench._pair(bench.SIZES["256 KiB"], 4)
    with pytest.raises(Unauthorized):
        secured.keys(name, [1] * 256)
    assert plain.keys(name, [1] * 256) and secured.keys(cred, [1] * 256)
    with pytest.raises(Unauthorized):
        secured.load(Authority(new_secret()).issue("alice"), plain.keys(name, [1] * 256))
    secured.store.close()
    plain.store.close()


def test_bench_auth_reports_every_call_for_both_sizes_as_json():
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "auth", "--calls", "20", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout)
    assert set(r["sizes"]) == {"256 KiB", "32 MiB"}
    for ops in r["sizes"].values():
        assert set(ops) == {"lookup (16 chunks)", "get (1 chunk)", "put (1 new chunk)"}
        for o in ops.values():
            assert o["checked_us"] > 0 and o["unchecked_us"] > 0
    assert r["primitives"]["verify_cached_us"] < r["primitives"]["verify_first_us"]
    for ops in r["sealed"].values():
        assert set(ops) == {"put (1 new chunk)", "get (1 chunk)"}
        assert all(o["sealed_us"] > 0 and o["plain_us"] > 0 for o in ops.values())


def test_bench_secure_runs_a_locked_pool_beside_an_open_one():
    """`kvpool bench secure`: two pools side by side, the locked one on a Ray with its token that
    refuses a bare tenant name, the open one on a Ray without a token that takes it; every read
    right; each hot path's paired ratio reported with its target; both pools' Rays stopped after."""
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "secure", "--rounds", "1", "--steps", "12",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["pools"] == {"secured": {"ray_auth_mode": "token", "bare_name_refused": True},
                          "insecure": {"ray_auth_mode": "disabled", "bare_name_refused": False}}
    assert r["wrong_bytes"] == 0 and r["missing"] == 0 and r["worker_imported_ray"] is False
    assert {t["op"] for t in r["targets"]} == {"put", "get_same", "lookup_here", "lookup_miss"}
    for op, v in r["paired_all_steps"].items():
        assert 0.3 < v < 3, (op, v)
        assert r["secured"][op]["p50_us"][0] > 0 and r["insecure"][op]["p50_us"][0] > 0
    assert "FAILED" not in out.stderr
    left = []  # the pools' Ray processes: their sessions live under the run's /tmp/kvs* folder
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if "/tmp/kvs" in cmd and "ray" in cmd:
            left.append(cmd[:200])
    assert not left, left
