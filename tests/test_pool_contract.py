"""One contract for both pools: every case runs on the in-process ``LocalPool`` and on a
``NodePool`` (the engines' client, through its node's shard) over a real 2-node pool, and must give the same results (hits, misses,
payloads of the wrong size, requests in flight, quotas, tenants, bad input)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import cluster_pool, wait_for

from kvpool import KVSpec, Tenant, TenantRegistry
from kvpool.errors import KvPoolError, LayoutMismatch, UnknownTenant
from kvpool.keys import ChunkKey
from kvpool.pool import LocalPool
from kvpool.protocol import Pool

SPEC = KVSpec("contract/model", 2, 2, 8, dtype="float32", block_size=8, chunk_tokens=8)
TENANTS = [Tenant("a"), Tenant("b"), Tenant("tight", quota_bytes=SPEC.chunk_nbytes + 1)]
PAGES = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with cluster_pool(str(tmp_path_factory.mktemp("run")), 2, "kvpool-contract",
                      store={"page_bytes": SPEC.chunk_nbytes, "dram_pages": PAGES},
                      tenants=[{"id": t.id, "quota_bytes": t.quota_bytes} for t in TENANTS], ttl_s=2.0) as cp:
        yield cp


@pytest.fixture(scope="module")
def node_pool(cluster):
    from kvpool.node.pool import NodePool

    client = cluster.client(timeout_s=5.0)
    yield NodePool(SPEC, client, TENANTS)
    client.close()


@pytest.fixture(params=["local", "cluster"])
def pool(request) -> Pool:
    if request.param == "local":
        return LocalPool.create(SPEC, TenantRegistry(list(TENANTS)), PAGES)
    return request.getfixturevalue("node_pool")


_prompts = iter(range(10**6))


def prompt(chunks: int, extra: int = 3) -> np.ndarray:
    """Tokens no other test of the module uses (the cluster pool lives for the module)."""
    base = next(_prompts) * 10_000
    return np.arange(base, base + chunks * SPEC.chunk_tokens + extra)


def kv(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.chunk_shape, generator=g) for _ in range(n)]


def raw_put(pool, tenant: str, keys, arrays) -> None:
    """Bytes written under keys without the pool's spec (another layout, or a bug)."""
    if isinstance(pool, LocalPool):
        pool.store.put_many(pool.addresses(tenant, keys), arrays, tenant)
    else:
        pool.client.put(tenant, keys, arrays)


def leased(pool) -> int:
    return sum(t["leased_pages"] for t in pool.stats()["tiers"].values())


def test_both_pools_follow_the_protocol(pool):
    assert isinstance(pool, Pool)


def test_saved_chunks_come_back_bit_for_bit_as_the_leading_run(pool):
    tokens = prompt(3)
    keys = pool.keys("a", tokens)
    chunks = kv(3, seed=1)
    assert len(keys) == 3 and pool.save("a", keys, chunks) == 3
    assert pool.lookup("a", keys) == 3 * SPEC.chunk_tokens
    assert all(torch.equal(x, y) for x, y in zip(pool.load("a", keys), chunks, strict=True))
    for view, want in zip(pool.load_views("a", keys), chunks, strict=True):  # valid until the next but one
        with view:
            assert torch.equal(view.kv, want)
    diverged = tokens.copy()
    diverged[2 * SPEC.chunk_tokens] += 1  # the third chunk differs: a run of two
    other = pool.keys("a", diverged)
    assert pool.lookup("a", other) == 2 * SPEC.chunk_tokens and len(pool.load("a", other)) == 2


def test_a_miss_is_an_empty_run_and_another_tenant_always_misses(pool):
    keys = pool.keys("a", prompt(2))
    assert pool.lookup("a", keys) == 0 and pool.load("a", keys) == [] and list(pool.load_views("a", keys)) == []
    pool.save("a", keys, kv(2, seed=2))
    assert pool.keys("b", prompt(0)) == [] and pool.lookup("b", pool.keys("b", np.arange(16))) == 0
    theirs = pool.keys("b", np.arange(10**8, 10**8 + 16))
    assert pool.load("b", keys) == []  # a's keys read as b: nothing (tenants never see each other's)
    assert theirs != keys[: len(theirs)]


def test_a_payload_of_another_size_is_a_miss_that_ends_the_run(pool):
    keys = pool.keys("a", prompt(3))
    pool.save("a", keys[:1], kv(1, seed=3))
    raw_put(pool, "a", keys[1:2], [np.zeros(SPEC.chunk_nbytes // 2, np.uint8)])
    pool.save("a", keys, kv(3, seed=3)[2:], start=2)
    assert len(pool.load("a", keys)) == 1 and len(list(pool.load_views("a", keys))) == 1


def test_a_requests_chunks_stay_leased_until_it_ends(pool):
    """(A cluster's ``end`` is fire and forget: its leases go within a moment, not at once.)"""
    wait_for(lambda: leased(pool) == 0, 5.0, what="no leases left by earlier reads")
    keys = pool.keys("a", prompt(3))
    request = pool.begin("a", keys)
    assert pool.save("a", keys, kv(3, seed=4), request=request) == 3
    assert leased(pool) == 3
    pool.end(request)
    wait_for(lambda: leased(pool) == 0, 5.0, what="the saved chunks unleased after end")
    request = pool.begin("a", keys)  # a later request leases the cached run while it loads
    assert leased(pool) == 3
    pool.end(request)
    wait_for(lambda: leased(pool) == 0, 5.0, what="the loaded run unleased after end")


def test_a_spent_quota_is_a_429_and_usage_never_passes_it(pool):
    """NOTE: LocalPool refuses the whole batch; the cluster charges each shard's part when it
    publishes, so a part on another shard may stay (usage still never passes the quota)."""
    keys = pool.keys("tight", prompt(2))
    with pytest.raises(KvPoolError) as e:
        pool.save("tight", keys, kv(2, seed=5))
    assert e.value.status == 429
    assert len(pool.load("tight", keys)) <= 1
    assert pool.stats()["tenants"]["tight"]["bytes"] <= SPEC.chunk_nbytes + 1


def test_bad_input_is_a_typed_error_that_changes_nothing(pool):
    keys = pool.keys("a", prompt(2))
    with pytest.raises(UnknownTenant):
        pool.keys("mallory", prompt(1))
    with pytest.raises(UnknownTenant):
        pool.load("mallory", keys)
    with pytest.raises(UnknownTenant):
        pool.save("mallory", keys, kv(2, seed=6))
    good, bad = kv(2, seed=6)
    with pytest.raises(LayoutMismatch, match="partial chunk"):
        pool.save("a", keys, [good, bad[:, :, :4]])
    with pytest.raises(LayoutMismatch, match="dtype"):
        pool.save("a", keys, [good, bad.half()])
    with pytest.raises(LayoutMismatch, match="only whole chunks"):
        pool.save("a", keys, kv(3, seed=6))
    assert pool.lookup("a", keys) == 0  # the good chunk before the bad one was not written either


def test_a_shard_and_a_client_of_other_wire_versions_refuse_each_other(node_pool, tmp_path):
    """What crosses the shard boundary is a versioned message: a shard refuses a request of
    another version with an error that says so (a write raises it to the caller; a read is a
    miss, as every failed read), and an engine does not use a shard whose node file names another."""
    import json
    import time

    from kvpool.node import messages as m
    from kvpool.node import wire
    from kvpool.node.client import NodeClient

    client = node_pool.client
    key = bytes(node_pool.keys("a", prompt(1))[0])
    ch = client._dial(client._attached().info["socket"], time.monotonic() + 5)
    for msg in (m.Reserve("a", [key], sizes=[SPEC.chunk_nbytes]), m.Get("a", [key]), m.Lookup("a", [key])):
        ch.send([msg.OP, 99, msg.encode(), 5.0, []], deadline=time.monotonic() + 5)
        ok, err, _ = ch.recv_header(deadline=time.monotonic() + 5)
        assert not ok
        with pytest.raises(m.WireMismatch, match=f"wire version {m.WIRE_VERSION} but got {msg.OP} of version 99"):
            raise wire.decode_error(err)
    ch.close()
    assert node_pool.lookup("a", [ChunkKey(key)]) == 0  # nothing was written by the refused calls
    info = dict(client._attached().info, wire=99)
    (tmp_path / "kvpool-default-x.node").write_text(json.dumps(info))
    other = NodeClient(directory=str(tmp_path))
    assert other.shards == {} and other.counts["wire_mismatch"] == 1
    other.close()


def test_a_production_shard_answers_no_drill(cluster):
    """Stalling a shard, listing what it holds and locating a chunk in its slab are drills: a
    shard started without KVPOOL_DRILLS=1 refuses them (403), whoever asks."""
    import ray

    from kvpool.errors import Forbidden

    shard = cluster.actor(0)
    for call in (shard.inject.remote(stall_s=5.0), shard.held.remote(), shard.locate.remote(b"k" * 16)):
        with pytest.raises(Forbidden, match="KVPOOL_DRILLS=1"):
            ray.get(call, timeout=10)
