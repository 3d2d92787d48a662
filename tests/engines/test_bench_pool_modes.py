"""``kvpool bench pool-modes``: one tiny run through the CLI (512 tokens, one prompt), the
single-node pool and the pool on a local Ray head each started and stopped by the real CLI, vLLM's
OpenAI server on each: the figures are there and sane, both modes' restart hits loaded from the
pool with the same answers, and nothing of either pool is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import need_engines

need_engines("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_one_tiny_run_through_the_cli():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVPOOL_", "RAY_ADDRESS"))}
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "pool-modes", "--context", "512", "--repeats",
                        "1", "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-6000:]
    out = json.loads(r.stdout)  # only JSON on stdout; progress on stderr
    assert "[bench pool-modes]" in r.stderr
    assert out["context"] == 512 and out["repeats"] == 1 and list(out["modes"]) == ["single-node", "ray"]
    one, ray = out["modes"]["single-node"], out["modes"]["ray"]
    assert one["processes"] == 1 and ray["processes"] > 3  # the pool's process; the head's daemons and workers
    assert one["stats_mode"] == "single-node" and ray["stats_mode"] == "ray"
    for m in (one, ray):
        assert m["valid"] and m["same_answers"]  # every restart hit loaded from the pool, answers equal
        assert m["left_running"] == 0 and "down_error" not in m
        assert m["up_s"] > 0 and m["stats_s"] > 0 and m["down_s"] > 0 and len(m["server_start_s"]) == 2
        assert m["rss_mib"] >= m["pss_mib"] > m["slab_mib"] > 0
        assert 0 < m["ttft_pool_s"]["median"] < m["ttft_cold_s"]["median"]
    assert one["pss_mib"] < ray["pss_mib"]
    q = out["ray_vs_single_node"]
    assert q["processes"] == ray["processes"] and q["pss_mib"] > 1 and q["ttft_pool"] > 0
