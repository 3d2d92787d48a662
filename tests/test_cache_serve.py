"""TieredCache.serve: the one routine that serves a request (the simulator and the concurrency
benchmark both call it)."""

import pytest

from kvpool.cache import TieredCache
from kvpool.errors import PoolFull
from kvpool.policies import Access, make_policy


def make(policy, tiers):
    return TieredCache(tiers, lambda c, r, t: make_policy(policy, c, r))


def acc(rid, keys, run=0, full=None):
    return Access(rid, float(rid), len(keys), len(keys) if full is None else full, run)


def test_a_request_that_ends_at_once_leaves_nothing_leased():
    cache = make("lru", [4])
    nodes = cache.serve([1, 2, 3], acc(1, [1, 2, 3]))
    assert [cache.node_key[n] for n in nodes] == [1, 2, 3]
    assert cache.res.parent[nodes[1]] == nodes[0] and cache.res.parent[nodes[2]] == nodes[1]
    again = cache.serve([1, 2, 3, 4], acc(2, [1, 2, 3, 4], run=3))
    assert again[:3] == nodes and len(again) == 4
    assert all(cache.res.leases[n] == 0 for n in again)


def test_the_policy_decides_admission_and_storing_stops_at_the_first_refusal():
    cache = make("adaptive", [8])
    nodes = cache.serve([1, 2, 3], acc(1, [1, 2, 3], full=2))  # adaptive: whole chunks only
    assert [cache.node_key[n] for n in nodes] == [1, 2]
    assert cache.counts["not_admitted"] == 1


def test_the_leading_run_is_promoted_to_the_top_tier():
    cache = make("lru", [1, 4])
    cache.serve([1], acc(1, [1]))
    cache.serve([2], acc(2, [2]))  # demotes 1
    n1 = cache.find(1)
    assert cache.node_tier[n1] == 1
    cache.serve([1], acc(3, [1]))
    assert cache.node_tier[n1] == 0 and cache.counts["promoted"] == 1


def test_a_held_request_keeps_every_chunk_leased_and_lists_what_is_not_kept():
    cache = make("adaptive", [8])
    transient = []
    nodes = cache.serve([1, 2, 3], acc(1, [1, 2, 3], full=2), hold=True, transient=transient)
    assert [cache.node_key[n] for n in nodes] == [1, 2, 3]  # stored whatever the policy keeps
    assert transient == [nodes[2]]
    assert all(cache.res.leases[n] == 1 for n in nodes)
    cache.release(nodes)
    assert all(cache.res.leases[n] == 0 for n in nodes)
    transient = []
    more = cache.serve([1, 2, 4], acc(2, [1, 2, 4], run=2), hold=True, keep=False, transient=transient)
    assert more[:2] == nodes[:2] and transient == [more[2]]  # keep=False: nothing new is kept


def test_a_held_request_that_finds_no_room_raises_and_releases_its_leases():
    cache = make("lru", [2])
    first = cache.serve([1, 2], acc(1, [1, 2]), hold=True, transient=[])
    with pytest.raises(PoolFull):
        cache.serve([1, 3], acc(2, [1, 3], run=1), hold=True, transient=[])
    assert [cache.res.leases[n] for n in first] == [1, 1]  # only the first request's leases remain
    cache.release(first)
    nodes = cache.serve([1, 3], acc(3, [1, 3], run=1), hold=True, transient=[])
    assert [cache.node_key[n] for n in nodes] == [1, 3]


def test_a_chunk_resident_past_a_gap_is_chained_through():
    cache = make("lru", [8])
    transient = []
    cache.serve([("a", 0), ("b", 1)], acc(1, [0, 1]), hold=True, transient=transient)
    keys = [("x", 0), ("b", 1), ("x", 2)]
    nodes = cache.serve(keys, acc(2, keys), run=[], hold=True, transient=transient)
    assert [cache.node_key[n] for n in nodes] == keys
    assert cache.res.leases[nodes[1]] == 2
