"""Attacks on the node path of a secured pool (issue 17 keeps issue 15's rules): the shard verifies
every credential on its socket and its peer port; the files engines map are the pool user's only.

What stays on trust, by design (docs/security.md): a process that can open the node's run dir
reads the shard's slab as the shard does, so the run dir is the node's trust boundary (the
operator's engines); payloads sealed with ``Tenant(encrypt=True)`` stay ciphertext there."""

from __future__ import annotations

import os
import stat

import pytest
import ray
from conftest import make_keys, payload, wait_for

from kvpool.auth import Authority, new_secret
from kvpool.cluster.bootstrap import shard_id_of, up
from kvpool.cluster.local import local_cluster
from kvpool.cluster.peers import PeerLinks
from kvpool.errors import Forbidden, Unauthorized
from kvpool.node.client import NodeClient

NS = "kvpool-node-attacks"
PAGE = 16 << 10
SECRET = new_secret()
AUTH = Authority(SECRET)
ALICE, BOB = AUTH.issue("alice"), AUTH.issue("bob")
FORGED = Authority(new_secret()).issue("alice")  # alice's name, another secret's mac


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("run"))
    old = os.environ.get("KVPOOL_RUN_DIR")
    os.environ["KVPOOL_RUN_DIR"] = run
    try:
        with local_cluster(1, namespace=NS):
            up(store={"page_bytes": PAGE, "dram_pages": 32}, tenants=[{"id": "alice"}, {"id": "bob"}],
               namespace=NS, ttl_s=2.0, secret=SECRET)
            sid = shard_id_of(ray.get_runtime_context().get_node_id())
            wait_for(lambda: os.path.exists(os.path.join(run, f"kvpool-default-{sid}.node")), 30, what="node file")
            c = NodeClient(directory=run, shard=sid)
            yield {"run": run, "sid": sid, "client": c}
            c.close()
    finally:
        if old is None:
            os.environ.pop("KVPOOL_RUN_DIR", None)
        else:
            os.environ["KVPOOL_RUN_DIR"] = old


def test_the_node_files_are_the_pool_users_alone(pool):
    names = [n for n in os.listdir(pool["run"]) if n.startswith("kvpool-default-")]
    assert {n.rsplit(".", 1)[1] for n in names} >= {"sock", "node", "kvtable"}
    for n in names:
        assert stat.S_IMODE(os.stat(os.path.join(pool["run"], n)).st_mode) == 0o600, n


def test_a_bare_name_or_a_forged_credential_is_refused_on_the_socket(pool):
    c = pool["client"]
    assert c.secured
    keys = make_keys(2, seed=1)
    for liar in ("alice", FORGED):
        with pytest.raises(Unauthorized):
            c.put(liar, keys, [payload(i, PAGE) for i in range(2)])
        with pytest.raises(Unauthorized):
            c.lookup(liar, make_keys(2, seed=99))  # not in this node's table: the shard is asked
        with pytest.raises(Unauthorized):
            c.begin(liar, keys)
    assert c.put(ALICE, keys, [payload(i, PAGE) for i in range(2)]) == 2  # nothing was written before
    assert [bytes(a) for a in c.get(ALICE, keys)] == [bytes(payload(i, PAGE)) for i in range(2)]


def test_another_tenants_credential_reads_nothing(pool):
    c = pool["client"]
    keys = make_keys(3, seed=2)
    assert c.put(ALICE, keys, [payload(i, PAGE) for i in range(3)]) == 3
    assert c.get(BOB, keys) == [] and c.lookup(BOB, keys).count == 0
    assert c._call("get", {"credential": BOB, "keys": [bytes(k) for k in keys]})[0]["count"] == 0


def test_the_peer_port_serves_only_the_pools_own_processes(pool):
    c = pool["client"]
    keys = make_keys(1, seed=3)
    assert c.put(ALICE, keys, [payload(0, PAGE)]) == 1
    peer = c._at.info["peer"]
    import time

    for who, err in ((ALICE, Forbidden), (FORGED, Unauthorized), ("", Unauthorized)):
        links = PeerLinks(who)  # a tenant, a forger, nobody: posing as a shard
        with pytest.raises(err):
            links.fetch(peer, ALICE, [bytes(keys[0])], False, time.monotonic() + 5)
        links.close()
    links = PeerLinks(AUTH.pool_credential())
    try:
        assert links.fetch(peer, BOB, [bytes(keys[0])], False, time.monotonic() + 5) == []  # bob's scope: nothing
        got = links.fetch(peer, ALICE, [bytes(keys[0])], False, time.monotonic() + 5)
        assert [bytes(a) for a in got] == [bytes(payload(0, PAGE))]
    finally:
        links.close()


def test_only_kvpool_engine_operations_answer_on_the_socket(pool):
    c = pool["client"]
    for op, args in (("drain", {"credential": ALICE}), ("__init__", {}), ("_spill", {"pages": 1})):
        with pytest.raises(Exception) as e:
            c._call(op, args)
        assert getattr(e.value, "status", None) == 400, (op, e.value)
    assert c.get(ALICE, make_keys(1, seed=3))  # still serving
