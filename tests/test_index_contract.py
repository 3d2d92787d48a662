"""One contract, three implementations: every test here runs on the embedded index, on RedisIndex
against the real Redis server, and on ActorIndex over a real Ray actor holding the embedded index
(a locked one: the pool's credential)."""

import time
import uuid

import pytest
from conftest import make_keys

from kvpool import BadRequest, QuotaExceeded, UnknownTenant
from kvpool.index import MAX_LOOKUP, EmbeddedIndex, IndexEntry
from kvpool.index.redis_index import RedisIndex


class Clock:
    """A clock the test moves: the embedded index's TTLs pass without sleeping."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture(scope="module")
def ray_cluster():
    from kvpool.cluster.local import local_cluster

    with local_cluster(1, namespace=f"idx{uuid.uuid4().hex[:8]}") as c:
        yield c


@pytest.fixture(params=["embedded", "redis", "actor"])
def index(request):
    # ``index.sleep(s)``: lets s seconds of the index's clock pass.
    if request.param == "embedded":
        clock = Clock()
        idx = EmbeddedIndex(clock=clock)
        idx.sleep = clock.advance
        yield idx
        return
    if request.param == "actor":
        import ray

        from kvpool.auth import Authority
        from kvpool.cluster.index_actor import ActorIndex, IndexActor

        request.getfixturevalue("ray_cluster")
        auth = Authority(b"index-contract-secret-0123456789abcdef")
        handle = IndexActor.options(runtime_env={"env_vars": auth.secret_file_env()}).remote()
        idx = ActorIndex(handle, timeout_s=30.0, credential=auth.pool_credential())
        idx.sleep = time.sleep  # the actor's clock is real
        yield idx
        ray.kill(handle)
        return
    url = request.getfixturevalue("redis_url")
    idx = RedisIndex(url, prefix=f"kvpt{uuid.uuid4().hex[:12]}")
    # NOTE: a real sleep: the TTL runs on the Redis server's clock, which a test cannot move.
    idx.sleep = time.sleep
    yield idx
    idx.flush()
    idx.close()


def entry(k, shard="s1", nbytes=1000, tenant="a", tier="dram"):
    return IndexEntry(k, shard, tier, nbytes, tenant, 42)


def setup(index, quota=10_000):
    index.add_tenant("a", quota)
    index.add_tenant("b")
    index.register_shard("s1", "node-1")
    index.register_shard("s2", "node-2")


def state(index):
    return index.tenants(), index.shard_keys("s1"), index.shard_keys("s2")


def test_publish_then_lookup_the_leading_run_and_where(index):
    setup(index)
    k = make_keys(4)
    assert index.publish([entry(k[0]), entry(k[1], shard="s2", tier="disk"), entry(k[3])]) == [True, True, True]
    hit = index.lookup(k)
    assert hit.count == 2 and hit.shards == ("s1", "s2") and hit.tiers == ("dram", "disk") and hit.error is None
    assert index.lookup(k[2:]).count == 0
    e = index.get(k[1])
    assert (e.shard, e.tier, e.nbytes, e.tenant, e.checksum) == ("s2", "disk", 1000, "a", 42) and e.created > 0
    assert index.get(k[2]) is None


def test_publish_is_idempotent_and_charges_once(index):
    setup(index)
    k = make_keys(2)
    assert index.publish([entry(k[0]), entry(k[0]), entry(k[1])]) == [True, False, True]
    assert index.publish([entry(k[0])]) == [False]
    assert index.usage("a") == 2000


def test_over_quota_is_429_and_writes_nothing(index):
    setup(index, quota=2500)
    k = make_keys(3)
    index.publish([entry(k[0]), entry(k[1])])
    before = state(index)
    with pytest.raises(QuotaExceeded) as e:
        index.publish([entry(k[2], tenant="b"), entry(k[2]), entry(make_keys(1, seed=5)[0])])
    assert e.value.status == 429 and e.value.tenant == "a" and e.value.usage == 2000 and e.value.limit == 2500
    assert state(index) == before and index.lookup([k[2]]).count == 0


def test_remove_refunds_and_respects_the_shard_filter(index):
    setup(index)
    k = make_keys(3)
    index.publish([entry(k[0]), entry(k[1], shard="s2"), entry(k[2], tenant="b", nbytes=7)])
    assert index.remove([k[1]], shard="s1") == 0
    assert index.remove([k[0], k[1], make_keys(1, seed=8)[0]]) == 2
    assert index.usage("a") == 0 and index.usage("b") == 7
    assert index.invalidate(k[2], "s2") is False and index.invalidate(k[2], "s1") is True
    assert index.usage("b") == 0 and index.lookup(k).count == 0


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (lambda: entry(make_keys(1)[0], tenant="nobody"), UnknownTenant, "nobody"),
        (lambda: entry(make_keys(1)[0], shard="s9"), BadRequest, "unknown shard 's9'"),
    ],
)
def test_unknown_tenant_or_shard_writes_nothing(index, bad, exc, match):
    setup(index)
    index.publish([entry(make_keys(1, seed=3)[0])])
    before = state(index)
    with pytest.raises(exc, match=match):
        index.publish([entry(make_keys(1, seed=4)[0]), bad()])
    assert state(index) == before


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda k: IndexEntry(bytes(k), "s1", "dram", 10, "a", 1), "ChunkKey"),
        (lambda k: IndexEntry(k, "s1", "dram", -10, "a", 1), "nbytes"),
        (lambda k: IndexEntry(k, "s1", "dram", 2**50, "a", 1), "nbytes"),
        (lambda k: IndexEntry(k, "s 1", "dram", 10, "a", 1), "shard id"),
        (lambda k: IndexEntry(k, "s1", "dram", 10, "a", -1), "checksum"),
    ],
)
def test_malformed_entries_are_rejected_before_anything_is_sent(index, make, match):
    with pytest.raises(BadRequest, match=match):
        make(make_keys(1)[0])


def test_lookup_never_raises(index):
    setup(index)
    hit = index.lookup([b"not a key"])
    assert hit.count == 0 and "ChunkKey" in hit.error
    assert index.lookup([]).count == 0


def test_lookup_answers_up_to_2048_keys_in_one_call(index):
    setup(index, quota=10**9)
    k = make_keys(MAX_LOOKUP + 10, chunk_tokens=1)
    for i in range(0, len(k), 512):
        index.publish([entry(x, nbytes=1) for x in k[i : i + 512]])
    assert index.lookup(k).count == MAX_LOOKUP


def test_bad_quota_and_priority_name_the_fix(index):
    setup(index)
    with pytest.raises(BadRequest, match="whole number of bytes"):
        index.set_quota("a", -1)
    with pytest.raises(BadRequest, match="priority"):
        index.set_priority("a", "urgent")
    with pytest.raises(UnknownTenant):
        index.set_quota("nobody", 5)
    index.set_priority("a", "high")
    index.set_quota("a", 123)
    (a,) = [t for t in index.tenants() if t.id == "a"]
    assert (a.quota, a.priority, a.usage) == (123, "high", 0)


def test_membership_ttl_heartbeat_and_purge(index):
    setup(index)
    index.register_shard("s3", ttl_s=0.3)
    k = make_keys(2)
    index.publish([entry(k[0], shard="s3"), entry(k[1], shard="s1")])
    index.heartbeat("s1", ttl_s=30)
    index.sleep(0.5)  # past s3's 0.3 s TTL, well within s1's 30 s (on Redis: real time, kept short)
    assert index.shards()["s3"] is False and index.shards()["s1"] is True
    assert index.purge_dead() == {"s3": 1}
    assert "s3" not in index.shards()
    assert index.lookup(k).count == 0 and index.lookup(k[1:]).count == 1
    assert index.usage("a") == 1000
    with pytest.raises(BadRequest, match="unknown shard"):
        index.heartbeat("s3")


def test_event_stream_of_stored_and_removed(index):
    setup(index)
    k = make_keys(2)
    index.publish([entry(k[0]), entry(k[1])])
    index.remove([k[0]])
    ev = index.events()
    assert [(e.kind, e.key, e.shard, e.tenant) for e in ev] == [
        ("stored", k[0], "s1", "a"), ("stored", k[1], "s1", "a"), ("removed", k[0], "s1", "a"),
    ]
    assert index.events(after=ev[1].id) == ev[2:]
    with pytest.raises(BadRequest, match="event id"):
        index.events(after="yesterday")


def test_reconcile_makes_the_index_say_what_the_shard_holds(index):
    setup(index)
    k = make_keys(4)
    index.publish([entry(k[0]), entry(k[1])])
    held = [entry(k[1]), entry(k[2]), entry(k[3])]
    r = index.reconcile("s1", held)
    assert (r.published, r.removed) == (2, 1)
    assert index.shard_keys("s1") == set(k[1:])
    assert index.reconcile("s1", held).published == 0  # idempotent
    assert index.usage("a") == 3000
    with pytest.raises(BadRequest, match="of shard 's2'"):
        index.reconcile("s1", [entry(k[0], shard="s2")])


def test_reconcile_publishes_what_it_can_and_reports_what_the_index_refuses(index):
    setup(index, quota=2500)  # a: room for two 1000 B chunks
    k = make_keys(6)
    held = [entry(k[i], tenant="a") for i in range(4)] + [entry(k[i], tenant="b") for i in (4, 5)]
    r = index.reconcile("s1", held)  # a single refused tenant does not block the others
    assert (r.published, r.removed) == (4, 0)
    assert sorted(e.key for e in r.refused) == sorted(k[2:4])
    assert {k[4], k[5]} <= index.shard_keys("s1") and index.usage("a") == 2000
    ghost = index.reconcile("s1", [entry(make_keys(1, seed=9)[0], tenant="nobody")])
    assert ghost.published == 0 and len(ghost.refused) == 1


def test_forget_shard_removes_a_live_shard_and_refunds(index):
    setup(index)
    k = make_keys(3)
    index.publish([entry(k[0]), entry(k[1]), entry(k[2], shard="s2")])
    assert index.forget_shard("s1") == 2
    assert "s1" not in index.shards() and index.shard_keys("s1") == set() and index.usage("a") == 1000
    with pytest.raises(BadRequest, match="unknown shard"):
        index.heartbeat("s1")


def test_the_epoch_is_gone_when_the_index_is_new(index):
    assert index.epoch() is None
    index.set_epoch("e1")
    assert index.epoch() == "e1"
