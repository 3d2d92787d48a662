"""``kvpool bench auth`` runs both sides of each figure and prints only JSON with --json."""

from __future__ import annotations

import json
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
