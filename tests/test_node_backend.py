"""The connectors' ``backend: "node"`` (kvpool.connectors.pools): a NodePool over a NodeClient,
on a one-node Ray pool started here. The engine side never imports Ray; a pool that is down is a
fast miss (reads) and stores nothing (writes), never an exception or a hang, and the same client
finds the pool again once it is back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import wait_for

from kvpool.connectors.pools import check_config, open_pool, spec_for
from kvpool.errors import BadRequest
from kvpool.node.paths import own_run_dir

POOL = "nodebackend"
NS = "kvpool-node-backend"
SPEC = spec_for("node-backend-model", 2, 2, 32, "float32", chunk_tokens=16)
STORE = {"page_bytes": SPEC.chunk_nbytes, "dram_pages": 64}
TENANTS = ["a", "b"]
TIMEOUT_S = 1.0
FAST_S = TIMEOUT_S + 0.5  # the bound on any call while the pool is down (one call's deadline, and some)


def chunks(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.chunk_shape, generator=g) for _ in range(n)]


def config(run_dir: str, **extra) -> dict:
    return {"backend": "node", "pool": POOL, "tenants": TENANTS, "chunk_tokens": SPEC.chunk_tokens,
            "run_dir": run_dir, "timeout_s": TIMEOUT_S, **extra}


@pytest.fixture(scope="module")
def ray_pool(tmp_path_factory):
    """(the run dir, a function that brings the pool up, a NodePool opened before the pool ran)."""
    run_dir = str(tmp_path_factory.mktemp("run"))
    early = open_pool(SPEC, config(run_dir, degraded=True))  # an engine that starts before its pool
    for k in ("KVPOOL_SECRET", "KVPOOL_SECRET_FILE"):  # an open pool: tenants by id
        os.environ.pop(k, None)
    import ray

    from kvpool.cluster.bootstrap import down, up

    stack = contextlib.ExitStack()
    stack.enter_context(own_run_dir(run_dir))  # before ray.init: the shard's process inherits it
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=NS, logging_level="ERROR",
             log_to_driver=False)

    def bring_up() -> dict:
        return up(pool=POOL, store=STORE, tenants=[{"id": t} for t in TENANTS], namespace=NS, ttl_s=1.0,
                  controller_interval_s=0.5)

    try:
        bring_up()
        yield run_dir, bring_up, early
    finally:
        early.client.close()
        try:
            down(pool=POOL, namespace=NS)
        finally:
            ray.shutdown()
            stack.close()


def test_config_takes_node_settings():
    cfg = check_config({"backend": "node", "pool": "p", "shard": "node-1", "run_dir": "/tmp/x", "timeout_s": 0.5})
    assert (cfg["backend"], cfg["shard"], cfg["run_dir"], cfg["timeout_s"]) == ("node", "node-1", "/tmp/x", 0.5)
    for bad in ({"backend": "ray", "shard": "node-1"}, {"backend": "node", "run_dir": ""},
                {"backend": "node", "timeout_s": 0}, {"backend": "nod"}):
        with pytest.raises(BadRequest):
            check_config(bad)


def test_an_engine_on_a_node_pool_never_imports_ray(ray_pool):
    """Another process (an engine's) saves, loads, reports and reads stats through the live pool."""
    run_dir = ray_pool[0]
    code = ("import sys, json, torch\n"
            "from kvpool.connectors.pools import open_pool, spec_for\n"
            f"spec = spec_for(*{[SPEC.model_id, 2, 2, 32]!r}, 'float32', chunk_tokens={SPEC.chunk_tokens})\n"
            f"pool = open_pool(spec, {config(run_dir)!r})\n"
            "keys = pool.keys('a', list(range(7000, 7000 + 2 * spec.chunk_tokens)))\n"
            "data = [torch.full(spec.chunk_shape, float(i)) for i in range(2)]\n"
            "saved = pool.save('a', keys, data)\n"
            "got = pool.load('a', keys)\n"
            "pool.report('subprocess', {'x': 1})\n"
            "out = [saved, pool.lookup('a', keys), len(got), all(torch.equal(x, y) for x, y in zip(got, data)),\n"
            "       pool.stats()['shards']]\n"
            "print(json.dumps({'out': out, 'ray': sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))}))\n")
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_RUN_DIR"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"out": [2, 2 * SPEC.chunk_tokens, 2, True, 1], "ray": []}


def test_a_pool_opened_before_the_pool_ran_works_once_it_is_up(ray_pool):
    early = ray_pool[2]
    keys = early.keys("b", list(range(5000, 5000 + 2 * SPEC.chunk_tokens)))
    data = chunks(7, 2)
    took = wait_for(lambda: early.save("b", keys, data) == 2, 5, interval_s=0.2, what="a save of the early pool")
    got = early.load("b", keys)
    assert len(got) == 2 and all(torch.equal(x, y) for x, y in zip(got, data))
    assert early.lookup("b", keys) == 2 * SPEC.chunk_tokens
    assert took < 2, took


def test_load_views_read_this_nodes_chunks_one_at_a_time_into_reused_buffers(ray_pool):
    pool = ray_pool[2]
    keys = pool.keys("a", list(range(9000, 9000 + 3 * SPEC.chunk_tokens)))
    data = chunks(11, 3)
    assert pool.save("a", keys, data) == 3
    views = pool.load_views("a", keys)
    seen = []
    for view in views:
        with view:
            seen.append(view.kv.clone())  # the caller copies each view before asking for the next
    assert len(seen) == 3 and all(torch.equal(a, b) for a, b in zip(seen, data))
    slices = pool.slicing.keys(keys)  # the node pool under the slices: two buffers, reused in turn
    buffers = {v.kv.untyped_storage().data_ptr() for v in pool.part.load_views("a", slices)}
    assert len(slices) == 6 and len(buffers) == 2  # no fresh pages per load
    merged = {v.kv.untyped_storage().data_ptr() for v in pool.load_views_in_place("a", keys)}
    assert len(merged) == 2  # the rank's merged chunks too
    assert list(pool.load_views("b", keys)) == []  # another tenant: nothing
    more = pool.keys("a", list(range(9000, 9000 + 4 * SPEC.chunk_tokens)))
    assert len(list(pool.load_views("a", more))) == 3  # a miss ends the run


def test_a_client_made_while_no_pool_runs_is_a_fast_miss(tmp_path):
    t0 = time.monotonic()
    pool = open_pool(SPEC, config(str(tmp_path), degraded=True))
    assert time.monotonic() - t0 < 1.0
    assert pool.client.shards == {}
    keys = pool.keys("a", list(range(3 * SPEC.chunk_tokens)))
    for _ in range(3):  # the first call after retry_s looks for the pool again; the others do not
        t0 = time.monotonic()
        assert pool.lookup("a", keys) == 0
        assert pool.load("a", keys) == []
        assert pool.save("a", keys, chunks(0, 3)) == 0
        req = pool.begin("a", keys)
        pool.end(req)
        pool.report("node-backend test", {"x": 1})
        assert pool.stats()["shards"] == 0
        assert time.monotonic() - t0 < 0.5
    pool.client.close()


def test_save_load_tenants_and_a_shard_that_dies_and_comes_back(ray_pool):
    import ray

    from kvpool.cluster.controller import CONTROLLER
    from kvpool.cluster.shard import shard_name

    run_dir, bring_up, _ = ray_pool
    pool = open_pool(SPEC, config(run_dir))
    try:
        (sid,) = pool.client.shards
        tokens = list(range(4 * SPEC.chunk_tokens))
        keys = pool.keys("a", tokens)
        data = chunks(1, 4)
        assert pool.save("a", keys, data) == 4
        wait_for(lambda: pool.lookup("a", keys) == len(tokens), 5, what="a's chunks listed")
        got = pool.load("a", keys)
        assert len(got) == 4 and all(torch.equal(x, y) for x, y in zip(got, data))
        assert pool.client.counts["get_shm"] >= 1  # read from the node's shared memory, no call
        # tenant b: the same tokens are other keys, and a's keys under b's name are not a's chunks
        assert pool.lookup("b", pool.keys("b", tokens)) == 0
        assert pool.load("b", pool.keys("b", tokens)) == []
        assert pool.load("b", keys) == []
        stats = pool.stats()
        assert stats["shards"] == 1 and stats["scope"] == "node" and stats["chunks"] >= 4
        pool.report("node-backend test", {"loads": 1})
        controller = ray.get_actor(CONTROLLER, namespace=NS)
        wait_for(lambda: "node-backend test" in ray.get(controller.reports.remote(), timeout=5), 5,
                 what="the report reaching the controller")

        # the shard hangs (stopped): calls on its socket give up at their deadline, never later
        other = pool.keys("a", list(range(1000, 1000 + 2 * SPEC.chunk_tokens)))
        with open(os.path.join(run_dir, f"kvpool-{POOL}-{sid}.node")) as f:
            pid = json.load(f)["pid"]  # the shard's process (Ray started it for this test)
        os.kill(pid, signal.SIGSTOP)
        try:
            rounds = []
            for _ in range(3):
                t0 = time.monotonic()
                assert pool.lookup("a", other) == 0
                assert pool.load("a", other) == []
                assert pool.save("a", other, chunks(2, 2)) == 0
                rounds.append(time.monotonic() - t0)
                time.sleep(0.3)
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"shard hung: rounds of lookup+load+save {', '.join(f'{t * 1e3:.0f}' for t in rounds)} ms")
        assert max(rounds) < FAST_S, rounds

        # the shard dies: misses and nothing stored, each call within one deadline
        ray.kill(ray.get_actor(shard_name(POOL, sid), namespace=NS))
        worst, loads = 0.0, []
        for _ in range(4):
            t0 = time.monotonic()
            # NOTE: until a call on its socket fails, the client still maps the dead shard's table
            # and slab, and a chunk it finds there verifies: the same bytes, never others
            got = pool.load("a", keys)
            assert got == [] or (len(got) == 4 and all(torch.equal(x, y) for x, y in zip(got, data)))
            loads.append(len(got))
            assert pool.lookup("a", other) == 0
            assert pool.load("a", other) == []
            assert pool.save("a", other, chunks(2, 2)) == 0
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.3)
        print(f"shard down: slowest round of load+lookup+load+save {worst * 1e3:.1f} ms")
        assert worst < FAST_S, worst
        assert loads[1:] == [0, 0, 0], loads  # once a call failed, the dead shard's memory is let go

        # back: the same client finds the new shard (new table, new slab) within a few seconds
        wait_for(lambda: sid not in ray.get(controller.state.remote(), timeout=5)["shards"], 20,
                 what="the controller dropping the dead shard")
        bring_up()
        data2 = chunks(3, 2)
        took = wait_for(lambda: pool.save("a", other, data2) == 2, 10, interval_s=0.2, what="a save after the restart")
        print(f"pool back: the same client saved again after {took:.2f} s")
        assert took < 5, took
        wait_for(lambda: pool.lookup("a", other) == len(other) * SPEC.chunk_tokens, 5, what="the new chunks listed")
        got = pool.load("a", other)
        assert len(got) == 2 and all(torch.equal(x, y) for x, y in zip(got, data2))
        assert pool.load("b", pool.keys("b", list(range(1000, 1000 + 2 * SPEC.chunk_tokens)))) == []
    finally:
        pool.client.close()
