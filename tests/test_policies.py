"""Exact eviction orders of every policy on small hand-made request sequences.

Requests are lists of block ids (a chain: each id's parent is the id before it), served the way
the simulator serves them (kvpool.cache.TieredCache.serve)."""

import numpy as np
import pytest

from kvpool import BadRequest
from kvpool.cache import CacheHooks, TieredCache
from kvpool.keys import ChunkKey
from kvpool.policies import Access, make_policy, policy_class, policy_names, registry
from kvpool.policies.density import DensityPolicy
from kvpool.sim.replay import replay
from kvpool.sim.trace import SimRequest
from kvpool.sim.workloads import generate
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry


class Recorder(CacheHooks):
    def __init__(self):
        self.dropped_keys = []
        self.cache = None

    def dropped(self, node, tier, page, reason):
        self.dropped_keys.append(self.cache.node_key[node])


def make(policy, cap, tiers=None, **params):
    rec = Recorder()
    cache = TieredCache(tiers or [cap], lambda c, r, t: make_policy(policy, c, r, **params), rec)
    rec.cache = cache
    return cache, rec


class Driver:
    def __init__(self, cache):
        self.cache = cache
        self.rid = 0

    def __call__(self, *blocks, full=None, attention=None):
        """Serves one request; returns how many leading blocks hit."""
        self.rid += 1
        run = self.cache.leading_run(list(blocks))
        full = len(blocks) if full is None else full
        acc = Access(self.rid, float(self.rid), len(blocks), full, len(run), attention=attention)
        self.cache.serve(list(blocks), acc, run)
        return len(run)


def resident(cache):
    return sorted(cache.index)


def test_registry_has_every_policy_the_pool_offers():
    assert set(policy_names()) >= {
        "reject", "request-fifo", "request-lru", "lru", "tiered", "importance", "tiered-memory", "adaptive", "s3fifo",
    }
    with pytest.raises(BadRequest, match="unknown eviction policy"):
        make_policy("mru", 4, None)


def test_reject_refuses_writes_into_a_full_cache():
    cache, rec = make("reject", 2)
    req = Driver(cache)
    req(1)
    req(2)
    req(3)
    assert resident(cache) == [1, 2] and rec.dropped_keys == [] and cache.counts["refused"] == 1
    assert req(1) == 1


@pytest.mark.parametrize("policy", ["lru", "density"])  # density: before it has data
def test_lru_evicts_least_recently_used_leaf_first(policy):
    cache, rec = make(policy, 3)
    req = Driver(cache)
    req(1, 2)  # chain 1 -> 2
    req(3)
    req(1)  # touches 1 only: 2 is now the least recent, and a leaf
    req(4)
    req(5)
    req(6)
    assert rec.dropped_keys == [2, 3, 1]
    assert resident(cache) == [4, 5, 6]


def test_request_fifo_evicts_whole_oldest_request_leaf_first():
    cache, rec = make("request-fifo", 4)
    req = Driver(cache)
    req(1, 2)
    req(3, 4)
    assert req(1, 2) == 2  # a hit does not save a FIFO request
    req(5)
    assert rec.dropped_keys == [2, 1]
    assert resident(cache) == [3, 4, 5]


def test_request_lru_evicts_whole_least_recently_used_request():
    cache, rec = make("request-lru", 4)
    req = Driver(cache)
    req(1, 2)
    req(3, 4)
    req(1, 2)
    req(5)
    assert rec.dropped_keys == [4, 3]
    assert resident(cache) == [1, 2, 5]


def test_s3fifo_drops_one_hit_wonders_and_brings_ghosts_back_to_main():
    cache, rec = make("s3fifo", 4, small_fraction=0.25)
    req = Driver(cache)
    req(1)
    req(2)
    req(1)  # 1 is hit while in probation
    req(3)
    req(4)
    req(5)  # full: 1 moves to main, 2 (never hit) leaves for the ghost list
    req(2)  # 2 comes back from the ghost: straight into main; 3 leaves probation
    assert rec.dropped_keys == [2, 3]
    assert resident(cache) == [1, 2, 4, 5]
    pol = cache.policies[0]
    assert pol.lists.where[cache.index[2]] == 1  # MAIN


def test_adaptive_skips_partial_chunks_and_moves_its_probation_target():
    cache, rec = make("adaptive", 8, small_fraction=0.5)
    req = Driver(cache)
    pol = cache.policies[0]
    req(1, 2, 3, full=2)  # 3 is a partial chunk: never admitted
    assert resident(cache) == [1, 2] and cache.counts["not_admitted"] == 1
    start = pol.target
    for b in range(10, 18):  # one-hit wonders push 1, 2 and others out of probation
        req(b)
    assert 1 not in cache.index and 1 in pol.ghost
    req(1)  # a probation-ghost hit: probation was too short
    assert pol.target > start
    high = pol.target
    pol.ghost_main[99] = None  # pretend main dropped 99 earlier
    req(99)
    assert pol.target < high


def test_tiered_pins_hottest_up_to_the_cap_and_never_evicts_them():
    cache, rec = make("tiered", 10, pinned_fraction=0.2, hot_hits=2)
    pol = cache.policies[0]
    req = Driver(cache)
    for _ in range(3):
        req(1)
        req(2)
        req(3)
    pinned = [b for b in (1, 2, 3) if cache.res.pinned[cache.index[b]]]
    assert pinned == [1, 2]  # cap = 20% of 10 = 2; 3 got hot last and stays in the LRU zone
    for b in range(100, 120):
        req(b)
    assert 1 in cache.index and 2 in cache.index and 3 not in cache.index
    assert pol.stats()["pinned"] == 2
    assert cache.pin(cache.index[119]) is False  # an explicit pin past the cap falls back


def test_tiered_pinned_fraction_is_hard_capped():
    with pytest.raises(BadRequest, match="quarter"):
        make("tiered", 10, pinned_fraction=0.3)


def test_tiered_window_zone_drops_a_long_context_from_its_end_never_its_middle():
    cache, rec = make("tiered", 10, long_context=3, head_chunks=1, window_fraction=0.3, hot_hits=99)
    req = Driver(cache)
    req(1, 2, 3, 4, 5)  # long: 2..5 go to the window zone, 1 (its head) to LRU
    req(6, 7, 8, 9, 10)  # long: 7..10 window
    req(11)
    assert rec.dropped_keys == [5, 4, 3, 2]  # the oldest context, from its end back
    assert resident(cache) == [1, 6, 7, 8, 9, 10, 11]


def test_importance_keeps_attended_deep_and_reused_chunks():
    cache, rec = make("importance", 3)
    req = Driver(cache)
    req(1, attention=[0.9])  # heavily attended
    req(2, attention=[0.0])  # ignored by the model
    req(3, attention=[0.5])
    req(4, attention=[0.5])
    assert rec.dropped_keys == [2]
    cache, rec = make("importance", 3)
    req = Driver(cache)
    req(1)
    req(2)
    req(1)
    req(1)  # 1 is reused: it outlives the newer, never-hit 2... and the newest 3
    req(3)
    req(4)
    assert rec.dropped_keys == [2]


def test_tiered_memory_demotes_before_dropping_and_promotes_on_hit():
    cache, rec = make("lru", 3, tiers=[1, 1, 1])
    req = Driver(cache)
    req(1)
    req(2)
    req(3)
    tier = lambda b: cache.node_tier[cache.index[b]]  # noqa: E731
    assert (tier(1), tier(2), tier(3)) == (2, 1, 0) and rec.dropped_keys == []
    assert req(1) == 1
    assert tier(1) == 0 and cache.counts["promoted"] == 1
    req(4)
    assert rec.dropped_keys == [2]  # the coldest, from the last tier


@pytest.mark.parametrize("policy", sorted(registry()))
def test_every_policy_keeps_prefixes_of_resident_chunks(policy):
    cache, rec = make(policy, 64)
    trace = generate("chat", n_requests=300, seed=3)
    req = Driver(cache)
    for r in trace:
        req(*r.blocks, full=r.full_blocks)
        for key, node in cache.index.items():
            p = cache.res.parent[node]
            assert p == -1 or cache.node_key[p] is not None, (policy, key)
        assert len(cache.index) <= 64


def test_requests_in_flight_are_never_evicted():
    cache, rec = make("lru", 4)
    req = Driver(cache)
    req(1, 2)
    run = cache.leading_run([1, 2])
    for n in run:
        cache.res.leases[n] += 1  # a request streaming from these chunks
    req(3)
    req(4)
    req(5)
    req(6)
    assert 1 in cache.index and 2 in cache.index


def test_sim_reproduces_published_lru_and_belady_shapes_on_a_generated_workload():
    trace = generate("rag", n_requests=2000, seed=1)
    lru = replay(trace, "lru", 500)["hit_rate"]
    ours = replay(trace, "adaptive", 500)["hit_rate"]
    from kvpool.sim.replay import belady, infinite

    assert lru <= belady(trace, 500)["hit_rate"] <= infinite(trace)["hit_rate"]
    assert ours >= lru


# ---------------------------------------------------------------- density (the default)


def test_the_pools_default_is_density():
    assert policy_class("default") is DensityPolicy


def test_a_prompts_trailing_partial_chunk_is_not_stored():
    cache, _ = make("density", 8)
    req = Driver(cache)
    req(1, 2, 3, full=2)
    assert resident(cache) == [1, 2]


def _conversations_and_one_shots(n: int) -> list[SimRequest]:
    """Conversations that come back three times, 30 requests apart, interleaved with one-shot
    prompts, all under one shared system prompt (block 0). An LRU of 300 blocks holds ~14 steps:
    it loses every return. A conversation that came back once comes back again; one-shots never
    do: a policy that learns that keeps the later returns."""
    out = []
    for i in range(n):
        out.append(SimRequest(float(i), (0, 10_000 + i, 20_000 + i), 3 * 512))
        for k in (1, 2, 3):
            j = i - 30 * k
            if j >= 0:
                extra = tuple(30_000 + 4 * j + m for m in range(k))
                out.append(SimRequest(float(i), (0, 10_000 + j, 20_000 + j) + extra, (3 + k) * 512))
        out.append(SimRequest(float(i), (0, 100_000 + 3 * i, 100_001 + 3 * i, 100_002 + 3 * i), 4 * 512))
    return out


def test_it_learns_what_comes_back_and_beats_lru():
    trace = _conversations_and_one_shots(1500)
    lru = replay(trace, "lru", 300)
    for policy in ("density", "density-admit"):
        ours = replay(trace, policy, 300)
        assert ours["hit_rate"] > lru["hit_rate"] * 1.3, (policy, ours["hit_rate"], lru["hit_rate"])
        assert (ours["policy_stats"]["declined_requests"] > 0) == (policy == "density-admit")


def test_a_chain_extended_by_a_later_request_is_one_turn_deeper():
    cache, _ = make("density", 16)
    pol = cache.policies[0]
    req = Driver(cache)
    req(0, 1, 2)
    req(0, 1, 2, 3)  # extends the leaf 2: the conversation came back
    assert [pol.turn[cache.index[k]] for k in (0, 1, 2, 3)] == [1, 1, 1, 1]
    assert pol.cls[cache.index[3]] != pol.cls[cache.index[2]]  # same turn, different reuse counts
    req(0, 5)  # under 0, which already has a continuation: a new conversation
    assert pol.turn[cache.index[5]] == 0
    req(0, 1, 2, 3, 4)
    assert pol.turn[cache.index[4]] == 2


def test_an_evicted_chunk_that_comes_back_is_a_use_at_its_true_age():
    cache, _ = make("density", 2)
    pol = cache.policies[0]
    req = Driver(cache)
    req(1)
    for k in range(2, 12):  # 1 leaves; its ghost stays
        req(k)
    assert 1 not in cache.index and 1 in pol.ghost
    before = [sum(h) for h in pol.hits]
    req(1)
    node = cache.index[1]
    assert pol.count[node] == 1  # it was used once before
    grew = [c for c in range(len(before)) if sum(pol.hits[c]) > before[c]]
    assert len(grew) == 1
    age_bucket = max(a for a, v in enumerate(pol.hits[grew[0]]) if v)
    assert age_bucket >= 10 // pol.width - 1  # recorded at ~10 blocks of age, not 0


def test_in_the_store_on_two_tiers(tmp_path):
    """The store's own calls (put, get) under density on DRAM and disk: demotions, promotions."""
    store = ChunkStore(StoreConfig(64, 6, policy="density", disk_pages=6, disk_dir=str(tmp_path)),
                       TenantRegistry([Tenant("a")]))
    try:
        keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(40)]
        data = [np.full(64, i, dtype=np.uint8) for i in range(40)]
        for start in range(0, 40, 4):
            ks = keys[start:start + 4]
            store.put_many(ks, data[start:start + 4], "a")
            got = store.get_many(ks[:2], "a")
            assert all(g is not None and g[0] == start + i for i, g in enumerate(got))
        held = [k for k in keys if store.get_many([k], "a")[0] is not None]
        assert 0 < len(held) <= 12
        for k in held:
            assert store.get_many([k], "a")[0][0] == keys.index(k)  # never a wrong chunk
    finally:
        store.close()


def test_access_without_a_request_id_seen_before():
    """A read-only touch (the store's get) of chunks stored by other requests counts as uses."""
    cache, _ = make("density", 4)
    pol = cache.policies[0]
    req = Driver(cache)
    req(1, 2)
    n1, n2 = cache.index[1], cache.index[2]
    cache.access([n1, n2], Access(99, 1.0, 2, 2, 2))
    assert pol.count[n1] == pol.count[n2] == 1
