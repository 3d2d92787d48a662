"""Membership and the index under faults (issue 16), on a real pool: a 3-node Ray cluster on this
machine, its index in a Redis server of the test's own with the ACL users of kvpool's roles (the
pool on the shard user's URL, as `kvpool up --redis` requires; the test's own writes as the
operator). A quota refusal never blocks a reconcile; operator quotas survive Redis restarting
empty; a shard the controller dropped is fenced and purged; a paused Redis is an index outage,
not dead shards; leftovers are cleaned up."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from conftest import cluster_pool, free_port, make_keys, payload, wait_for
from test_redis_acl import AclRedis

from kvpool.cluster.bootstrap import shard_id_of, up
from kvpool.cluster.controller import ADOPT_TRIES, CONTROLLER
from kvpool.cluster.shard import DRILLS_ENV, shard_name
from kvpool.errors import BadRequest, KvPoolError, Unavailable
from kvpool.keys import ChunkKey
from kvpool.node import messages as m
from kvpool.slab import sweep_orphans
from kvpool.tenants import UNLIMITED

NS = "kvpool-membership"
PAGE = 4096
TTL = 1.5
UP = {"store": {"page_bytes": PAGE, "dram_pages": 64}, "tenants": [{"id": "a"}, {"id": "b"}], "ttl_s": TTL,
      "controller_interval_s": 0.5, "namespace": NS}
SETTLING = (ray.exceptions.RayError, KvPoolError)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    r = AclRedis(tmp_path_factory.mktemp("redis"))
    yield r
    r.server.kill()


@pytest.fixture(scope="module")
def cluster(redis, tmp_path_factory):
    fast = {"health_check_failure_threshold": 2, "health_check_period_ms": 500, "health_check_initial_delay_ms": 0}
    mp = pytest.MonkeyPatch()
    mp.setenv(DRILLS_ENV, "1")
    up_kw = {k: v for k, v in UP.items() if k != "namespace"}
    try:
        with cluster_pool(str(tmp_path_factory.mktemp("run")), 3, NS, system_config=fast,
                          index_url=redis.url("shard"),
                          **up_kw) as cp:
            yield cp
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def client(cluster):
    cl = cluster.client(timeout_s=1.5)  # the engine on the head's node
    yield cl
    cl.close()


@pytest.fixture
def idx(redis):
    i = redis.index("operator")
    yield i
    i.close()


def shard(sid):
    return ray.get_actor(shard_name("default", sid), namespace=NS)


def controller():
    return ray.get_actor(CONTROLLER, namespace=NS)


def ring():
    st = ray.get(controller().state.remote(), timeout=10)
    return st["version"], set(st["shards"])


def listed(idx) -> dict[str, set[ChunkKey]]:
    return {s: set(idx.shard_keys(s)) for s in idx.shards()}


def all_alive(idx, sids) -> bool:
    alive = idx.shards()
    return all(alive.get(s) for s in sids)


def test_up_against_a_dead_redis_is_a_typed_503_naming_it(cluster):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(Unavailable, match=f"the index at {url} does not answer"):
        up(index_url=url, **{**UP, "namespace": "kvpool-dead-redis", "timeout_s": 10})
    with pytest.raises(ValueError):  # nothing was started
        ray.get_actor(CONTROLLER, namespace="kvpool-dead-redis")


def test_a_reconcile_publishes_what_it_can_and_drops_what_the_index_refuses(client, idx):
    ka, kb = make_keys(12, seed=101), make_keys(12, seed=102)
    assert client.put("a", ka, [payload(i, PAGE) for i in range(12)]) == 12
    assert client.put("b", kb, [payload(i, PAGE) for i in range(12)]) == 12
    wait_for(lambda: all(idx.get(k) for k in client.addresses("a", ka) + client.addresses("b", kb)), 10,
             what="the chunks listed in the index")
    before = listed(idx)
    tenant_of = {k: idx.get(k).tenant for keys in before.values() for k in keys}
    of_a = {k for k, t in tenant_of.items() if t == "a"}
    of_b = {k for k, t in tenant_of.items() if t == "b"}
    assert len(of_a) >= 12 and len(of_b) >= 12
    try:
        idx.set_quota("a", 0)  # an operator lowers a's quota below what it holds
        idx.remove(sorted(of_a | of_b))  # the index loses them (a purge, an eviction race)
        for sid in before:  # today: QuotaExceeded for the whole reconcile, b's never come back
            ray.get(shard(sid).reconcile.remote(), timeout=30)

        def settled() -> bool:
            now = set().union(*listed(idx).values())
            held = {ChunkKey(k) for s in before for k in ray.get(shard(s).held.remote(), timeout=10)}
            return of_b <= now and not (of_a & now) and not (of_a & held)

        wait_for(settled, 20, interval_s=0.3, ignore=SETTLING, what="b's entries republished, a's dropped")
        refused = sum(ray.get(shard(s).stats.remote(), timeout=10)["reconcile_refused"] for s in before)
        assert refused >= len(of_a)
    finally:
        idx.set_quota("a", UNLIMITED)


def test_operator_quotas_survive_redis_restarted_empty(cluster, client, redis, idx):
    """Whoever re-creates a tenant in the empty Redis first (a shard rejoining, or the controller)
    creates it with the operator's quota and priority: the shard user creates a tenant but never
    changes a quota, so the first values are final. Once after a plain restart (shards and the
    controller race), once when the controller restarted with Redis (its memory gone)."""
    sids = ring()[1]
    idx.set_quota("b", 12345)
    idx.set_priority("b", "high")

    def seen_by_every_shard() -> bool:
        return all(ray.get(shard(s).stats.remote(), timeout=10)["operator_state"].get("b") == [12345, "high"]
                   for s in sids)

    def restored() -> bool:
        fresh = redis.index("operator")
        try:
            return [(t.quota, t.priority) for t in fresh.tenants() if t.id == "b"] == [(12345, "high")]
        finally:
            fresh.close()

    try:
        wait_for(seen_by_every_shard, 20, interval_s=0.3, ignore=SETTLING, what="b's quota seen by every shard")
        wait_for(lambda: tuple(ray.get(controller().health.remote(), timeout=10)["operator_state"].get("b", ()))
                 == (12345, "high"), 20, interval_s=0.3, ignore=SETTLING, what="b's quota seen by the controller")
        redis.server.restart()  # empty
        wait_for(restored, 20, interval_s=0.3, ignore=SETTLING, what="b's quota and priority back after the restart")
        wait_for(lambda: all_alive(idx, sids), 20, interval_s=0.3, ignore=SETTLING, what="every shard rejoined")
        assert ring()[1] == sids
        # the head's node restarts: Redis and the controller (Ray restarts it, empty) at once
        before = ray.get(controller().health.remote(), timeout=10)["incarnation"]
        redis.server.kill()
        ray.kill(controller(), no_restart=False)
        wait_for(lambda: ray.get(controller().health.remote(), timeout=5)["incarnation"] != before, 60,
                 interval_s=0.5, ignore=SETTLING, what="the controller restarted")
        redis.server.start()  # empty
        wait_for(lambda: all_alive(idx, sids), 30, interval_s=0.3, ignore=SETTLING, what="every shard rejoined")
        assert restored()  # today: b unlimited and normal, as the first shard that rejoined created it
        wait_for(lambda: ring()[1] == sids, 30, interval_s=0.3, ignore=SETTLING, what="the shards adopted again")
    finally:
        wait_for(lambda: idx.set_quota("b", UNLIMITED) or idx.set_priority("b", "normal") or True, 20,
                 interval_s=0.3, ignore=SETTLING, what="b's quota and priority reset")


def test_a_paused_redis_is_an_outage_and_drops_no_shard(client, redis, idx):
    keys = make_keys(20, seed=103)
    assert client.put("a", keys, [payload(i, PAGE) for i in range(20)]) == 20
    wait_for(lambda: all_alive(idx, ring()[1]), 20, interval_s=0.3, ignore=SETTLING, what="every shard alive")
    version, sids = ring()
    redis.server.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(10)
    finally:
        redis.server.proc.send_signal(signal.SIGCONT)
    time.sleep(4 * TTL)  # beyond the heartbeats' TTL and several controller passes
    assert ring() == (version, sids)  # today: every shard dropped (their heartbeat keys expired)
    assert client.lookup("a", keys).count == 20  # and their entries still listed


def test_a_shard_the_controller_dropped_is_fenced_until_registered_again(cluster, redis, idx):
    sid = cluster.shards[1]
    h = shard(sid)
    keys = make_keys(8, seed=104)
    engine = cluster.client(sid, timeout_s=1.5)  # an engine on that node
    assert engine.put("a", keys, [payload(i, PAGE) for i in range(8)]) == 8
    ray.get(controller().deregister.remote(sid), timeout=10)
    idx.forget_shard(sid)  # what the controller does to a shard it drops
    wait_for(lambda: ray.get(h.stats.remote(), timeout=10)["fenced"], 10, interval_s=0.2, what=f"{sid} fenced")
    time.sleep(2 * TTL)  # today: it rejoins and republishes at its next heartbeat
    assert sid not in idx.shards() and not idx.shard_keys(sid)
    with pytest.raises(Unavailable, match="fenced"):
        engine.call(m.Get("a", [bytes(k) for k in keys]))
    engine.close()
    up(index_url=redis.url("shard"), **UP)  # registered again: it rejoins
    wait_for(lambda: idx.shards().get(sid) and not ray.get(h.stats.remote(), timeout=10)["fenced"], 15,
             interval_s=0.2, ignore=SETTLING, what=f"{sid} back in the index")
    assert sid in ring()[1]


def test_a_listed_shard_the_controller_cannot_reach_is_purged(cluster, idx):
    idx.register_shard("node-ghost", "nowhere", TTL)
    stop = threading.Event()

    def zombie():  # keeps heartbeating, as a process cut off from Ray does
        while not stop.wait(0.3):
            try:
                idx.heartbeat("node-ghost", TTL)
            except BadRequest:
                return

    t = threading.Thread(target=zombie, daemon=True)
    t.start()
    try:
        wait_for(lambda: "node-ghost" not in idx.shards(), ADOPT_TRIES * 0.5 + 15, interval_s=0.3,
                 what="the unreachable shard purged from the index")
    finally:
        stop.set()
        t.join(5)


def test_a_killed_node_s_shard_is_purged_even_while_it_heartbeats(cluster, idx):
    victim_node = cluster.workers[-1]
    victim = shard_id_of(victim_node.node_id)
    keys = make_keys(40, seed=105)
    engine = cluster.client(victim, timeout_s=1.5)
    assert engine.put("a", keys, [payload(i, PAGE) for i in range(40)]) == 40
    engine.close()
    wait_for(lambda: idx.shard_keys(victim), 10, what=f"{victim}'s chunks listed")
    stop = threading.Event()

    def zombie():  # its process outlived its raylet and keeps heartbeating
        while not stop.wait(0.3):
            try:
                idx.heartbeat(victim, TTL)
            except BadRequest:
                return

    t = threading.Thread(target=zombie, daemon=True)
    t.start()
    try:
        cluster.cluster.remove_node(victim_node, allow_graceful=False)
        wait_for(lambda: victim not in idx.shards() and not idx.shard_keys(victim), 30, interval_s=0.3,
                 ignore=SETTLING, what=f"{victim}'s entries and membership purged")
        time.sleep(2 * TTL)
        assert victim not in idx.shards() and not idx.shard_keys(victim)  # no re-publish
        assert victim not in ring()[1]
    finally:
        stop.set()
        t.join(5)


# ---------------------------------------------------------------------- leftovers (no cluster)
def test_slab_files_of_gone_processes_are_swept_and_no_other(tmp_path):
    d = str(tmp_path)

    def make(name, age_s=600.0):
        p = os.path.join(d, name)
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
        os.utime(p, (time.time() - age_s, time.time() - age_s))
        return p

    orphan = make("kvpool-default-node-dead-dram.kvslab")
    mapped = make("kvpool-default-node-live-dram.kvslab")
    young = make("kvpool-default-node-new-dram.kvslab", age_s=0)
    other = make("kvpool-otherpool-node-x-dram.kvslab")
    with open(mapped, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 4096)
    try:
        assert sweep_orphans(d, "kvpool-default-") == [orphan]
    finally:
        mm.close()
    assert not os.path.exists(orphan) and all(os.path.exists(p) for p in (mapped, young, other))


def test_down_stops_only_the_ray_that_up_started(tmp_path, monkeypatch):
    """The head's processes: those with its id in their environment (whatever their command line
    names), those naming its session, Ray's own naming its address; never another session's, nor a
    process of somebody's that merely names the address."""
    from kvpool.cluster import ops

    session = str(tmp_path / "session_of_ours")
    code = "import time; time.sleep(120)"

    def start(*args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code, *args], env={**os.environ, **(env or {})})

    ours = start(f"--session-dir={session}")
    by_env = start(env={ops.HEAD_ENV: "0123abcd"})  # an agent the raylet started: it names nothing of the head
    client = start("-m", "ray.util.client.server", "--address=127.0.0.1:1")  # names only the address
    theirs = start("--session-dir=/tmp/ray/session_of_theirs")
    script = start("--address=127.0.0.1:1")  # somebody's driver of that head: not one of Ray's processes
    other_id = start(env={ops.HEAD_ENV: "0123abce"})
    record = tmp_path / "local-ray.json"
    monkeypatch.setenv("KVPOOL_LOCAL_RAY_RECORD", str(record))
    procs = (ours, by_env, client, theirs, script, other_id)
    try:
        assert ops.stop_started_ray() == []  # no record: it started no Ray, it stops none
        record.write_text(json.dumps({"address": "127.0.0.1:1", "session_dir": session, "head_id": "0123abcd"}))
        stopped = ops.stop_started_ray(grace_s=5)
        assert sorted(stopped) == sorted([f"{ours.pid} python", f"{by_env.pid} python",
                                          f"{client.pid} ray client server"]), stopped
        for p in (ours, by_env, client):
            assert p.wait(timeout=10) is not None
        assert all(p.poll() is None for p in (theirs, script, other_id))
        assert not record.exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_down_says_what_it_stopped_when_the_pool_does_not_answer(tmp_path, monkeypatch, capsys):
    """`kvpool down --stop-ray` with no pool to drain (its head's GCS gone): it still stops the head's
    processes, and says which on stderr before the error."""
    from kvpool.cluster import ops

    session = str(tmp_path / "session_of_ours")
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"--session-dir={session}"])
    record = tmp_path / "local-ray.json"
    record.write_text(json.dumps({"address": "127.0.0.1:1", "session_dir": session}))  # nothing answers there
    monkeypatch.setenv("KVPOOL_LOCAL_RAY_RECORD", str(record))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        with pytest.raises(SystemExit, match="no pool is up"):
            ops.cmd_down(None, stop_ray=True)
        err = capsys.readouterr().err
        assert f"stopped the Ray head `kvpool up` started: 1 processes\n  {ours.pid} python" in err, err
        assert ours.wait(timeout=10) is not None and not record.exists()
    finally:
        ours.kill()
        ours.wait()

