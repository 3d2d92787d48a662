"""The pool on a real 3-node Ray cluster on this machine (ray.cluster_utils.Cluster), one per
module, reached as engines reach it: a NodeClient of each node's shard (no Ray in the engine).
Placement (the writer's node), reads across nodes, requests in flight, a node added, a node
drained, a node removed during traffic."""

import os
import threading
import time

import numpy as np
import pytest
import ray
from conftest import cluster_pool, make_keys, payload, scrape_metrics, wait_for

from kvpool.cluster.bootstrap import shard_id_of, up
from kvpool.cluster.members import LOADS_EVERY_S

PAGE = 4096
TIMEOUT = 2.0
UP = {"store": {"page_bytes": PAGE, "dram_pages": 256}, "tenants": [{"id": "a"}, {"id": "b"}], "ttl_s": 2.0,
      "controller_interval_s": 0.5}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    fast = {"health_check_failure_threshold": 2, "health_check_period_ms": 500, "health_check_initial_delay_ms": 0,
            "metrics_report_interval_ms": 1000}
    with cluster_pool(str(tmp_path_factory.mktemp("run")), 3, "kvpool-test", system_config=fast, **UP) as cp:
        yield cp


@pytest.fixture(scope="module")
def clients(cluster):
    cs = [cluster.client(i, timeout_s=TIMEOUT) for i in range(3)]
    yield cs
    for c in cs:
        c.close()


def truth(i):
    return payload(i, PAGE)


def exact(got, first=0):
    return all(np.array_equal(g, truth(first + i)) for i, g in enumerate(got))


def listed(client, keys, n=None):
    n = len(keys) if n is None else n
    wait_for(lambda: client.lookup("a", keys).count >= n, 10, what=f"{n} chunks listed in the index")


def test_chunks_stay_on_the_writers_node_and_every_node_reads_them(cluster, clients):
    written = []
    for i, c in enumerate(clients):
        keys = make_keys(20, seed=100 + i)
        assert c.put("a", keys, [truth(1000 * i + j) for j in range(20)]) == 20
        written.append(keys)
    for i, keys in enumerate(written):
        listed(clients[0], keys)
        assert set(clients[0].lookup("a", keys).shards) == {cluster.shards[i]}  # locality: the writer's node
    for reader in clients:
        for i, keys in enumerate(written):
            got = reader.get("a", keys)
            assert len(got) == 20 and exact(got, 1000 * i)
    assert clients[0].counts["get_shm"] >= 1 and clients[0].counts["get_remote"] >= 2  # both paths used


def test_tenants_never_read_each_others_chunks_on_any_node(clients):
    keys = make_keys(10, seed=3)
    assert clients[1].put("a", keys, [truth(i) for i in range(10)]) == 10
    listed(clients[0], keys)
    for c in clients:
        assert c.get("b", keys) == [] and c.lookup("b", keys).count == 0


def test_a_request_in_flight_keeps_its_chunks_on_every_shard_until_it_ends(cluster, clients):
    here, there = clients[0], clients[1]
    keys, others = make_keys(30, seed=11), make_keys(30, seed=12)
    assert here.put("a", keys[:15], [truth(i) for i in range(15)]) == 15
    assert there.put("a", keys[15:], [truth(i) for i in range(15, 30)]) == 15
    assert here.put("a", others, [truth(i) for i in range(30)]) == 30
    listed(here, keys)
    req = here.begin("a", keys)
    assert req.hit_chunks == 30 and set(req.shard_requests) == set(cluster.shards[:2])  # the leases span shards
    flood = make_keys(3 * 256 + 100, seed=13)  # more than every shard's DRAM together
    for i in range(0, len(flood), 64):  # in batches, like engines (a batch never evicts itself)
        for c in clients:
            c.put("b", flood[i: i + 64], [truth(j) for j in range(i, min(i + 64, len(flood)))])
    # NOTE: a full node sends new chunks to the shard with the most free pages by the others' loads it
    # last measured (every LOADS_EVERY_S): once every shard has measured every other full, each node's
    # own new chunks make its own shard evict
    time.sleep(2.5 * LOADS_EVERY_S)
    for n, c in enumerate(clients):
        more = make_keys(128, seed=20 + n)
        for i in range(0, len(more), 64):
            c.put("b", more[i: i + 64], [truth(j) for j in range(i, i + 64)])
    got = here.get("a", keys)
    assert len(got) == 30 and exact(got)
    assert len(here.get("a", others)) < 30  # the same age, not leased: the flood took them
    here.end(req)
    assert req.shard_requests == {}
    wait_for(lambda: not any(ray.get(cluster.actor(s).stats.remote())["active_requests"] for s in cluster.shards[:2]),
             5, interval_s=0.05, what="every shard to end the request")


def test_a_node_added_joins_and_old_chunks_still_hit_from_it(cluster, clients):
    keys = make_keys(50, seed=4)
    assert clients[0].put("a", keys, [truth(i) for i in range(50)]) == 50
    listed(clients[0], keys)
    new = cluster.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.cluster.wait_for_nodes()
    up(namespace=cluster.namespace, **UP)
    sid = shard_id_of(new.node_id)
    wait_for(lambda: sid in ray.get(cluster.controller().state.remote())["shards"], 30, what="the new shard a member")
    wait_for(lambda: os.path.exists(os.path.join(cluster.run, f"kvpool-default-{sid}.node")), 30,
             what="the new shard's node file")
    cluster.workers.append(new)
    cluster.shards.append(sid)
    c = cluster.client(sid, timeout_s=TIMEOUT)
    try:
        got = wait_for_run(c, keys)
        assert len(got) == 50 and exact(got)  # placed before it joined: read through the index and a peer
        fresh = make_keys(10, seed=14)
        assert c.put("a", fresh, [truth(i) for i in range(10)]) == 10
        listed(clients[0], fresh)
        assert set(clients[0].lookup("a", fresh).shards) == {sid} and exact(clients[0].get("a", fresh))
    finally:
        c.close()


def wait_for_run(c, keys):
    out = []
    wait_for(lambda: out.append(c.get("a", keys)) or len(out[-1]) == len(keys), 15, what="the whole run")
    return out[-1]


def test_metrics_reach_the_prometheus_endpoint_with_their_labels(cluster, clients):
    keys = make_keys(5, seed=8)
    clients[1].put("a", keys, [truth(i) for i in range(5)])
    listed(clients[0], keys)
    clients[0].get("a", keys)  # through the head's shard: counted there
    for sid in cluster.shards:
        ray.get(cluster.actor(sid).export_metrics.remote(), timeout=10)
    text = scrape_metrics(["ray_kvpool_puts_total", "ray_kvpool_hits_chunks_total"], timeout_s=40)
    assert "ray_kvpool_puts_total" in text
    line = next(line for line in text.splitlines() if line.startswith("ray_kvpool_hits_chunks_total"))
    assert 'tenant="a"' in line and 'shard="node-' in line
    assert "ray_kvpool_bytes" in text and 'tier="dram"' in text


def test_draining_a_shard_turns_its_chunks_into_misses_and_takes_it_out_of_the_pool(cluster, clients):
    victim = cluster.shards[-1]  # the node added above
    keys = make_keys(40, seed=9)
    assert clients[0].put("a", keys[:20], [truth(i) for i in range(20)]) == 20
    c = cluster.client(victim, timeout_s=TIMEOUT)
    assert c.put("a", keys[20:], [truth(i) for i in range(20, 40)]) == 20
    listed(clients[0], keys)
    req = c.begin("a", keys)  # a request in flight holds chunks there: draining still works
    assert victim in req.shard_requests
    n = ray.get(cluster.controller().drain.remote(victim), timeout=60)
    assert n >= 20
    c.end(req)  # its shard is gone: the request just ends
    c.close()
    assert clients[0].lookup("a", keys).count == 20
    got = clients[0].get("a", keys)
    assert len(got) == 20 and exact(got)
    wait_for(lambda: victim not in ray.get(cluster.controller().state.remote())["shards"], 10,
             what=f"the drained shard {victim} to leave the pool")
    cluster.shards.remove(victim)


def test_a_node_removed_during_traffic_means_misses_never_wrong_bytes_or_hangs(cluster, clients):
    victim_node = cluster.workers[0]
    victim = shard_id_of(victim_node.node_id)
    keys = make_keys(60, seed=6)
    assert clients[0].put("a", keys[:30], [truth(i) for i in range(30)]) == 30
    assert clients[1].put("a", keys[30:], [truth(i) for i in range(30, 60)]) == 30
    listed(clients[0], keys)
    assert clients[0].lookup("a", keys).shards[30] == victim
    reader = clients[0]
    wrong, slow, reads = [], [], []  # reads: (when it started, chunks it returned)
    stop = threading.Event()

    def read():
        while not stop.is_set():
            t0 = time.monotonic()
            got = reader.get("a", keys)
            dt = time.monotonic() - t0
            if dt > TIMEOUT + 1.5:
                slow.append(dt)
            reads.append((t0, len(got)))
            wrong.extend(i for i, g in enumerate(got) if not np.array_equal(g, truth(i)))

    t = threading.Thread(target=read)
    t.start()
    try:
        wait_for(lambda: len(reads) >= 3, 30, what="the reader's first reads, before the node goes")
        cluster.cluster.remove_node(victim_node, allow_graceful=False)
        # Traffic runs through the whole failure: the controller drops the dead shard, the index
        # purges its entries, and a read started after that has come back.
        wait_for(lambda: victim not in ray.get(cluster.controller().state.remote())["shards"], 25, interval_s=0.2,
                 what=f"the controller to drop the dead shard {victim}")
        wait_for(lambda: victim not in reader.lookup("a", keys).shards, 15, interval_s=0.2,
                 what=f"the index to purge the entries of {victim}")
        settled = time.monotonic()
        wait_for(lambda: reads[-1][0] > settled, 30, what="a read started after the pool settled")
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive(), "the reader hung"
    assert wrong == [] and slow == []
    assert reads[-1][1] == 30  # the run now ends at the first chunk of the dead shard
    assert reader.lookup("a", keys).count == 30  # its index entries were purged
