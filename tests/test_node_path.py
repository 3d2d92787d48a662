"""The node data path (issue 17): engines reach the pool through their node's shard, a Unix socket
and shared memory, never Ray. Two Ray nodes on this machine, a Redis index of the test's own;
``NodeClient`` is the engine's side (no Ray in it)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import ray
from conftest import OwnRedis, make_keys, payload, wait_for

from kvpool.cluster.bootstrap import shard_id_of, up
from kvpool.cluster.local import local_cluster
from kvpool.cluster.shard import shard_name
from kvpool.errors import BadRequest, ChunkTooLarge, QuotaExceeded
from kvpool.index.redis_index import RedisIndex
from kvpool.node.client import NodeClient
from kvpool.node.messages import PutStaged
from kvpool.node.paths import own_run_dir

NS = "kvpool-node-path"
PAGE = 64 << 10
UP = {"store": {"page_bytes": PAGE, "dram_pages": 64},
      "tenants": [{"id": "a"}, {"id": "b"}, {"id": "small", "quota_bytes": 4 * PAGE}],
      "ttl_s": 1.5, "controller_interval_s": 0.5, "namespace": NS}


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    r = OwnRedis(tmp_path_factory.mktemp("redis"))
    yield r
    r.kill()


@pytest.fixture(scope="module")
def pool(redis, tmp_path_factory):
    # the shards (started below) inherit the run dir
    with own_run_dir(str(tmp_path_factory.mktemp("run"))) as run, local_cluster(2, namespace=NS) as (c, nodes):
        up(index_url=redis.url, **UP)
        head = shard_id_of(ray.get_runtime_context().get_node_id())
        other = shard_id_of(nodes[0].node_id)
        wait_for(lambda: len([f for f in os.listdir(run) if f.endswith(".node")]) == 2, 30,
                 what="both shards' node files")
        yield {"run": run, "head": head, "other": other, "redis": redis}


def client(pool, which="head", **kw):
    return NodeClient(shard=pool[which], directory=pool["run"], **kw)


def ops(c: NodeClient) -> dict:
    """The time the shard spent in each operation but ``stats`` (the asking itself)."""
    return {k: v for k, v in c.shard_stats()["node_op_s"].items() if k != "stats"}


def test_a_same_node_hit_costs_no_call_and_is_exact(pool):
    c = client(pool)
    keys = make_keys(4, seed=1)
    data = [payload(i, PAGE) for i in range(4)]
    assert c.put("a", keys, data) == 4
    before = ops(c)
    got = c.get("a", keys)
    hit = c.lookup("a", keys)
    assert ops(c) == before  # neither the read nor the lookup reached the shard
    assert [bytes(g) for g in got] == [bytes(d) for d in data]
    assert hit.count == 4 and set(hit.shards) == {pool["head"]}
    outs = [np.zeros(PAGE, dtype=np.uint8) for _ in keys]
    got = c.get("a", keys, outs=outs)
    assert all(g.base is not None or g is o for g, o in zip(got, outs)) and bytes(outs[3]) == bytes(data[3])
    c.close()


def test_a_write_lands_on_the_writers_node_and_is_listed_in_the_index(pool):
    c = client(pool, "other")
    keys = make_keys(4, seed=2)
    assert c.put("a", keys, [payload(i, PAGE) for i in range(4)]) == 4
    idx = RedisIndex(pool["redis"].url)
    try:
        where = c.addresses("a", keys)
        wait_for(lambda: idx.lookup(where).count == 4, 5, what="the publisher lists the chunks")
        assert set(idx.lookup(where).shards) == {pool["other"]}  # all four on the writer's own node
    finally:
        idx.close()
    c.close()


def test_another_nodes_chunks_come_through_the_shard(pool):
    writer, reader = client(pool, "other"), client(pool, "head")
    keys = make_keys(3, seed=3)
    data = [payload(10 + i, PAGE) for i in range(3)]
    assert writer.put("a", keys, data) == 3
    wait_for(lambda: reader.lookup("a", keys).count == 3, 5, what="the index lists the other node's chunks")
    got = reader.get("a", keys)
    assert [bytes(g) for g in got] == [bytes(d) for d in data]
    assert reader.counts["get_remote"] >= 1
    assert reader.shard_stats()["peer_fetched"] >= 3  # straight from the other shard, not through Ray
    writer.close()
    reader.close()


def test_tenants_never_see_each_others_chunks_on_either_path(pool):
    c, far = client(pool), client(pool, "other")
    keys = make_keys(2, seed=4)
    assert c.put("a", keys, [payload(i, PAGE) for i in range(2)]) == 2
    time.sleep(0.3)  # published
    for who in (c, far):
        assert who.get("b", keys) == [] and who.lookup("b", keys).count == 0
    assert c.put("b", keys, [payload(99, PAGE)] * 2) == 2  # b's own chunks under the same keys
    assert bytes(c.get("a", keys)[0]) == bytes(payload(0, PAGE))
    assert bytes(c.get("b", keys)[0]) == bytes(payload(99, PAGE))
    c.close()
    far.close()


def test_bad_input_is_typed_and_a_tenants_quota_is_its_own_429(pool):
    c = client(pool)
    with pytest.raises(BadRequest):
        c.put("a", [b"short"], [payload(0, 10)])
    with pytest.raises(ChunkTooLarge):
        c.put("a", make_keys(1, seed=5), [np.zeros(PAGE + 1, dtype=np.uint8)])
    mine = make_keys(2, seed=50)
    assert c.put("a", mine, [payload(i, PAGE) for i in range(2)]) == 2
    with pytest.raises(QuotaExceeded):
        for i in range(20):  # the index refuses past 4 pages; the next write on this node is a 429
            c.put("small", make_keys(1, seed=100 + i), [payload(i, PAGE)])
            time.sleep(0.05)
    assert len(c.get("a", mine)) == 2  # another tenant's chunks unaffected
    c.close()


def test_a_dead_shard_is_a_fast_miss_and_its_restart_is_found(pool):
    c = client(pool, "other", timeout_s=1.0, retry_s=0.2)
    keys = make_keys(2, seed=6)
    assert c.put("a", keys, [payload(i, PAGE) for i in range(2)]) == 2
    ray.kill(ray.get_actor(shard_name("default", pool["other"]), namespace=NS), no_restart=True)
    wait_for(lambda: not os.path.exists(os.path.join(pool["run"], f"kvpool-default-{pool['other']}.sock"))
             or c.put("a", make_keys(1, seed=9), [payload(0, PAGE)]) == 0, 10, what="the shard gone")
    t0 = time.monotonic()
    for _ in range(5):
        assert c.put("a", make_keys(1, seed=7), [payload(0, PAGE)]) == 0
        c.get("a", keys)  # whatever the dead shard's memory still holds verifies, or is a miss
        assert c.lookup("a", make_keys(2, seed=8)).count == 0
    assert time.monotonic() - t0 < 5 * 3 * 1.0
    # it let go of the dead shard's memory (its lock on the table is gone), though no call failed
    wait_for(lambda: c.get("a", keys) == [] and c._at is None, 3, what="the dead shard's table let go")

    def restarted():  # once the controller dropped the dead shard, `up` places a new one there
        up(index_url=pool["redis"].url, **UP)
        return c.put("a", keys, [payload(i, PAGE) for i in range(2)]) == 2

    wait_for(restarted, 40, interval_s=1.0, what="a new shard on that node taking writes")
    assert [bytes(g) for g in c.get("a", keys)] == [bytes(payload(i, PAGE)) for i in range(2)]
    c.close()


def test_small_writes_go_through_the_connections_staging_file_in_one_call(pool):
    c = client(pool)
    keys = make_keys(3, seed=60)
    assert c.put("a", keys, [payload(i, PAGE) for i in range(3)]) == 3
    assert c.counts["put_staged"] == 1 and c.counts["put_shm"] == 0
    before = ops(c)
    assert c.put("a", make_keys(2, seed=61), [payload(i, PAGE) for i in range(2)]) == 2
    after = ops(c)
    assert set(after) - {"put_staged"} <= set(before) and after.get("reserve") == before.get("reserve")
    assert [bytes(a) for a in c.get("a", keys)] == [bytes(payload(i, PAGE)) for i in range(3)]
    stages = [ch.stage.path for ch in c._idle if getattr(ch, "stage", None) is not None]
    assert stages and all(os.stat(path).st_mode & 0o777 == 0o600 for path in stages)
    # the shard checks what the engine says about the staging file
    with pytest.raises(BadRequest, match="outside"):
        c.call(PutStaged("a", [bytes(make_keys(1, seed=62)[0])], sizes=[PAGE], offsets=[(8 << 20) - 16]))
    c.close()
    wait_for(lambda: not [path for path in stages if os.path.exists(path)], 5,
             what="the staging files removed with their connections")


def test_put_staged_needs_a_staging_file_first(pool):
    c = NodeClient(shard=pool["head"], directory=pool["run"])
    with pytest.raises(BadRequest, match="stage"):
        c.call(PutStaged("a", [bytes(make_keys(1, seed=63)[0])], sizes=[16], offsets=[0]))
    c.close()


def test_a_node_without_room_spills_to_the_one_with_room(pool):  # last: it fills the head node
    c = client(pool)
    free = lambda sid: ray.get(ray.get_actor(shard_name("default", sid), namespace=NS).free_pages.remote())  # noqa: E731
    n = 0
    while free(pool["head"]) >= 8:  # fill this node's DRAM
        assert c.put("b", make_keys(8, seed=1000 + n), [payload(i, PAGE) for i in range(8)]) == 8
        n += 1
    assert free(pool["other"]) >= 16
    idx = RedisIndex(pool["redis"].url)
    try:
        def spilled():
            keys = make_keys(8, seed=2000 + spilled.n)
            spilled.n += 1
            assert c.put("b", keys, [payload(i, PAGE) for i in range(8)]) == 8
            where = c.addresses("b", keys)
            wait_for(lambda: idx.lookup(where).count == 8, 5, what="listed")
            return set(idx.lookup(where).shards) == {pool["other"]}
        spilled.n = 0
        wait_for(spilled, 10, interval_s=0.5, what="a put spilled to the node with room")
    finally:
        idx.close()
    assert c.counts["put_forwarded"] >= 1
    c.close()


def test_a_tp2_engine_on_one_node_loads_the_slices_a_tp1_engine_saved_on_the_other(pool):
    """Chunks stored as per-head slices (kvpool.slices) through the node path: a TP=1 writer on one
    node, both ranks of a TP=2 reader on the other, each loading exactly its heads through the
    shard's peer port; a lookup counts a chunk only when every slice is listed."""
    import torch

    from kvpool.connectors.pools import node_pool, spec_for
    from kvpool.slices import Slicing
    from kvpool.tenants import Tenant

    spec = spec_for("node-path-tp", 2, 4, 32, "float32", chunk_tokens=32)  # a slice: 16 KiB, a page each
    tenants = [Tenant("a")]
    writer_client, reader_client = client(pool, "other"), client(pool, "head")
    writer = node_pool(spec, writer_client, tenants)
    readers = [node_pool(spec, reader_client, tenants, Slicing.of(spec, 2, r)) for r in (0, 1)]
    tokens = list(range(5000, 5000 + 3 * spec.chunk_tokens))
    keys = writer.keys("a", tokens)
    assert all(r.keys("a", tokens) == keys for r in readers)
    g = torch.Generator().manual_seed(17)
    chunks = [torch.randn(spec.chunk_shape, generator=g) for _ in keys]
    assert writer.save("a", keys[:2], chunks[:2]) == 2
    wait_for(lambda: readers[1].lookup("a", keys) == 2 * spec.chunk_tokens, 5, what="the index lists the slices")
    for r, reader in enumerate(readers):
        want = [c[..., 2 * r: 2 * r + 2, :] for c in chunks[:2]]
        got = []
        for view in reader.load_views_in_place("a", keys):
            with view:
                got.append(view.kv.clone())
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for a, b in zip(reader.load("a", keys), want))
    assert reader_client.counts["get_remote"] >= 1  # they came from the other node
    writer_client.close()
    reader_client.close()


def test_runs_longer_than_one_call_go_in_batches(pool, monkeypatch):
    """A lookup, read, write or pin of more keys than one call carries (a long prompt's per-head
    slices) goes batch by batch: here batches of 2 (instead of 2048), against the real shards."""
    from kvpool.node import client as node_client

    monkeypatch.setattr(node_client, "BATCH", 2)
    writer, reader = client(pool, "other"), client(pool, "head")
    keys = make_keys(5, seed=41)
    data = [payload(60 + i, PAGE) for i in range(5)]
    assert writer.put("a", keys[:4], data[:4]) == 4  # two batches
    wait_for(lambda: reader.lookup("a", keys).count == 4, 5, what="the index lists all four, batch by batch")
    assert reader.lookup("a", keys).shards == (pool["other"],) * 4
    got = reader.get("a", keys)  # the other node's chunks, two calls, then a miss
    assert [bytes(g) for g in got] == [bytes(d) for d in data[:4]]
    assert reader.lookup("a", [keys[4], *keys[:4]]).count == 0  # a miss in the first batch ends the run
    assert writer.pin("a", keys[:4]) == 0  # two calls, each answered (the default policy pins nothing)
    writer.close()
    reader.close()
