"""`kvpool up` on one machine with no Ray cluster named: the pool is one process (cluster/solo.py),
with the embedded index, and no Ray at all -- a Python where `import ray` fails runs it all the
same. Engines attach exactly as to a Ray pool (the node's socket and shared memory), `kvpool stats`
answers from the process on its socket, `kvpool down` stops it and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import wait_for

ROUNDTRIP = """
import json, sys
import numpy as np
from kvpool import auth
from kvpool.auth_cli import find_secret
from kvpool.keys import ChunkKey
from kvpool.node.client import NodeClient

tenant, start = sys.argv[1], int(sys.argv[2])
cred = auth.Authority(find_secret()[0]).issue(tenant)
c = NodeClient(timeout_s=10)
keys = NodeClient.addresses(cred, [ChunkKey(bytes([start + i]) * 16) for i in range(3)])
stored = c.put(cred, keys, [np.full(4096, start + i, np.uint8) for i in range(3)])
got = c.get(cred, keys)
print(json.dumps({"stored": stored, "hit": c.lookup(cred, keys).count, "ray": "ray" in sys.modules,
                  "same": [bool((np.asarray(g) == start + i).all()) for i, g in enumerate(got)]}))
c.close()
"""


@pytest.fixture
def no_ray(tmp_path):
    """An environment whose Python cannot import Ray (a machine where it is not installed), with its
    own HOME (the pool secret, the process's record and log) and run dir."""
    shim = tmp_path / "shim"
    (shim / "ray").mkdir(parents=True)
    (shim / "ray" / "__init__.py").write_text("raise ModuleNotFoundError('Ray is not installed here', name='ray')\n")
    home, run = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    run.mkdir()
    drop = ("RAY_", "KVPOOL_SECRET", "KVPOOL_RUN_DIR", "KVPOOL_POOL_RECORD", "KVPOOL_CREDENTIAL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"HOME": str(home), "KVPOOL_RUN_DIR": str(run), "PYTHONPATH": str(shim)})
    yield env
    subprocess.run([sys.executable, "-m", "kvpool.cli", "down"], env=env, capture_output=True, timeout=120)


def kvpool(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def pool_pids(env) -> list[int]:
    from kvpool.procs import processes_with_env

    return processes_with_env(f"KVPOOL_RUN_DIR={env['KVPOOL_RUN_DIR']}")


def test_single_node_pool_runs_without_ray_and_stops_clean(no_ray):
    env = no_ray
    assert subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True).returncode != 0
    r = kvpool(env, "up", "--dram", "64MiB", "--page-size", "4MiB", "--tenant", "acme", "--tenant", "globex")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "one process (pid" in r.stdout and "no Ray" in r.stdout and "dram 16 pages" in r.stdout, r.stdout
    (pid,) = pool_pids(env)  # the pool is exactly one process
    rec = json.loads(open(os.path.join(env["HOME"], ".kvpool", "pool.json")).read())
    assert rec["pid"] == pid and os.stat(os.path.join(env["HOME"], ".kvpool", "pool.json")).st_mode & 0o777 == 0o600
    # nobody but its owner reads what it made: its record, config, log, and the run dir's files
    made = [os.path.join(env["HOME"], ".kvpool", f) for f in ("pool.json", "pool-config.json", "pool.log", "secret")]
    made += [os.path.join(env["KVPOOL_RUN_DIR"], f) for f in os.listdir(env["KVPOOL_RUN_DIR"])]
    assert len(made) >= 8 and all(os.stat(f).st_mode & 0o077 == 0 for f in made), \
        {f: oct(os.stat(f).st_mode) for f in made}
    # a second `kvpool up` does not start another
    r = kvpool(env, "up", "--dram", "64MiB", "--page-size", "4MiB")
    assert r.returncode == 2 and "already up" in r.stderr and "kvpool down" in r.stderr, r.stderr
    r = kvpool(env, "up", "--ray-address", "local", "--dram", "64MiB", "--page-size", "4MiB")
    assert r.returncode == 2 and "a single-node pool runs on this machine" in r.stderr, r.stderr  # not two shards here
    r = kvpool(env, "up", "--insecure-ray", "--dram", "64MiB", "--page-size", "4MiB")
    assert r.returncode == 2 and "add --ray-address" in r.stderr, r.stderr
    assert pool_pids(env) == [pid]
    # engines attach through the node's socket and shared memory, each tenant its own chunks
    for tenant, start in (("acme", 10), ("globex", 20)):
        out = subprocess.run([sys.executable, "-c", ROUNDTRIP, tenant, str(start)], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout)
        assert got == {"stored": 3, "hit": 3, "ray": False, "same": [True, True, True]}, got
    t0 = time.monotonic()
    r = kvpool(env, "stats", "--json")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    st = json.loads(r.stdout)
    assert st["mode"] == "single-node" and list(st["shards"]) == ["single-node"]
    shard = st["shards"]["single-node"]
    assert shard["tiers"]["dram"]["chunks"] == 6 and {"acme", "globex"} <= set(shard["tenants"])
    assert took < 3.0, f"kvpool stats took {took:.2f} s"  # a Python start and one call on the socket
    r = kvpool(env, "down")
    assert r.returncode == 0 and f"stopped the pool's process (pid {pid}; it held 6 chunks)" in r.stdout, r.stdout
    assert pool_pids(env) == []
    assert os.listdir(env["KVPOOL_RUN_DIR"]) == []  # socket, node file, page table and slab gone
    r = kvpool(env, "stats")
    assert r.returncode != 0 and "no pool is up on this machine" in r.stderr, r.stderr


def test_a_killed_pool_process_is_replaced_by_the_next_up(no_ray):
    env = no_ray
    assert kvpool(env, "up", "--dram", "32MiB", "--page-size", "4MiB").returncode == 0
    (pid,) = pool_pids(env)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pool_pids(env), 30, what="the killed pool process to go")
    r = kvpool(env, "up", "--dram", "32MiB", "--page-size", "4MiB")  # a stale record and node files
    assert r.returncode == 0, r.stderr[-2000:]
    (pid2,) = pool_pids(env)
    assert pid2 != pid
    out = subprocess.run([sys.executable, "-c", ROUNDTRIP, "default", "1"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["same"] == [True] * 3, out.stderr[-2000:]


def test_a_pool_process_that_cannot_start_fails_up_with_its_reason(no_ray, tmp_path):
    env = {**no_ray, "KVPOOL_RUN_DIR": str(tmp_path / "nonexistent" / "file-not-dir")}
    (tmp_path / "nonexistent").write_text("a file where the run dir's parent should be")
    r = kvpool(env, "up", "--dram", "32MiB", "--page-size", "4MiB")
    assert r.returncode == 2 and "exited at start" in r.stderr and "NotADirectoryError" in r.stderr, r.stderr[-2000:]
    assert pool_pids(env) == [] and not os.path.exists(os.path.join(env["HOME"], ".kvpool", "pool.json"))


def test_ups_at_once_start_one_pool_and_down_leaves_none(no_ray):
    """Six `kvpool up` at once: one pool process (the one recorded), the others refused naming it;
    a `kvpool down` while an up starts waits for it and stops it; nothing is left running."""
    env = no_ray
    up = [sys.executable, "-m", "kvpool.cli", "up", "--dram", "32MiB", "--page-size", "4MiB"]
    try:
        procs = [subprocess.Popen(up, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(6)]
        done = [(p.returncode, out, err) for p in procs for out, err in [p.communicate(timeout=180)]]
        started = [out for rc, out, _ in done if rc == 0]
        assert len(started) == 1, done  # today: three of six started a pool
        refused = [err for rc, _, err in done if rc != 0]
        assert all("already up" in err for err in refused), refused
        (pid,) = pool_pids(env)
        assert f"(pid {pid}, no Ray)" in started[0]
        rec = os.path.join(env["HOME"], ".kvpool", "pool.json")
        assert json.loads(open(rec).read())["pid"] == pid
        assert os.stat(os.path.join(env["HOME"], ".kvpool", "up.lock")).st_mode & 0o777 == 0o600
        r = kvpool(env, "down")
        assert r.returncode == 0 and f"(pid {pid}" in r.stdout, r.stdout + r.stderr
        assert pool_pids(env) == []
        # `kvpool down` while an up is starting (its process recorded, not yet answering)
        starting = subprocess.Popen(up, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: os.path.exists(rec), 60, interval_s=0.01, what="the starting pool's record")
        down = kvpool(env, "down")
        out, err = starting.communicate(timeout=180)
        assert starting.returncode == 0, err  # today: killed at start ("exited at start")
        (pid,) = [int(w) for w in out.split("(pid ", 1)[1].split(",", 1)[:1]]
        assert down.returncode == 0 and f"(pid {pid}" in down.stdout, down.stdout + down.stderr
        assert pool_pids(env) == []
    finally:
        for pid in pool_pids(env):  # today: the pools nobody recorded
            os.kill(pid, signal.SIGKILL)


def test_an_operators_quota_survives_redis_restarting_empty(no_ray, tmp_path):
    """A single-node pool on Redis, as `kvpool up --redis` takes it (the shard user's URL, the
    default user locked); the operator sets a tenant's quota and priority with `kvpool tenants`;
    Redis restarts empty (its users kept in its ACL file). The tenant comes back with the
    operator's quota and priority, not unlimited, and stores no more than its quota."""
    import numpy as np
    from test_redis_acl import AclRedis

    from kvpool.auth import Authority
    from kvpool.errors import KvPoolError
    from kvpool.keys import ChunkKey
    from kvpool.node.client import NodeClient

    env, page, quota = no_ray, 64 << 10, 4 * (64 << 10)
    redis = AclRedis(tmp_path)
    op, client = redis.index("operator"), None
    try:
        r = kvpool(env, "up", "--redis", redis.url("shard"), "--dram", "4MiB", "--page-size", "64KiB", "--tenant", "acme")
        assert r.returncode == 0, r.stderr[-2000:]
        for cmd in (("set-quota", "acme", "256KiB"), ("set-priority", "acme", "high")):
            r = kvpool(env, "tenants", *cmd, "--redis", redis.url("operator"))
            assert r.returncode == 0, r.stderr[-2000:]
        client = NodeClient(directory=env["KVPOOL_RUN_DIR"], timeout_s=10)
        wait_for(lambda: client.shard_stats().get("operator_state", {}).get("acme") == [quota, "high"], 30,
                 interval_s=0.2, what="the pool's shard to see the operator's quota")
        redis.server.restart()  # empty
        wait_for(lambda: [(t.quota, t.priority) for t in op.tenants() if t.id == "acme"], 30, interval_s=0.2,
                 ignore=(KvPoolError,), what="acme registered again")
        assert [(t.quota, t.priority) for t in op.tenants() if t.id == "acme"] == [(quota, "high")]  # today: unlimited
        acme = Authority(open(os.path.join(env["HOME"], ".kvpool", "secret")).read().strip()).issue("acme")
        keys = NodeClient.addresses(acme, [ChunkKey(i.to_bytes(16, "big")) for i in range(1, 9)])
        for i, k in enumerate(keys):  # twice its quota, a chunk a call
            try:
                client.put(acme, [k], [np.full(page, i, np.uint8)])
            except Exception as e:  # noqa: BLE001 - its 429, once the index refused a publish
                assert getattr(e, "status", None) == 429, e

        def held() -> tuple[int, int]:
            return op.usage("acme"), sum(client.lookup(acme, [k]).count for k in keys)

        wait_for(lambda: held()[0] <= quota and held()[1] * page <= quota, 30, interval_s=0.2,
                 what=f"acme's usage in the index and chunks in the pool within its quota of {quota} B")
    finally:
        if client is not None:
            client.close()
        op.close()
        kvpool(env, "down")
        redis.server.kill()
