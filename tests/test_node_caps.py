"""What one tenant may keep open on a node's shard, and writes longer than the node's pool, through
the engines' own path (a ``NodeClient`` on the shard's socket; a single-node shard, no Ray).

- A tenant's requests in flight, the chunks they lease and its reservations are capped per tenant
  (429 naming the cap and its variable); an empty ``begin`` keeps nothing (300,000 of them once
  grew a shard by 116 MiB); another tenant is not held up.
- A prompt whose chunks outgrow the node's DRAM tier stores its leading chunks (reserve/commit for
  large chunks, the staging file for small ones) and leaves nothing held: every tenant writes on.
"""

from __future__ import annotations

import pytest
from conftest import make_keys, payload

from kvpool.auth import Authority, new_secret
from kvpool.errors import LimitExceeded
from kvpool.node import messages as m
from kvpool.node.client import NodeClient

SECRET = new_secret()
AUTH = Authority(SECRET)
ALICE, BOB = AUTH.issue("alice"), AUTH.issue("bob")
PAGES = 16


@pytest.fixture
def shard(tmp_path, monkeypatch):
    """``shard(page_bytes, **env)``: a single-node shard of PAGES DRAM pages in a private run dir,
    its caps' variables set from ``env``; and a client of it."""
    from kvpool.cluster.shard_core import Shard
    from kvpool.cluster.solo import Alone
    from kvpool.index.embedded import EmbeddedIndex

    made = []

    def start(page_bytes: int = 16 << 10, **env):
        run = tmp_path / "run"
        monkeypatch.setenv("KVPOOL_RUN_DIR", str(run))
        monkeypatch.setenv("KVPOOL_SECRET", SECRET)
        monkeypatch.delenv("KVPOOL_SECRET_FILE", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        s = Shard("s1", "default", {"page_bytes": page_bytes, "dram_pages": PAGES}, [{"id": "alice"}, {"id": "bob"}],
                  EmbeddedIndex(), Alone(), node_id="n", host="127.0.0.1")
        c = NodeClient(directory=str(run), timeout_s=10)
        made.append((s, c))
        return s, c

    yield start
    for s, c in made:
        c.close()
        s.drain(s.auth.pool_credential())


def held(s) -> dict:
    """What the shard holds for its tenants besides their chunks."""
    st = s.store.stats()
    return {"requests": len(s.service.requests), "store_requests": len(s.store.active_requests()),
            "holds": len(s.store._holds), "reserved": len(s.service.reserved),
            "leased_pages": sum(t["leased_pages"] for t in st["tiers"].values()),
            "open": {k: v["by_tenant"] for k, v in s.service.open_stats().items()}}


NOTHING = {"requests": 0, "store_requests": 0, "holds": 0, "reserved": 0, "leased_pages": 0,
           "open": {"requests": {}, "leases": {}, "reservations": {}}}


def test_an_empty_begin_keeps_nothing_and_a_tenants_requests_and_leases_are_capped(shard):
    s, c = shard(KVPOOL_REQUESTS_PER_TENANT=4, KVPOOL_LEASES_PER_TENANT=6)
    keys = make_keys(3, seed=1)
    assert c.put(ALICE, keys, [payload(i, 100) for i in range(3)]) == 3
    for _ in range(2000):  # what grew a shard by 116 MiB at 300,000
        r, _ = c.call(m.Begin(ALICE, [], False, None))
        assert r == {"requests": {}, "count": 0}
    assert held(s) == NOTHING
    reqs = [c.begin(ALICE, keys[:1]) for _ in range(4)]  # 4 requests of 1 lease each: the requests' cap
    assert all(r.shard_requests for r in reqs) and c.counts["begin_refused"] == 0
    with pytest.raises(LimitExceeded) as e:
        c.call(m.Begin(ALICE, [bytes(k) for k in keys[:1]], False, None))
    assert e.value.status == 429 and "KVPOOL_REQUESTS_PER_TENANT" in str(e.value) and "4" in str(e.value)
    refused = c.begin(ALICE, keys[:1])  # an engine's client serves the request without leases
    assert not refused.shard_requests and c.counts["begin_refused"] == 1
    assert c.begin(BOB, make_keys(1, seed=2)).shard_requests  # another tenant is not held up
    assert held(s)["open"]["requests"] == {"alice": 4, "bob": 1}
    for r in reqs:
        c.end(r)
    big = c.begin(ALICE, keys)  # 3 leases
    with pytest.raises(LimitExceeded, match="KVPOOL_LEASES_PER_TENANT"):
        c.call(m.Begin(ALICE, [bytes(k) for k in keys * 2], False, None))  # 3 + 6 > 6
    assert held(s)["open"]["leases"]["alice"] == 3  # the refused begin keeps nothing
    c.end(big)
    c.end(c.begin(ALICE, keys))  # and alice begins again once hers ended
    assert held(s)["open"]["requests"] == {"bob": 1} and held(s)["open"]["leases"] == {}  # bob's: none stored


def test_a_tenants_open_reservations_are_capped_and_one_of_nothing_holds_nothing(shard):
    s, c = shard(KVPOOL_RESERVATIONS_PER_TENANT=2)
    stored = make_keys(1, seed=3)
    assert c.put(ALICE, stored, [payload(0, 100)]) == 1
    holds = []
    for i in range(2):
        r, _ = c.call(m.Reserve(ALICE, [bytes(make_keys(1, seed=10 + i)[0])], False, 0, None, [100]))
        holds.append(r["hold"])
    with pytest.raises(LimitExceeded) as e:
        c.call(m.Reserve(ALICE, [bytes(make_keys(1, seed=20)[0])], False, 0, None, [100]))
    assert e.value.status == 429 and "KVPOOL_RESERVATIONS_PER_TENANT" in str(e.value)
    r, _ = c.call(m.Reserve(BOB, [bytes(make_keys(1, seed=21)[0])], False, 0, None, [100]))  # bob reserves
    c.call(m.Abort(BOB, r["hold"]))
    c.call(m.Abort(ALICE, holds[0]))
    r, _ = c.call(m.Reserve(ALICE, [bytes(stored[0])], False, 0, None, [100]))  # stored already: nothing held
    assert r == {"hold": 0, "places": []} and len(s.service.reserved) == 1
    assert c.call(m.Commit(ALICE, 0, [], []))[0] == 0
    c.call(m.Abort(ALICE, holds[1]))
    assert held(s) == NOTHING


@pytest.mark.parametrize("page_bytes", [16 << 10, 1 << 20], ids=["staged", "reserve-commit"])
def test_a_prompt_longer_than_the_nodes_pool_stores_what_fits_and_every_tenant_writes_on(shard, page_bytes):
    """A real engine does this with any prompt whose KV exceeds the DRAM tier: once, every later
    write of every tenant stored nothing (the pool full of that prompt, none of it evictable)."""
    s, c = shard(page_bytes)
    keys = make_keys(PAGES + 1, seed=4)
    assert c.put(ALICE, keys, [payload(i, page_bytes) for i in range(PAGES + 1)]) == PAGES  # the leading chunks
    assert len(c.get(ALICE, keys)) == PAGES and c.counts["put_failed"] == 0
    assert held(s) == NOTHING and s.store.tenants.usage("alice") == PAGES * page_bytes
    assert s.store.metrics.cut_writes.get("alice") == 1
    for who, seed in ((BOB, 5), (ALICE, 6), (BOB, 7)):
        assert c.put(who, make_keys(2, seed=seed), [payload(i, page_bytes) for i in range(2)]) == 2
    assert held(s) == NOTHING
    assert s.store.tenants.usage("alice") + s.store.tenants.usage("bob") == PAGES * page_bytes
