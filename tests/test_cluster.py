"""The pool on a real 3-node Ray cluster on this machine (ray.cluster_utils.Cluster), one per
module: placement, same-node shared memory vs Ray transport, a node removed during traffic, a
node added."""

import os
import threading
import time

import numpy as np
import pytest
import ray
from conftest import make_keys, payload, scrape_metrics, wait_for
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.cluster.bootstrap import shard_id_of, up
from kvpool.cluster.client import PoolClient
from kvpool.cluster.controller import CONTROLLER
from kvpool.cluster.local import local_cluster
from kvpool.cluster.ring import HashRing

PAGE = 4096
TIMEOUT = 2.0


@pytest.fixture(scope="module")
def cluster():
    # Ray's workers import this module's actor classes: let them find tests/.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    fast = {"health_check_failure_threshold": 2, "health_check_period_ms": 500, "health_check_initial_delay_ms": 0,
            "metrics_report_interval_ms": 1000}
    with local_cluster(3, namespace="kvpool-test", system_config=fast) as (c, nodes):
        state = up(store={"page_bytes": PAGE, "dram_pages": 256}, tenants=[{"id": "a"}, {"id": "b"}], ttl_s=2.0,
                   controller_interval_s=0.5)
        assert len(state["shards"]) == 3
        yield c, nodes


@pytest.fixture(scope="module")
def client(cluster):
    cl = PoolClient(timeout_s=TIMEOUT)
    yield cl
    cl.close()


def truth(i):
    return payload(i, PAGE)


@ray.remote(num_cpus=0)
class RemoteClient:
    """A client living on another node."""

    def __init__(self):
        self.c = PoolClient(timeout_s=TIMEOUT)

    def node(self):
        return ray.get_runtime_context().get_node_id()

    def put(self, tenant, keys, seeds):
        return self.c.put(tenant, keys, [truth(s) for s in seeds])

    def get(self, tenant, keys):
        return self.c.get(tenant, keys), dict(self.c.counts)


def test_chunks_spread_over_every_shard_within_the_bounded_load(client):
    keys = make_keys(300, seed=1)
    assert client.put("a", keys, [truth(i) for i in range(300)]) == 300
    hit = client.lookup("a", keys)
    assert hit.count == 300
    per = {s: hit.shards.count(s) for s in set(hit.shards)}
    assert len(per) == 3
    assert max(per.values()) <= client.ring.bound(max(per, key=per.get), 300)
    got = client.get("a", keys)
    assert len(got) == 300 and all(np.array_equal(g, truth(i)) for i, g in enumerate(got))
    assert client.counts["get_shm"] >= 1 and client.counts["get_ray"] >= 1  # both transports used


def test_put_on_one_node_get_from_another(cluster, client):
    c, nodes = cluster
    remote = RemoteClient.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[0].node_id, soft=False)).remote()
    assert ray.get(remote.node.remote()) != client.node_id
    keys = make_keys(40, seed=2)
    assert ray.get(remote.put.remote("a", keys, list(range(1000, 1040))), timeout=60) == 40
    got = client.get("a", keys)
    assert len(got) == 40 and all(np.array_equal(g, truth(1000 + i)) for i, g in enumerate(got))
    back, counts = ray.get(remote.get.remote("a", keys), timeout=60)
    assert len(back) == 40 and counts["get_shm"] >= 1  # its own node's shard through shared memory


def test_tenants_never_read_each_others_chunks(client):
    keys = make_keys(10, seed=3)
    client.put("a", keys, [truth(i) for i in range(10)])
    assert client.get("b", keys) == []


def test_a_request_in_flight_keeps_its_chunks_on_every_shard_until_it_ends(client):
    keys, others = make_keys(30, seed=11), make_keys(30, seed=12)
    assert client.put("a", keys, [truth(i) for i in range(30)]) == 30
    assert client.put("a", others, [truth(i) for i in range(30)]) == 30
    req = client.begin("a", keys)
    assert req.hit_chunks == 30 and set(req.shard_requests) == set(client.lookup("a", keys).shards)
    assert len(req.shard_requests) >= 2  # the leases span shards
    flood = make_keys(3 * 256 + 100, seed=13)  # more than every shard's DRAM together
    for i in range(0, len(flood), 64):  # in batches, like engines (a batch never evicts itself)
        client.put("b", flood[i : i + 64], [truth(j) for j in range(i, min(i + 64, len(flood)))])
    got = client.get("a", keys)
    assert len(got) == 30 and all(np.array_equal(g, truth(i)) for i, g in enumerate(got))
    assert len(client.get("a", others)) < 30  # the same age, not leased: the flood took them
    handles = dict(client._handles)
    client.end(req)
    assert req.shard_requests == {}
    wait_for(lambda: not any(ray.get(h.requests.remote()) for h in handles.values()), 5, interval_s=0.05,
             what="every shard to release the request's leases")  # end is fire and forget


def test_adding_a_node_moves_about_a_quarter_of_placements_and_old_data_still_hits(cluster, client):
    c, nodes = cluster
    keys = make_keys(200, seed=4)
    client.put("a", keys, [truth(i) for i in range(200)])
    before = HashRing.from_dict(client.ring.to_dict())
    new = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    up(store={"page_bytes": PAGE, "dram_pages": 256}, tenants=[{"id": "a"}, {"id": "b"}], ttl_s=2.0)
    # the client follows the controller's ring by long poll
    wait_for(lambda: len(client.ring) >= 4, 10, what="the client's ring to take in the new shard")
    assert len(client.ring) == 4
    probe = make_keys(4000, seed=5, chunk_tokens=1)
    moved = sum(before.owners(bytes(k)) != client.ring.owners(bytes(k)) for k in probe) / len(probe)
    assert 0.15 < moved < 0.35
    got = client.get("a", keys)  # placed before the change: found through the index
    assert len(got) == 200 and all(np.array_equal(g, truth(i)) for i, g in enumerate(got))
    cluster[1].append(new)


def test_metrics_reach_the_prometheus_endpoint_with_their_labels(cluster, client):
    keys = make_keys(5, seed=8)
    client.put("a", keys, [truth(i) for i in range(5)])
    client.get("a", keys)
    controller = ray.get_actor(CONTROLLER)
    shards = ray.get(controller.state.remote())["shards"]
    from kvpool.cluster.shard import shard_name

    for sid in shards:
        ray.get(ray.get_actor(shard_name("default", sid)).export_metrics.remote(), timeout=10)
    text = scrape_metrics(["ray_kvpool_puts_total", "ray_kvpool_hits_chunks_total"], timeout_s=40)
    assert "ray_kvpool_puts_total" in text
    line = next(l for l in text.splitlines() if l.startswith("ray_kvpool_hits_chunks_total"))
    assert 'tenant="a"' in line and 'shard="node-' in line
    assert "ray_kvpool_bytes" in text and 'tier="dram"' in text
    assert "ray_kvpool_get_latency_ms_bucket" in text


def test_draining_a_shard_turns_its_chunks_into_misses_and_takes_it_out_of_the_ring(cluster, client):
    c, nodes = cluster
    keys = make_keys(60, seed=9)
    client.put("a", keys, [truth(i) for i in range(60)])
    hit = client.lookup("a", keys)
    victim = shard_id_of(nodes[-1].node_id)  # the node added above
    assert victim in hit.shards  # 60 chunks over 4 shards: some land there
    first = hit.shards.index(victim)
    req = client.begin("a", keys)  # a request in flight holds chunks there: draining still works
    assert victim in req.shard_requests
    controller = ray.get_actor(CONTROLLER)
    n = ray.get(controller.drain.remote(victim), timeout=60)
    assert n >= 1
    client.end(req)
    assert client.lookup("a", keys).count == first
    got = client.get("a", keys)
    assert len(got) == first and all(np.array_equal(g, truth(i)) for i, g in enumerate(got))
    wait_for(lambda: victim not in client.ring.weights, 10, what=f"the drained shard {victim} to leave the ring")


def test_replicas_serve_what_a_dead_shard_held(cluster, client):
    c, nodes = cluster
    rc = PoolClient(timeout_s=TIMEOUT, replicas=2, refresh=False)
    keys = make_keys(40, seed=10)
    assert rc.put("a", keys, [truth(i) for i in range(40)]) == 80  # two copies of each
    hit = rc.lookup("a", keys)
    local = shard_id_of(rc.node_id)
    # The index names whichever copy was published first (the local one, when there is one):
    # take the remote shard it names most.
    remote = [s for s in hit.shards if s != local]
    assert remote, hit.shards
    victim = max(set(remote), key=remote.count)
    from kvpool.cluster.shard import shard_name

    ray.kill(ray.get_actor(shard_name("default", victim)))
    got = rc.get("a", keys, hit)  # the index still names the dead shard: replicas answer
    assert len(got) == 40 and all(np.array_equal(g, truth(i)) for i, g in enumerate(got))
    assert rc.counts["get_replica"] >= hit.shards.count(victim)
    # the controller notices the dead shard and drops it
    wait_for(lambda: victim not in client.ring.weights, 15, interval_s=0.2,
             what=f"the dead shard {victim} to leave the ring")
    # Its index entries are purged; the replicas' periodic reconcile publishes their copies again.
    wait_for(lambda: rc.lookup("a", keys).count >= 40, 20, interval_s=0.5, what="a lookup to find all 40 chunks again")
    hit = rc.lookup("a", keys)
    assert hit.count == 40 and victim not in hit.shards
    rc.close()


def test_a_node_removed_during_traffic_means_misses_never_wrong_bytes_or_hangs(cluster, client):
    c, nodes = cluster
    keys = make_keys(120, seed=6)
    assert client.put("a", keys, [truth(i) for i in range(120)]) == 120
    victim_node = next(n for n in nodes if shard_id_of(n.node_id) in client.ring.weights)  # a live worker
    victim = shard_id_of(victim_node.node_id)
    hit = client.lookup("a", keys)
    assert victim in hit.shards
    first_lost = hit.shards.index(victim)
    wrong, slow, reads = [], [], []  # reads: (when it started, chunks it returned)
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            t0 = time.monotonic()
            got = client.get("a", keys)
            dt = time.monotonic() - t0
            if dt > TIMEOUT + 1.5:
                slow.append(dt)
            reads.append((t0, len(got)))
            wrong.extend(i for i, g in enumerate(got) if not np.array_equal(g, truth(i)))

    controller = ray.get_actor(CONTROLLER)
    t = threading.Thread(target=reader)
    t.start()
    try:
        wait_for(lambda: len(reads) >= 3, 30, what="the reader's first reads, before the node goes")
        c.remove_node(victim_node, allow_graceful=False)
        # Traffic runs through the whole failure: the controller drops the dead shard, the index
        # purges its entries, and a read started after that has come back.
        wait_for(lambda: victim not in ray.get(controller.state.remote())["shards"], 25, interval_s=0.2,
                 what=f"the controller to drop the dead shard {victim}")
        wait_for(lambda: victim not in client.lookup("a", keys).shards, 15, interval_s=0.2,
                 what=f"the index to purge the entries of {victim}")
        settled = time.monotonic()
        wait_for(lambda: reads[-1][0] > settled, 30, what="a read started after the pool settled")
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive(), "the reader hung"
    assert wrong == [] and slow == []
    assert reads[-1][1] == first_lost  # the run now ends at the first chunk of the dead shard
    assert victim not in ray.get(controller.state.remote())["shards"]
    assert client.lookup("a", keys).count == first_lost  # its index entries were purged
