"""The engine client's contract under faults (docs/reliability.md): reads never raise (a failure is
a miss), every call finishes within its timeout whatever the shards behind it do, bad input is a
typed error that changes nothing. On a real 2-node pool: the client on the head's node, some
chunks on the other node (read through the head's shard and the other's peer port)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray
import torch
from conftest import cluster_pool, make_keys, payload, wait_for

from kvpool import KVSpec, Tenant
from kvpool.cluster.shard import DRILLS_ENV
from kvpool.errors import BadRequest, ChunkTooLarge, Unavailable, UnknownTenant
from kvpool.node.messages import Hello
from kvpool.node.pool import NodePool

NS = "kvpool-client-contract"
SPEC = KVSpec("client-contract/model", 2, 2, 8, dtype="float32", block_size=8, chunk_tokens=8)
PAGE = SPEC.chunk_nbytes
TIMEOUT = 2.0
SLACK = 1.0  # beyond the timeout, for scheduling on a busy 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(DRILLS_ENV, "1")  # this module's shards answer drills (stalls)
    try:
        with cluster_pool(str(tmp_path_factory.mktemp("run")), 2, NS, store={"page_bytes": PAGE, "dram_pages": 8192},
                          tenants=[{"id": "a"}], ttl_s=2.0) as cp:
            yield cp
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def client(cluster):
    cl = cluster.client(timeout_s=TIMEOUT)
    yield cl
    cl.close()


_seeds = iter(range(1000, 10**6))


def fresh(n: int):
    return make_keys(n, seed=next(_seeds))


def truth(i: int) -> np.ndarray:
    return payload(i, PAGE)


def chunks_held(cluster) -> int:
    return sum(ray.get(cluster.actor(sid).stats.remote(), timeout=30)["chunks"] for sid in cluster.shards)


def stall(cluster, s: float) -> None:
    for sid in cluster.shards:
        ray.get(cluster.actor(sid).inject.remote(stall_s=s), timeout=30)


def spread(cluster, client, n: int):
    """``n`` chunks, the first half on this node, the rest on the other one (its engine wrote them)."""
    keys = fresh(n)
    other = cluster.client(1, timeout_s=TIMEOUT)
    try:
        assert client.put("a", keys[: n // 2], [truth(i) for i in range(n // 2)]) == n // 2
        assert other.put("a", keys[n // 2:], [truth(i) for i in range(n // 2, n)]) == n - n // 2
    finally:
        other.close()
    wait_for(lambda: client.lookup("a", keys).count == n, 10, what="the other node's chunks listed in the index")
    return keys


def test_a_stalling_peer_never_raises_anything_untyped_nor_gives_wrong_bytes(cluster, client):
    base = spread(cluster, client, 8)
    errors: dict[str, int] = {}
    wrong, ops = [0], [0]
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
            except Exception as e:  # noqa: BLE001 - what the contract forbids
                errors[repr(e)] = errors.get(repr(e), 0) + 1
            ops[0] += 1

    threads = [threading.Thread(target=hammer, args=(s,), daemon=True) for s in range(3)]
    for t in threads:
        t.start()
    other = cluster.actor(1)
    for i in range(6):  # the other node's shard answers late, then on time, ...
        ray.get(other.inject.remote(stall_s=TIMEOUT * 2 if i % 2 == 0 else 0), timeout=30)
        time.sleep(0.7)
    ray.get(other.inject.remote(stall_s=0), timeout=30)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert ops[0] > 20 and not errors and wrong[0] == 0, (ops[0], errors, wrong[0])
    assert len(client.get("a", base)) == 8


def test_bad_input_on_writes_is_typed_and_changes_nothing(cluster, client):
    before = chunks_held(cluster)
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
    assert chunks_held(cluster) == before
    assert client.get("a", keys) == []


def test_wrong_size_payloads_are_misses_never_errors(client):
    pool = NodePool(SPEC, client, [Tenant("a")])
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


def test_one_deadline_per_call_whatever_the_shards_behind_it_do(cluster, client):
    keys = spread(cluster, client, 16)
    hit = client.lookup("a", keys)
    assert hit.count == 16 and len(set(hit.shards)) == 2  # both shards hold some: a get waits on both
    try:
        stall(cluster, TIMEOUT * 3)
        times, got = {}, {}
        for what, call in (("put", lambda: client.put("a", fresh(16), [truth(i) for i in range(16)])),
                           ("get", lambda: client.get("a", keys)), ("lookup", lambda: client.lookup("a", fresh(2)))):
            t0 = time.monotonic()
            got[what] = call()
            times[what] = time.monotonic() - t0
    finally:
        stall(cluster, 0)
    assert max(times.values()) <= TIMEOUT + SLACK, times
    # its own shard stalled: the engine stops using it for retry_s (its half is a miss), never waits again
    assert got["put"] == 0 and got["get"] == [] and got["lookup"].count == 0
    assert client.counts["put_failed"] >= 1


def test_a_pool_that_is_gone_is_a_miss_and_a_failed_write(tmp_path):
    """An engine whose node has no shard (never started, or gone): misses and writes that store
    nothing, each within the call's timeout, and the reason in its counts."""
    from kvpool.node.client import NodeClient

    c = NodeClient(directory=str(tmp_path), timeout_s=TIMEOUT)
    t0 = time.monotonic()
    keys = fresh(2)
    assert c.get("a", keys) == [] and c.lookup("a", keys).count == 0
    assert c.put("a", keys, [truth(0), truth(1)]) == 0
    with pytest.raises(Unavailable, match="no shard"):
        c.call(Hello())
    assert time.monotonic() - t0 < TIMEOUT and c.counts["connect_failed"] >= 1
    c.close()
