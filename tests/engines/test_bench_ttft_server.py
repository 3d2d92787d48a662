"""``kvpool bench ttft --engine vllm-server``: one tiny run through the CLI (a pool started outside
the engine, vLLM's OpenAI server on the node path; no in-process comparison), checking the JSON's
shape, the equal-terms protocol (the pool hit on a restarted server, vLLM's own hit right after it
on the same server), that the pool hit really loaded from the pool, and that cold, native and
pool hit agree in token and log-prob."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import need_engines

need_engines("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURES = ("cold_s", "native_s", "pool_s", "pool_vs_native", "cold_vs_pool")


def test_one_tiny_run_through_the_cli():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVPOOL_RUN_DIR", "RAY_ADDRESS"))}
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "ttft", "--engine", "vllm-server", "--backend",
                        "node", "--no-compare-local", "--context", "512", "--repeats", "1", "--json"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    out = json.loads(r.stdout)  # only JSON on stdout
    assert out["engine"] == "vllm-server" and out["context"] == 512 and list(out["backends"]) == ["node"]
    node = out["backends"]["node"]
    assert node["valid"] and node["same_answers"]
    assert node["expected_pool_tokens"] == 511  # two whole chunks, the last token computed
    (row,) = node["repeats"]
    assert row["pool_tokens"] >= 511 and row["cold_cached_tokens"] == 0  # loaded from the pool; cold was cold
    assert row["same_token"] and len(set(map(tuple, row["tokens"]))) == 1
    assert row["native_hit_valid"] and row["native_local_tokens"] >= 480 and row["pool_local_tokens"] == 0
    assert None not in row["logprobs"] and node["logprob_max_diff"] <= 1e-4
    assert node["pool_vs_native_logprob_diff"] <= 1e-4
    assert len(node["server_start_s"]) == 2 and "restart" in node["pool_hit_after"]  # the pool hit after a restart
    for k in FIGURES:
        assert row[k] > 0 and node[k]["min"] <= node[k]["median"] <= node[k]["max"]
    assert node["index"] and node["engine"].startswith("multiprocess")
