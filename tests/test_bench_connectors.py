"""`kvpool bench weights` and `kvpool bench sliding` run end to end, print only JSON with --json,
and report figures that hold by construction (a cached start reads nothing; the KV held until the
save is larger than a windowed cache once the prompt is longer than the window, and the cache a
request decodes on is transformers' own)."""

from __future__ import annotations

import json
import subprocess
import sys


def kvpool(*args: str, timeout: int = 300) -> dict | list:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", *args, "--json"], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_bench_weights_reports_first_and_cached_starts(tmp_path):
    result = kvpool("bench", "weights", "--size-gib", "0.5", "--rounds", "2", "--dir", str(tmp_path))
    assert result["size_gib"] == 0.5 and len(result["rounds"]) == 2
    assert result["tensors"] == 291 and 0.6 < result["bytes"] / 2**29 <= 1.0  # Llama-3-8B's tensors, scaled down
    for r in result["rounds"]:
        assert r["read_s"] > 0 and r["first_start_s"] > 0 and r["later_cold_s"] > 0
        assert r["later_start_s"] < r["first_start_s"]  # a stat per file and the sample, not a read
    assert list(tmp_path.iterdir()) == []  # it cleans up its checkpoint


def test_bench_sliding_measures_the_whole_prompt_cache_against_the_window():
    rows = kvpool("bench", "sliding", "--context", "1536", "--rounds", "1")
    assert {r["model"] for r in rows} == {"mistral-like", "gemma3-like"}
    for r in rows:
        assert r["kinds"] and any(k.startswith("sliding:") for k in r["kinds"])
        assert r["held_bytes_ratio"] > 1.2  # 1536 tokens held to the save where the window keeps 1023
        assert r["cache_bytes_ratio"] == 1.0  # then the request decodes on transformers' own cache
        assert r["pool_bytes_ratio"] >= 1.0 and r["prefill_ratio"] > 0 and r["decode_ratio"] > 0
