"""Attacks on the node path of a secured pool (issue 17 keeps issue 15's rules): the shard verifies
every credential on its socket and its peer port; the files engines map are the pool user's only.

What stays on trust, by design (docs/security.md): a process that can open the node's run dir
reads the shard's slab as the shard does, so the run dir is the node's trust boundary (the
operator's engines); payloads sealed with ``Tenant(encrypt=True)`` stay ciphertext there."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import cluster_pool, make_keys, payload, wait_for

from kvpool.auth import Authority, new_secret
from kvpool.cluster.peers import StreamTransport
from kvpool.errors import Forbidden, Unauthorized, Unavailable
from kvpool.node import messages as m
from kvpool.node import wire

NS = "kvpool-node-attacks"
PAGE = 16 << 10
SECRET = new_secret()
AUTH = Authority(SECRET)
ALICE, BOB = AUTH.issue("alice"), AUTH.issue("bob")
FORGED = Authority(new_secret()).issue("alice")  # alice's name, another secret's mac


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with cluster_pool(str(tmp_path_factory.mktemp("run")), 1, NS, store={"page_bytes": PAGE, "dram_pages": 32},
                      tenants=[{"id": "alice"}, {"id": "bob"}], ttl_s=2.0, secret=SECRET) as cp:
        c = cp.client()
        yield {"run": cp.run, "sid": cp.head, "client": c}
        c.close()


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
    assert c.call(m.Get(BOB, [bytes(k) for k in keys]))[0]["count"] == 0


def test_the_peer_port_serves_only_the_pools_own_processes(pool):
    c = pool["client"]
    keys = make_keys(1, seed=3)
    assert c.put(ALICE, keys, [payload(0, PAGE)]) == 1
    peer = c._at.info["peer"]
    import time

    def get(links, credential):
        return links.fetch(peer, m.PeerGet(links.credential, credential, [bytes(keys[0])]), time.monotonic() + 5)

    refused = c.shard_stats()["peer_refused_connections"]
    for who in (ALICE, FORGED, ""):  # a tenant, a forger, nobody, posing as a shard: hung up on unread
        links = StreamTransport(who)
        with pytest.raises(Unavailable):
            get(links, ALICE)
        for msg in (m.PeerPut(who, ALICE, [bytes(keys[0])]), m.PeerBegin(who, ALICE, [bytes(keys[0])]),
                    m.PeerEnd(who, ALICE, 1), m.PeerPin(who, ALICE, [bytes(keys[0])])):
            with pytest.raises(Unavailable):
                links.call(peer, msg, [payload(1, PAGE)] if msg.PAYLOADS else ())
        links.close()
    # counted by the port's connection threads once the dialer hung up: waited for, not raced
    wait_for(lambda: c.shard_stats()["peer_refused_connections"] == refused + 15, 10, what="15 openings refused")
    # the opening is checked before any header is read: a huge announced header is never allocated
    import socket as sk
    import struct

    host, port = peer.rsplit(":", 1)
    with sk.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack(">I", 64 << 20) + b"x" * (len(wire.PEER_MAGIC) + wire.PEER_NONCE))
        try:
            assert s.recv(1) == b""  # closed
        except ConnectionResetError:  # closed with our bytes unread
            pass
    wait_for(lambda: c.shard_stats()["peer_refused_connections"] == refused + 16, 10, what="the 16th refused")
    links = StreamTransport(AUTH.pool_credential())
    try:
        assert get(links, BOB) == []  # bob's scope: nothing
        got = get(links, ALICE)
        assert [bytes(a) for a in got] == [bytes(payload(0, PAGE))]
    finally:
        links.close()


def test_announced_bytes_are_refused_on_the_credential_and_never_kept(pool):
    """A request that carries payloads is refused on its credential alone: the shard reads the
    bytes into a scratch buffer it never keeps, answers the refusal and serves on; a caller that
    announces bytes and never sends them is hung up on within a few seconds."""
    import socket as sk
    import time

    import numpy as np

    c = pool["client"]
    key = [bytes(make_keys(1, seed=4)[0])]
    before = c.shard_stats()["chunks"]

    def dial(address):
        if address.startswith("/"):
            s = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
            s.connect(address)
            return s
        host, port = address.rsplit(":", 1)
        return sk.create_connection((host, int(port)), timeout=5)

    at = c._attached().info
    for address, msg, err in ((at["socket"], m.Put("alice", key), Unauthorized),
                              (at["peer"], m.PeerPut(ALICE, ALICE, key), Forbidden)):
        s = dial(address)
        if address == at["peer"]:  # the pool's opening: what follows is a request of the pool's own
            ch = wire.open_peer(s, AUTH.pool_credential(), deadline=time.monotonic() + 5)
        else:
            ch = wire.Channel(s)
        for _ in range(2):  # refused, and the stream still in step for the next request
            ch.send([msg.OP, m.WIRE_VERSION, msg.encode(), 5.0, [PAGE]], [np.ones(PAGE, np.uint8)],
                    deadline=time.monotonic() + 5)
            ok, e, _ = ch.recv_header(deadline=time.monotonic() + 5)
            assert not ok and isinstance(wire.decode_error(e), err)
        ch.send([msg.OP, m.WIRE_VERSION, msg.encode(), 5.0, [PAGE]], deadline=time.monotonic() + 5)  # no bytes
        s.settimeout(10)
        t0 = time.monotonic()
        assert s.recv(1) == b"" and time.monotonic() - t0 < 5  # hung up on, no answer
        ch.close()
    assert c.shard_stats()["chunks"] == before  # nothing stored
    assert c.get(ALICE, make_keys(1, seed=3))  # still serving


def test_only_kvpool_engine_operations_answer_on_the_socket(pool):
    c = pool["client"]
    import time

    at = c._attached()
    ch = c._dial(at.info["socket"], time.monotonic() + 5)
    key = bytes(make_keys(1, seed=3)[0])
    for op, fields in (("drain", [ALICE]), ("__init__", []), ("_spill", [1]), ("peer_get", [ALICE, ALICE, [key]]),
                       ("get", [ALICE, [b"short"]]), ("get", [ALICE, [key], "yes"]), ("end", [ALICE, {"x": -1}])):
        ch.send([op, m.WIRE_VERSION, fields, 5.0, []], deadline=time.monotonic() + 5)
        ok, err, _ = ch.recv_header(deadline=time.monotonic() + 5)
        assert not ok and wire.decode_error(err).status == 400, (op, err)  # peer_* only on the peer port
    ch.close()
    assert c.get(ALICE, make_keys(1, seed=3))  # still serving
