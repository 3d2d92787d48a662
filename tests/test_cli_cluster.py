"""`kvpool up`, `kvpool stats` and `kvpool down` as an operator runs them: a local Ray head that
outlives each command."""

import json
import os
import subprocess
import sys



def kvpool(*args, timeout=180):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_up_stats_down():
    try:
        r = kvpool("up", "--page-size", "64KiB", "--dram-pages", "16", "--tenant", "a")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "kvpool is up: 1 shards" in r.stdout and "/dev/shm/" in r.stdout
        r = kvpool("stats", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        st = json.loads(r.stdout)
        (shard,) = st["shards"].values()
        assert shard["tiers"]["dram"]["pages_total"] == 16 and "a" in shard["tenants"]
        assert "dram" in kvpool("stats").stdout
    finally:
        r = kvpool("down", "--stop-ray")
    assert r.returncode == 0 and "1 shards drained" in r.stdout
    r = kvpool("stats")
    assert r.returncode != 0 and "no Ray cluster is running here" in r.stderr
