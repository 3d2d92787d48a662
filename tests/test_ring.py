from collections import Counter

import pytest
from conftest import make_keys

from kvpool import BadRequest
from kvpool.cluster.bench.ring import HashRing
from kvpool.errors import Unavailable

KEYS = make_keys(20000, chunk_tokens=1, seed=4)


def ring_of(*shards, **kw):
    r = HashRing(**kw)
    for s in shards:
        r.add(s)
    return r


def test_owners_are_deterministic_and_replicas_distinct():
    r = ring_of("a", "b", "c")
    assert all(r.owners(k) == r.owners(k) for k in KEYS[:100])
    for k in KEYS[:200]:
        o = r.owners(k, replicas=2)
        assert len(o) == 2 and len(set(o)) == 2
    assert len(r.owners(KEYS[0], replicas=5)) == 3


def test_adding_a_shard_moves_about_one_nth_of_keys_and_only_to_it():
    r = ring_of("a", "b", "c")
    before = {k: r.owners(k)[0] for k in KEYS}
    r.add("d")
    after = {k: r.owners(k)[0] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved)
    assert 0.17 < len(moved) / len(KEYS) < 0.33  # ~1/4


def test_removing_a_shard_moves_only_its_keys():
    r = ring_of("a", "b", "c", "d")
    before = {k: r.owners(k)[0] for k in KEYS}
    r.remove("b")
    moved = [k for k in KEYS if r.owners(k)[0] != before[k]]
    assert set(before[k] for k in moved) == {"b"}
    assert len(moved) == sum(1 for v in before.values() if v == "b")


def test_capacity_weights():
    r = HashRing()
    r.add("big", 2.0)
    r.add("small", 1.0)
    c = Counter(r.owners(k)[0] for k in KEYS)
    assert 1.6 < c["big"] / c["small"] < 2.5


def test_bounded_load_keeps_every_shard_within_1_plus_eps_of_its_share():
    r = ring_of("a", "b", "c", vnodes=8, eps=0.1)  # few vnodes: plain hashing would be lumpy
    plain = Counter(r.owners(k)[0] for k in KEYS)
    loads = Counter()
    for k in KEYS:
        (s,) = r.place(k, loads)
        loads[s] += 1
    fair = len(KEYS) / 3
    assert max(loads.values()) <= 1.1 * fair + 1
    assert max(plain.values()) > 1.1 * fair  # the bound did something


def test_ring_round_trips_and_versions():
    r = ring_of("a", "b")
    v = r.version
    r.add("c", 0.5)
    assert r.version > v
    r2 = HashRing.from_dict(r.to_dict())
    assert all(r2.owners(k) == r.owners(k) for k in KEYS[:500]) and r2.version == r.version


def test_empty_ring_and_bad_shards_are_clear_errors():
    # An empty ring is an outage (the pool starting, its controller restarting), not bad input.
    with pytest.raises(Unavailable, match="no shards"):
        HashRing().owners(KEYS[0])
    with pytest.raises(BadRequest, match="positive weight"):
        HashRing().add("a", 0)

