"""`kvpool up`, `kvpool stats` and `kvpool down` as an operator runs them: a local Ray head that
outlives each command."""

import json
import os
import subprocess
import sys

MISSES = """
import os, ray
from kvpool.cluster.ops import connect, NAMESPACE
from kvpool.cluster.shard import shard_name
from kvpool.cluster.messages import Get
from kvpool.cluster.controller import CONTROLLER
connect(None, start_local=False)
state = ray.get(ray.get_actor(CONTROLLER, namespace=NAMESPACE).state.remote(), timeout=30)
for sid in state["shards"]:
    shard = ray.get_actor(shard_name("default", sid), namespace=NAMESPACE)
    assert ray.get(shard.get.remote(Get([os.urandom(16) for _ in range(20)], "a")), timeout=30).arrays == []
"""


def kvpool(*args, timeout=180):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_up_stats_warmup_down(tmp_path):
    try:
        r = kvpool("up", "--page-size", "256KiB", "--dram-pages", "16", "--tenant", "a", "--policy", "tiered")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "kvpool is up: 1 shards" in r.stdout and "/dev/shm/" in r.stdout
        r = kvpool("stats", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        st = json.loads(r.stdout)
        (shard,) = st["shards"].values()
        assert shard["tiers"]["dram"]["pages_total"] == 16 and "a" in shard["tenants"]
        assert st["healthy"] is True  # idle: nothing out of range (no lookups to judge yet)
        assert "dram" in kvpool("stats").stdout
        # Warm-up: two system prompts of 2 whole chunks (64 tokens each) and a tail.
        warm = tmp_path / "prefixes.jsonl"
        warm.write_text("\n".join(json.dumps({"tenant": "a", "tokens": list(range(s, s + 140))}) for s in (1, 500)))
        r = kvpool("warmup", str(warm), "--model", "demo", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        w = json.loads(r.stdout)
        # the tiered policy pins at most 20% of the shard's 16 pages: 3 of the 4 chunks
        assert w == {"prefixes": 2, "skipped": 0, "stored_chunks": 4, "pinned_chunks": 3}
        st = json.loads(kvpool("stats", "--json").stdout)
        (shard,) = st["shards"].values()
        assert shard["chunks"] == 4 and shard["policy_stats"]["pinned"] == 3
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"tenant": "a", "tokens": [1, -2]}')
        r = kvpool("warmup", str(bad))
        assert r.returncode == 2 and "bad.jsonl:1" in r.stderr and "non-negative" in r.stderr
        # Force a figure out of range: lookups that all miss put the hit rate at 0%.
        r = subprocess.run([sys.executable, "-c", MISSES], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        assert r.returncode == 0, r.stderr[-2000:]
        r = kvpool("stats", "--json")
        assert r.returncode == 1  # what a monitor or a readiness probe reads
        st = json.loads(r.stdout)
        assert st["healthy"] is False
        (rate,) = [h for h in st["health"] if h["figure"] == "hit_rate"]
        assert rate["value"] == 0.0 and rate["ok"] is False and rate["low"] == 0.99
        r = kvpool("stats")
        assert r.returncode == 1 and "OUT OF RANGE" in r.stdout and "UNHEALTHY" in r.stdout
    finally:
        r = kvpool("down", "--stop-ray")
    assert r.returncode == 0 and "1 shards drained" in r.stdout
    r = kvpool("stats")
    assert r.returncode != 0 and "no Ray cluster is running here" in r.stderr
