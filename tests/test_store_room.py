"""Writes that find no room: a prompt longer than the pool, a pool full of one chain, a disk tier
full of a prompt's head. Such a write stores its leading chunks (or, with nothing of it fitting,
is a 507 naming the pool's sizes and the fix); it cancels no other request in vain, and leaves the
store as writable as before: no lease, charge or page held, every tenant writing on."""

import tempfile

import pytest
from conftest import make_keys, payload

from kvpool import ChunkStore, PoolFull, StoreConfig, Tenant, TenantRegistry

PAGE = 4096


def store(dram=64, disk=0, policy="default"):
    cfg = StoreConfig(PAGE, dram, disk, tempfile.mkdtemp() if disk else None, policy=policy)
    return ChunkStore(cfg, TenantRegistry([Tenant("a"), Tenant("b")]))


def chunks(n, seed):
    return make_keys(n, seed=seed), [payload(i, PAGE) for i in range(n)]


def settled(s):
    """Nothing held, and usage is what is resident."""
    st = s.stats()
    assert sum(t["leased_pages"] for t in st["tiers"].values()) == 0
    assert not s._holds and not s.active_requests()
    for t in ("a", "b"):
        assert s.tenants.usage(t) == sum(
            int(s._nbytes[n]) for n in s._cache.index.values() if s.tenants.by_index(int(s._tenant[n])).id == t)
    return st


@pytest.mark.parametrize("policy", ["default", "lru", "s3fifo", "adaptive", "importance", "request-fifo", "tiered"])
@pytest.mark.parametrize("disk", [0, 32], ids=["dram", "dram+disk"])
@pytest.mark.parametrize("path", ["put", "request", "reserve"])
def test_a_prompt_longer_than_the_pool_stores_what_fits_and_every_tenant_writes_on(policy, disk, path):
    """`ChunkStore(StoreConfig(4096, 64)).put_many` of 65 chunks raised PoolFull, and so did every
    later write of every tenant (the chain left out of its policy's queues, or parked for good)."""
    s = store(64, disk, policy)
    n = 64 + disk + 1
    keys, data = chunks(n, seed=1)
    fits = 64 + disk if path == "put" else 64  # a request's or a reservation's chunks stay leased: in DRAM
    if path == "put":
        stored = s.put_many(keys, data, "a")
    elif path == "request":
        req = s.begin("a")
        stored = s.put_many(keys, data, "a", request=req)
        s.end(req)
    else:
        hid, places = s.reserve(keys, [PAGE] * n, "a")
        for pl in places:
            s.slab("dram").buf[pl.offset: pl.offset + PAGE] = data[keys.index(pl.key)]
        stored = [True] * s.commit(hid, [0] * len(places))
        stored += [False] * (n - len(stored))
    assert stored == [True] * fits + [False] * (n - fits)
    assert s.metrics.cut_writes.get("a") == 1
    settled(s)
    for tenant, seed in (("b", 2), ("a", 3), ("b", 4)):
        k, d = chunks(3, seed)
        assert s.put_many(k, d, tenant) == [True] * 3
    settled(s)


def test_a_long_prompt_saved_step_by_step_keeps_its_leading_chunks():
    """An engine saves a prompt's chunks as each step computes them, each save under the one
    before. Past the pool's size a save stores nothing: not under a prefix that is gone either
    (its chunks could never be reached, and would have evicted the prompt's leading chunks)."""
    s = store(8)
    keys, data = chunks(16, seed=21)
    assert s.put_many(keys[:6], data[:6], "a") == [True] * 6
    assert s.put_many(keys[6:10], data[6:10], "a", parent=keys[5]) == [True, True, False, False]
    assert s.put_many(keys[10:16], data[10:16], "a", parent=keys[9]) == [False] * 6
    assert s.contains_many(keys, "a") == [True] * 8 + [False] * 8
    assert s.tenants.usage("a") == 8 * PAGE
    settled(s)


def test_an_over_long_write_cancels_no_other_tenants_request():
    s = store(16)
    k, d = chunks(2, seed=5)
    req = s.begin("b")
    s.put_many(k, d, "b", request=req)
    keys, data = chunks(17, seed=6)
    assert sum(s.put_many(keys, data, "a")) == 14  # what fits beside b's leased chunks
    assert not req.cancelled and s.contains_many(k, "b") == [True, True]
    s.put_many(*chunks(1, seed=7), "b", request=req)  # b's request writes on
    s.end(req)
    settled(s)


def test_a_write_under_a_pool_full_of_its_chain_leaves_the_pool_writable():
    """The chain's leaf held a child that never came (no room): the default policy had set the
    whole chain aside as prefixes and never took it back."""
    s = store(4)
    keys, data = chunks(4, seed=8)
    assert s.put_many(keys, data, "a") == [True] * 4
    assert s.reserve(chunks(1, seed=9)[0], [PAGE], "a", parent=keys[-1]) == (0, [])  # holds nothing
    assert s.put_many(*chunks(2, seed=11), "b") == [True, True]
    assert s.put_many(*chunks(1, seed=10), "a", parent=keys[1]) == [True]
    settled(s)


@pytest.mark.parametrize("policy", ["default", "lru", "s3fifo", "importance", "request-fifo", "tiered"])
def test_a_disk_tier_full_of_a_conversations_head_still_makes_room(policy):
    """A conversation's next turn made its chain fill DRAM and disk: its head on disk under its
    tail in DRAM. Nothing on disk can go before the DRAM chunks under it, and DRAM's victim, a
    prefix, could not move down: every later write failed. Room comes from the tail's leaves now,
    also for a branch written under the middle of that conversation."""
    s = store(4, 4, policy)
    keys, data = chunks(7, seed=12)
    assert s.put_many(keys, data, "a") == [True] * 7
    turn = chunks(1, seed=13)
    assert s.put_many(*turn, "a", parent=keys[-1]) == [True]  # the pool holds the conversation only
    assert s.put_many(*chunks(3, seed=14), "b") == [True] * 3
    assert s.put_many(*chunks(2, seed=15), "a", parent=keys[3]) == [True, True]
    assert s.contains_many(keys[:4], "a") == [True] * 4  # the branch's own prefix stayed
    settled(s)


def test_a_policy_that_names_a_prefix_in_use_is_asked_for_another_victim():
    """``importance`` named its lowest score, the root of the chain being extended (its suffix
    in use), again and again, and the write failed beside a chunk that could go."""
    s = store(5, policy="importance")
    hot, data = chunks(1, seed=18)
    s.put_many(hot, data, "b")
    for _ in range(3):
        s.get(hot[0], "b")  # more hits: a higher score than the chain's
    keys, data = chunks(4, seed=19)
    s.put_many(keys, data, "a")
    assert s.put_many(*chunks(1, seed=20), "a", parent=keys[-1]) == [True]
    assert not s.contains(hot[0], "b")  # room came from the one chunk that could go
    settled(s)


def test_a_write_that_finds_no_room_names_the_pools_sizes_and_the_fix():
    s = store(2, 2)
    keys, data = chunks(4, seed=15)
    s.put_many(keys, data, "a")
    views = [s.read(k, "a") for k in keys]  # every page leased: nothing can go
    with pytest.raises(PoolFull) as e:
        s.put_many(*chunks(1, seed=16), "b")
    msg = str(e.value)
    assert e.value.status == 507 and "dram 2 pages, disk 2 pages" in msg and f"{PAGE} B" in msg
    assert "--dram-pages" in msg and "--disk-dir" in msg
    for v in views:
        if v is not None:
            v.release()
    assert s.put_many(*chunks(1, seed=17), "b") == [True]
    settled(s)
