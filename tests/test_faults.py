"""Fault injection on a real pool: a 3-node Ray cluster on this machine, its index in a Redis
server of the test's own. For each fault: traffic runs through it, every get is checked against
the ground truth, no call outlives its timeout, the pool recovers (hits return) and the index
converges on what the shards hold. Each test prints a FIGURES line (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import threading
import time
from functools import partial

import numpy as np
import pytest
import ray
from conftest import OwnRedis, cluster_pool, make_keys, payload, wait_for

from kvpool.cluster.bootstrap import shard_id_of
from kvpool.cluster.shard import DRILLS_ENV
from kvpool.errors import KvPoolError
from kvpool.index import open_index

PAGE = 4096
TIMEOUT = 1.5
SLACK = 1.5  # what a call may take beyond its timeout on a busy 2-core machine


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    r = OwnRedis(tmp_path_factory.mktemp("redis"))
    yield r
    r.kill()


@pytest.fixture(scope="module")
def cluster(redis, tmp_path_factory):
    fast = {"health_check_failure_threshold": 2, "health_check_period_ms": 500, "health_check_initial_delay_ms": 0}
    mp = pytest.MonkeyPatch()
    mp.setenv(DRILLS_ENV, "1")  # this module's shards answer drills (stalls, locate, held)
    try:
        with cluster_pool(str(tmp_path_factory.mktemp("run")), 3, "kvpool-faults", system_config=fast,
                          store={"page_bytes": PAGE, "dram_pages": 128}, tenants=[{"id": "a"}], index_url=redis.url,
                          ttl_s=1.5, controller_interval_s=0.5) as cp:
            yield cp
    finally:
        mp.undo()  # later modules' shards answer no drill


@pytest.fixture(scope="module")
def client(cluster):
    cl = cluster.client(timeout_s=TIMEOUT)  # the engine on the head's node
    yield cl
    cl.close()


@pytest.fixture(scope="module")
def index(redis):
    idx = open_index(redis.url)
    yield idx
    idx.close()


def truth(i):
    return payload(i, PAGE)


def members(cluster) -> list[str]:
    return list(ray.get(cluster.controller().state.remote(), timeout=10)["shards"])


def report(name: str, **figures) -> None:
    line = json.dumps({"test": name, **figures}, sort_keys=True)
    print("FIGURES", line)
    out = os.environ.get("KVPOOL_RELIABILITY_JSON")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


class Traffic:
    """Readers (and optionally writers) in threads; every chunk read is compared with the truth."""

    def __init__(self, client, keys, *, writers: bool = False) -> None:
        self.client, self.keys, self.writers = client, keys, writers
        self.ops = self.wrong = 0
        self.max_s = 0.0
        self.errors: dict[str, int] = {}
        self.lengths: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._read, daemon=True)]
        if writers:
            self._threads.append(threading.Thread(target=self._write, daemon=True))

    def _time(self, fn):
        t0 = time.monotonic()
        try:
            return fn()
        except KvPoolError as e:
            self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1
        finally:
            dt = time.monotonic() - t0
            self.max_s = max(self.max_s, dt)
            self.ops += 1

    def _read(self) -> None:
        while not self._stop.is_set():
            got = self._time(lambda: self.client.get("a", self.keys)) or []
            self.wrong += sum(not np.array_equal(g, truth(i)) for i, g in enumerate(got))
            self.lengths.append((time.monotonic(), len(got)))

    def _write(self) -> None:
        n = 0
        while not self._stop.is_set():
            ks = make_keys(4, seed=10_000 + n)
            self._time(partial(self.client.put, "a", ks, [truth(i) for i in range(4)]))
            n += 1

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self._threads), "a traffic thread hung"

    def first_full_after(self, t0: float) -> float | None:
        """Seconds from t0 to the first read that returned every chunk again."""
        for t, n in self.lengths:
            if t > t0 and n == len(self.keys):
                return t - t0
        return None


# What a probe of the pool may raise while it settles (an actor restarting under it): "not yet".
SETTLING = (ray.exceptions.RayError, KvPoolError)


def converged(cluster, index) -> bool:
    """The index names no chunk a live shard does not hold, and every chunk held is listed."""
    held_all, listed_all = set(), set()
    for sid in members(cluster):
        held = set(ray.get(cluster.actor(sid).held.remote(), timeout=10))
        listed = {bytes(k) for k in index.shard_keys(sid)}
        if not listed <= held:
            return False
        held_all |= held
        listed_all |= listed
    return held_all <= listed_all


def put_all(client, keys, first=0):
    assert client.put("a", keys, [truth(first + i) for i in range(len(keys))]) == len(keys)


def put_spread(cluster, client, keys, where: int = 1):
    """The first half of ``keys`` on this node, the rest on node ``where`` (its engine wrote them)."""
    half = len(keys) // 2
    put_all(client, keys[:half])
    other = cluster.client(where, timeout_s=TIMEOUT)
    try:
        put_all(other, keys[half:], half)
    finally:
        other.close()
    wait_for(lambda: client.lookup("a", keys).count == len(keys), 10, what="every chunk listed")
    return half


def test_a_stalled_shard_turns_into_misses_within_the_timeout(cluster, client):
    keys = make_keys(60, seed=1)
    first = put_spread(cluster, client, keys)
    victim = cluster.actor(1)  # reached through this node's shard and its peer port
    with Traffic(client, keys) as tr:
        time.sleep(0.5)
        ray.get(victim.inject.remote(stall_s=TIMEOUT * 3), timeout=10)
        time.sleep(4)
        ray.get(victim.inject.remote(stall_s=0), timeout=10)
        cleared = time.monotonic()
        recovery = wait_for(lambda: tr.first_full_after(cleared) is not None, 20, interval_s=0.2, ignore=SETTLING,
                            what="a read returning every chunk after the stall cleared")
    assert tr.wrong == 0 and tr.max_s <= TIMEOUT + SLACK, (tr.wrong, tr.max_s)
    assert any(n == first for _, n in tr.lengths)  # while stalled, the run ended at its chunks
    report("stalled shard", ops=tr.ops, wrong_bytes=tr.wrong, max_call_s=round(tr.max_s, 2), timeout_s=TIMEOUT,
           recovery_s=round(recovery, 2))


def test_a_corrupted_payload_is_a_miss_never_wrong_bytes(cluster, client, index):
    keys = make_keys(20, seed=2)
    put_all(client, keys)
    i = 7
    tier, offset, nbytes = ray.get(cluster.actor(0).locate.remote(bytes(client.addresses("a", keys)[i])), timeout=10)
    assert tier == "dram"
    client._attached().slab.buf[offset + nbytes // 2] ^= 0xFF  # a flipped byte in the shared slab
    got = client.get("a", keys)
    assert len(got) == i and all(np.array_equal(g, truth(j)) for j, g in enumerate(got))
    assert client.counts["corrupt_dropped"] == 1  # the engine told the shard, which checked it itself
    # The shard dropped it and the index forgets it: the next lookup stops there too.
    wait_for(lambda: client.lookup("a", keys).count == i, 10, interval_s=0.2, ignore=SETTLING,
             what=f"the index to forget the corrupted chunk (a lookup of {i} chunks)")
    assert client.put("a", [keys[i]], [truth(i)], first_position=i) == 1  # recomputed and saved again
    got = client.get("a", keys)
    assert len(got) == 20 and all(np.array_equal(g, truth(j)) for j, g in enumerate(got))
    wait_for(lambda: converged(cluster, index), 15, interval_s=0.2, ignore=SETTLING, what="the index to converge")
    report("corrupted payload", ops=3, wrong_bytes=0, detected="checksum at read", recovery="re-put")


def test_a_full_shard_refuses_or_evicts_and_never_serves_wrong_bytes(cluster, client, index):
    keys = make_keys(30, seed=3)
    put_all(client, keys)
    req = client.begin("a", keys)  # a request in flight holds them
    flood = make_keys(3 * 128 + 60, seed=4)
    refused = stored = 0
    for i in range(0, len(flood), 32):
        try:
            stored += client.put("a", flood[i : i + 32], [truth(j) for j in range(i, min(i + 32, len(flood)))])
        except KvPoolError as e:  # a full pool: typed (507 full, 429 cancelled), never an untyped crash
            assert e.status in (429, 507), e
            refused += 1
    got = client.get("a", keys)
    assert len(got) == 30 and all(np.array_equal(g, truth(j)) for j, g in enumerate(got))  # leased: kept
    client.end(req)
    wait_for(lambda: converged(cluster, index), 15, interval_s=0.2, ignore=SETTLING, what="the index to converge")
    report("full shard", puts=len(flood), stored=stored, refused_batches=refused, leased_kept=30, wrong_bytes=0)


def test_redis_killed_and_restarted_means_misses_then_hits_again(cluster, client, redis, index):
    keys = make_keys(40, seed=5)
    half = put_spread(cluster, client, keys)
    with Traffic(client, keys, writers=True) as tr:
        time.sleep(0.5)
        redis.kill()
        time.sleep(3)
        down_lengths = [n for _, n in tr.lengths[-5:]]
        redis.start()  # empty: every shard must rejoin and republish what it holds
        restarted = time.monotonic()
        recovery = wait_for(lambda: tr.first_full_after(restarted) is not None, 30, interval_s=0.2, ignore=SETTLING,
                            what="a read returning every chunk after Redis restarted")
    assert tr.wrong == 0 and tr.max_s <= TIMEOUT + SLACK, (tr.wrong, tr.max_s)
    assert down_lengths and min(down_lengths) >= half  # no index: this node's chunks still hit, never errors
    converge = wait_for(lambda: converged(cluster, index), 30, interval_s=0.2, ignore=SETTLING,
                        what="the index to converge")
    report("Redis killed, restarted empty", ops=tr.ops, wrong_bytes=tr.wrong, max_call_s=round(tr.max_s, 2),
           errors=tr.errors, recovery_s=round(recovery, 2), index_converged_s=round(converge, 2))


def test_a_restarted_controller_adopts_the_shards_and_clients_carry_on(cluster, client):
    keys = make_keys(30, seed=6)
    put_spread(cluster, client, keys)
    controller = cluster.controller()
    before = set(ray.get(controller.state.remote(), timeout=10)["shards"])
    old = ray.get(controller.health.remote(), timeout=10)["incarnation"]

    def adopted_by_the_new_one() -> bool:  # not the old incarnation answering before the kill lands
        h = ray.get(controller.health.remote(), timeout=5)
        return h["incarnation"] != old and set(h["shards"]) == before

    with Traffic(client, keys) as tr:
        time.sleep(0.3)
        ray.kill(controller, no_restart=False)  # Ray restarts it, empty
        adopted = wait_for(adopted_by_the_new_one, 30, interval_s=0.2, ignore=SETTLING,
                           what="the restarted controller to adopt every shard")
        time.sleep(0.5)
    assert tr.wrong == 0 and tr.max_s <= TIMEOUT + SLACK
    assert all(n == 30 for _, n in tr.lengths)  # the data path never needed the controller
    fresh = cluster.client(2, timeout_s=TIMEOUT)  # an engine started after: reads the other nodes' chunks
    assert len(fresh.get("a", keys)) == 30
    fresh.close()
    report("controller restarted", ops=tr.ops, wrong_bytes=tr.wrong, max_call_s=round(tr.max_s, 2),
           adopted_s=round(adopted, 2), reads_short=sum(n != 30 for _, n in tr.lengths))


def test_a_node_killed_mid_traffic_means_misses_then_a_converged_index(cluster, client, index):
    keys = make_keys(80, seed=7)
    first = put_spread(cluster, client, keys, where=2)
    hit = client.lookup("a", keys)
    victim_node = cluster.workers[1]
    victim = shard_id_of(victim_node.node_id)
    assert hit.shards[first] == victim
    with Traffic(client, keys, writers=True) as tr:
        time.sleep(0.5)
        cluster.cluster.remove_node(victim_node, allow_graceful=False)
        dropped = wait_for(lambda: victim not in members(cluster), 30, interval_s=0.2, ignore=SETTLING,
                           what=f"the controller to drop the dead shard {victim}")
        purged = wait_for(lambda: not index.shard_keys(victim), 30, interval_s=0.2, ignore=SETTLING,
                          what=f"the index to purge every entry of {victim}")  # not just the run's
    assert tr.wrong == 0 and tr.max_s <= TIMEOUT + SLACK, (tr.wrong, tr.max_s)
    # The run ends at the dead shard's chunks at the latest (this node's own may have gone to the
    # writers' traffic meanwhile: evicted, as any old chunk).
    n = client.lookup("a", keys).count
    assert n <= first
    # Recompute and save the prompt: the lost chunks go to this node (or where it spills them), and
    # the whole prompt hits again (a batch never evicts itself).
    stored = client.put("a", keys, [truth(j) for j in range(80)])
    assert stored >= 80 - first
    got = client.get("a", keys)
    assert len(got) == 80 and all(np.array_equal(g, truth(j)) for j, g in enumerate(got))
    converge = wait_for(lambda: converged(cluster, index), 30, interval_s=0.2, ignore=SETTLING,
                        what="the index to converge")
    report("node killed mid-traffic", ops=tr.ops, wrong_bytes=tr.wrong, max_call_s=round(tr.max_s, 2),
           shard_dropped_s=round(dropped, 2), index_purged_s=round(purged + dropped, 2),
           index_converged_s=round(converge, 2), errors=tr.errors)
