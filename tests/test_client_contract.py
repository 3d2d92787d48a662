"""The PoolClient contract under churn (docs/reliability.md): reads never raise (a failure is a
miss), every call finishes within its timeout whatever its round trips, bad input is a typed
error that changes nothing, an empty ring is an outage (503 on writes, a miss on reads). On a real
2-node Ray cluster: one shard on this node (shared memory), one over Ray."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import ray
import torch
from conftest import free_port, make_keys, payload

from kvpool import KVSpec, Tenant
from kvpool.cluster.bootstrap import up
from kvpool.cluster.client import PoolClient
from kvpool.cluster.client_state import RoundTrips
from kvpool.cluster.controller import CONTROLLER
from kvpool.cluster.local import local_cluster
from kvpool.cluster.pool import ClusterPool
from kvpool.cluster.ring import HashRing
from kvpool.cluster.shard import DRILLS_ENV, shard_name
from kvpool.errors import BadRequest, ChunkTooLarge, KvPoolError, Unavailable, UnknownTenant

NS = "kvpool-client-contract"
SPEC = KVSpec("client-contract/model", 2, 2, 8, dtype="float32", block_size=8, chunk_tokens=8)
PAGE = SPEC.chunk_nbytes
TIMEOUT = 2.0
SLACK = 1.0  # beyond the timeout, for scheduling on a busy 2-core machine (two round trips of
# a full timeout each, as before the fix, take >= 2 x TIMEOUT)


@pytest.fixture(scope="module")
def cluster():
    os.environ[DRILLS_ENV] = "1"  # this module's shards answer drills (stalls)
    try:
        with local_cluster(2, namespace=NS) as (c, nodes):
            up(store={"page_bytes": PAGE, "dram_pages": 256}, tenants=[{"id": "a"}], ttl_s=2.0, namespace=NS)
            yield c
    finally:
        os.environ.pop(DRILLS_ENV, None)


@pytest.fixture(scope="module")
def client(cluster):
    cl = PoolClient(timeout_s=TIMEOUT, namespace=NS, refresh=False)
    assert len(cl.shards) == 2 and len(cl._slabs) == 1  # one shard here, one over Ray
    yield cl
    cl.close()


_seeds = iter(range(1000, 10**6))


def fresh(n: int):
    return make_keys(n, seed=next(_seeds))


def truth(i: int) -> np.ndarray:
    return payload(i, PAGE)


def shard(sid):
    return ray.get_actor(shard_name("default", sid), namespace=NS)


def chunks_held(client) -> int:
    return sum(ray.get(shard(sid).stats.remote(), timeout=30)["chunks"] for sid in client.shards)


def state() -> dict:
    return ray.get(ray.get_actor(CONTROLLER, namespace=NS).state.remote(), timeout=30)


def without(st: dict, sids) -> dict:
    """``st`` with shards ``sids`` gone from the ring (a node left, the controller restarted)."""
    ring = HashRing.from_dict(st["ring"])
    for sid in sids:
        ring.remove(sid)
    shards = {k: v for k, v in st["shards"].items() if k not in sids}
    return {**st, "ring": ring.to_dict(), "shards": shards, "version": ring.version}


def test_ring_changes_mid_call_never_raise_anything_untyped(client):
    full = state()
    local = next(iter(client._slabs))
    states = [full, without(full, [local]), full, without(full, [s for s in full["shards"] if s != local]),
              full, without(full, list(full["shards"]))]
    base = fresh(8)
    assert client.put("a", base, [truth(i) for i in range(8)]) == 8
    errors: dict[str, int] = {}
    wrong = [0]
    ops = [0]
    stop = threading.Event()

    def hammer(seed: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                if n % 2:
                    got = client.get("a", base)
                    wrong[0] += sum(not np.array_equal(g, truth(i)) for i, g in enumerate(got))
                else:
                    client.put("a", make_keys(4, seed=seed * 100_000 + n), [truth(i) for i in range(4)])
            except KvPoolError as e:
                if not isinstance(e, Unavailable):  # an empty ring: 503 on writes
                    errors[repr(e)] = errors.get(repr(e), 0) + 1
            except Exception as e:  # noqa: BLE001 - what the contract forbids
                errors[repr(e)] = errors.get(repr(e), 0) + 1
            ops[0] += 1

    def churn() -> None:
        i = 0
        while not stop.is_set():
            client._apply(states[i % len(states)])
            i += 1
            time.sleep(0.001)

    threads = [threading.Thread(target=hammer, args=(s,), daemon=True) for s in range(3)]
    threads.append(threading.Thread(target=churn, daemon=True))
    for t in threads:
        t.start()
    time.sleep(6)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    client._apply(full)
    assert not any(t.is_alive() for t in threads)
    assert ops[0] > 50 and not errors and wrong[0] == 0, (ops[0], errors, wrong[0])
    assert len(client.get("a", base)) == 8


def test_an_empty_ring_is_unavailable_on_writes_and_a_miss_on_reads(client):
    keys = fresh(6)
    assert client.put("a", keys, [truth(i) for i in range(6)]) == 6
    full = state()
    client._apply(without(full, list(full["shards"])))
    try:
        with pytest.raises(Unavailable, match="no shards"):
            client.put("a", fresh(2), [truth(0), truth(1)])
        assert client.get("a", keys) == []
    finally:
        client._apply(full)
    assert len(client.get("a", keys)) == 6


def test_bad_input_on_writes_is_typed_and_changes_nothing(client):
    before = chunks_held(client)
    keys = fresh(4)
    with pytest.raises(UnknownTenant):
        client.put("nobody", keys, [truth(i) for i in range(4)])
    with pytest.raises(BadRequest, match="16 bytes"):
        client.put("a", [b"\x01" * (1 << 20)], [truth(0)])
    with pytest.raises(BadRequest, match="16 bytes"):
        client.put("a", [*keys[:2], b"short"], [truth(i) for i in range(3)])
    with pytest.raises(ChunkTooLarge):
        client.put("a", keys, [truth(0), truth(1), np.zeros(PAGE + 1, np.uint8), truth(3)])
    with pytest.raises(BadRequest, match="one payload per key"):
        client.put("a", keys, [truth(0)])
    assert chunks_held(client) == before
    assert client.get("a", keys) == []


def test_wrong_size_payloads_are_misses_never_errors(client):
    pool = ClusterPool(SPEC, client, [Tenant("a")])
    tokens = np.arange(5_000_000, 5_000_000 + 3 * SPEC.chunk_tokens)
    keys = pool.keys("a", tokens)
    assert client.put("a", keys, [np.ones(PAGE // 2, np.uint8)] * 3) == 3  # bytes of another layout
    assert pool.load("a", keys) == []
    kv = [torch.randn(SPEC.chunk_shape) for _ in range(3)]
    keys2 = pool.keys("a", tokens + 1)
    assert pool.save("a", keys2, kv) == 3
    assert all(torch.equal(a, b) for a, b in zip(pool.load("a", keys2), kv))
    # buffers smaller than the stored chunks: a miss where they are read, never an assertion
    small = [np.empty(PAGE // 2, np.uint8) for _ in keys2]
    assert len(client.get("a", keys2, outs=small)) <= 3


def test_a_client_with_a_dead_index_url_fails_at_construction_naming_it(cluster):
    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match=f"127.0.0.1:{url.split(':')[-1].split('/')[0]}"):
        PoolClient(index_url=url, timeout_s=TIMEOUT, namespace=NS, refresh=False)
    assert time.monotonic() - t0 < 10


def test_one_deadline_per_call_whatever_its_round_trips(cluster):
    # max_timeout_s = timeout_s: the call's timeout stays the configured one (no slow round trip
    # measured can stretch it), so what is measured here is the deadline itself
    client = PoolClient(timeout_s=TIMEOUT, namespace=NS, refresh=False, max_timeout_s=TIMEOUT)
    keys = fresh(16)
    assert client.put("a", keys, [truth(i) for i in range(16)]) == 16
    hit = client.lookup("a", keys)
    assert len(set(hit.shards)) == 2  # both shards hold some: a get waits on both
    sids = list(client.shards)
    try:
        for sid in sids:
            ray.get(shard(sid).inject.remote(stall_s=TIMEOUT * 3), timeout=30)
        times = {}
        for what, call in (("put", lambda: client.put("a", fresh(16), [truth(i) for i in range(16)])),
                           ("get", lambda: client.get("a", keys))):
            t0 = time.monotonic()
            call()
            times[what] = time.monotonic() - t0
    finally:
        for sid in sids:
            ray.get(shard(sid).inject.remote(stall_s=0), timeout=30)
    assert max(times.values()) <= TIMEOUT + SLACK, times


def test_call_timeouts_follow_measured_round_trips_within_their_bounds():
    rt = RoundTrips()
    assert rt.timeout(1.5, 3.0) == 1.5  # nothing measured: the configured timeout
    for _ in range(50):
        rt.observe(0.02)
    assert rt.timeout(1.5, 3.0) == 1.5  # fast round trips never shorten it
    for i in range(50):
        rt.observe(1.4 if i % 2 else 0.4)  # a loaded machine: round trips slow and uneven
    assert 1.5 < rt.timeout(1.5, 3.0) <= 3.0
    for _ in range(20):
        rt.observe(5.0)
    assert rt.timeout(1.5, 3.0) == 3.0  # never past the cap
    for _ in range(100):
        rt.observe(0.02)
    assert rt.timeout(1.5, 3.0) == 1.5  # and back when the load is gone
