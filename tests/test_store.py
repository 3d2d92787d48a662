import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_keys, make_store, payload, snapshot

from kvpool import (
    BadRequest,
    ChunkTooLarge,
    PoolFull,
    QuotaExceeded,
    Tenant,
    UnknownTenant,
)


def test_put_get_round_trip_and_batched_forms():
    s = make_store()
    keys = make_keys(3)
    assert s.put_many(keys, [payload(i) for i in range(3)], "a") == [True, True, True]
    assert s.put(keys[0], payload(0), "a") is False  # already resident: not stored twice
    got = s.get_many(keys, "a")
    for i, g in enumerate(got):
        assert np.array_equal(g, payload(i))
    assert s.contains_many(keys + make_keys(1, seed=9), "a") == [True, True, True, False]
    assert s.remove_many(keys[:2], "a") == 2
    assert s.get_many(keys, "a")[:2] == [None, None]
    assert s.tenants.usage("a") == 1000


def test_get_into_caller_buffer_of_any_dtype():
    s = make_store()
    k = make_keys(1)[0]
    src = torch.arange(250, dtype=torch.float32)
    s.put(k, src, "a")
    out = torch.empty(250, dtype=torch.float32)
    s.get(k, "a", out=out)
    assert torch.equal(out, src)


def test_freed_pages_are_reused():
    s = make_store(dram_pages=2)
    k = make_keys(4)
    s.put(k[0], payload(0), "a")
    s.put(k[1], payload(1), "a")
    assert s.locate(k[0]) == ("dram", 0) and s.locate(k[1]) == ("dram", 1)
    s.remove(k[0], "a")
    s.put(k[2], payload(2), "a")
    assert s.locate(k[2]) == ("dram", 0)
    assert np.array_equal(s.get(k[2], "a"), payload(2))


def test_lru_eviction_order_without_disk():
    s = make_store(dram_pages=3)
    k = make_keys(5)
    for i in range(3):
        s.put(k[i], payload(i), "a")
    s.get(k[0], "a")  # k1 is now the least recently used
    s.put(k[3], payload(3), "a")
    assert s.contains_many(k[:4], "a") == [True, False, True, True]
    s.put(k[4], payload(4), "a")
    assert s.contains_many(k, "a") == [True, False, False, True, True]
    assert s.metrics.evictions.get("dram") == 2
    assert s.tenants.usage("a") == 3000


def test_corrupted_byte_is_a_miss_and_the_entry_is_dropped():
    s = make_store()
    k = make_keys(2)
    s.put_many(k, [payload(0), payload(1)], "a")
    tier, page = s.locate(k[0])
    s.slab(tier).page(page)[500] ^= 0x01
    assert s.get(k[0], "a") is None
    assert not s.contains(k[0], "a")
    assert s.metrics.checksum_failures.get("dram") == 1
    assert s.tenants.usage("a") == 1000  # the dropped chunk is refunded
    assert np.array_equal(s.get(k[1], "a"), payload(1))  # the neighbour is untouched


def test_corruption_is_caught_by_the_zero_copy_read_too():
    s = make_store()
    k = make_keys(1)[0]
    s.put(k, payload(3), "a")
    with s.read(k, "a") as view:
        assert np.array_equal(view.data, payload(3))
        assert not view.data.flags.writeable
    tier, page = s.locate(k)
    s.slab(tier).page(page)[0] ^= 0xFF
    assert s.read(k, "a") is None
    assert not s.contains(k, "a")


def test_leased_chunks_are_never_evicted():
    s = make_store(dram_pages=2)
    a, b, c, d = (make_keys(1, seed=i)[0] for i in range(4))  # four unrelated prompts
    s.put(a, payload(0), "a")
    s.put(b, payload(1), "a")
    lease = s.lease([a], "a")  # a is the LRU chunk, but leased
    s.put(c, payload(2), "a")
    assert s.contains_many([a, b, c], "a") == [True, False, True]
    assert s.stats()["metrics"]["lease_waits"][""] >= 1
    lease2 = s.lease([c], "a")
    with pytest.raises(PoolFull) as e:
        s.put(d, payload(3), "a")
    assert e.value.status == 507
    lease.release()
    lease2.release()
    s.put(d, payload(3), "a")
    assert s.contains_many([a, b, c, d], "a") == [False, False, True, True]


def test_a_prefix_is_never_evicted_before_its_suffix():
    s = make_store(dram_pages=3)
    k = make_keys(3)
    s.put_many(k[:2], [payload(0), payload(1)], "a")  # k0 -> k1
    s.get(k[1], "a")  # k1 alone is touched: k0 is now the least recently used chunk
    other = make_keys(2, seed=7)
    s.put_many(other, [payload(5), payload(6)], "a")
    # room for the second prompt came from the leaf k1, never from the prefix k0 it depends on
    assert s.contains_many(k[:2], "a") == [True, False]


def test_remove_while_leased_frees_at_release():
    s = make_store()
    k = make_keys(1)[0]
    s.put(k, payload(1), "a")
    view = s.read(k, "a")
    assert s.remove(k, "a")
    assert not s.contains(k, "a")
    assert np.array_equal(view.data, payload(1))  # still readable by the lease holder
    assert s.stats()["tiers"]["dram"]["pages_used"] == 1
    view.release()
    assert s.stats()["tiers"]["dram"]["pages_used"] == 0
    assert s.tenants.usage("a") == 0


def test_quota_exceeded_is_429_names_tenant_and_changes_nothing():
    s = make_store(dram_pages=8, tenants=[Tenant("small", quota_bytes=2500), Tenant("b")])
    k = make_keys(4)
    s.put_many(k[:2], [payload(0), payload(1)], "small")
    before = snapshot(s)
    with pytest.raises(QuotaExceeded) as e:
        s.put_many(k[2:], [payload(2), payload(3)], "small")
    assert e.value.status == 429
    assert "'small'" in str(e.value) and "2000" in str(e.value) and "2500" in str(e.value)
    assert snapshot(s) == before
    assert s.metrics.rejected_quota.get("small") == 1


def test_demotion_to_disk_and_promotion_back_keep_identical_bytes(tmp_disk):
    s = make_store(dram_pages=2, disk_pages=4, disk_dir=tmp_disk)
    k = make_keys(5)
    for i in range(4):
        s.put(k[i], payload(i), "a")
    assert [s.locate(x)[0] for x in k[:4]] == ["disk", "disk", "dram", "dram"]
    assert s.metrics.evictions.total() == 0 and s.metrics.demotions.get("dram") == 2
    got = s.get(k[0], "a")  # a disk hit: promoted, and the dram LRU (k2) demoted
    assert np.array_equal(got, payload(0))
    assert s.locate(k[0])[0] == "dram" and s.locate(k[2])[0] == "disk"
    assert s.metrics.promotions.get("dram") == 1
    for i in range(4):
        assert np.array_equal(s.get(k[i], "a"), payload(i))
    assert s.tenants.usage("a") == 4000


def test_disk_tier_drops_its_lru_when_full(tmp_disk):
    s = make_store(dram_pages=1, disk_pages=2, disk_dir=tmp_disk)
    k = make_keys(4)
    for i in range(4):
        s.put(k[i], payload(i), "a")
    assert s.contains_many(k, "a") == [False, True, True, True]
    assert s.metrics.evictions.get("disk") == 1


def test_corruption_on_disk_is_caught_at_promotion(tmp_disk):
    s = make_store(dram_pages=1, disk_pages=2, disk_dir=tmp_disk)
    k = make_keys(2)
    s.put_many(k, [payload(0), payload(1)], "a")
    tier, page = s.locate(k[0])
    assert tier == "disk"
    s.slab("disk").page(page)[10] ^= 0x10
    assert s.get(k[0], "a") is None
    assert not s.contains(k[0], "a")
    assert s.metrics.checksum_failures.get("disk") == 1


def test_tenants_cannot_see_each_others_chunks_unless_shared():
    s = make_store()
    k = make_keys(2)
    s.put(k[0], payload(0), "a")
    s.put(k[1], payload(1), "a", shared=True)
    assert s.get(k[0], "b") is None and not s.contains(k[0], "b") and s.read(k[0], "b") is None
    assert len(s.lease([k[0]], "b")) == 0
    assert s.remove(k[0], "b") is False
    assert np.array_equal(s.get(k[1], "b"), payload(1))
    assert s.remove(k[1], "b") is False  # only the owner removes a shared chunk
    assert s.tenants.usage("b") == 0 and s.tenants.usage("a") == 2000


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda s, k: s.put(k, np.zeros(2000, np.uint8), "a"), ChunkTooLarge, "page size"),
        (lambda s, k: s.put(k, np.zeros(0, np.uint8), "a"), BadRequest, "empty"),
        (lambda s, k: s.put(k, np.zeros((4, 8), np.uint8)[:, ::2], "a"), BadRequest, "contiguous"),
        (lambda s, k: s.put(k, "text", "a"), BadRequest, "torch tensor, numpy array or bytes"),
        (lambda s, k: s.put(bytes(k), payload(0), "a"), BadRequest, "ChunkKey"),
        (lambda s, k: s.put(k, payload(0), "nobody"), UnknownTenant, "register"),
        (lambda s, k: s.get(k, "nobody"), UnknownTenant, "nobody"),
        (lambda s, k: s.put_many([k, k], [payload(0)], "a"), BadRequest, "2 keys but 1"),
        (lambda s, k: s.put_many([k, "zz"], [payload(0), payload(1)], "a"), BadRequest, "ChunkKey"),
    ],
)
def test_bad_input_gets_a_clear_error_and_changes_nothing(call, exc, match):
    s = make_store()
    s.put(make_keys(1, seed=5)[0], payload(9), "a")
    before = snapshot(s)
    with pytest.raises(exc, match=match):
        call(s, make_keys(1)[0])
    assert snapshot(s) == before


def test_get_into_too_small_buffer_is_an_error_not_a_corruption():
    s = make_store()
    k = make_keys(1)[0]
    s.put(k, payload(0), "a")
    with pytest.raises(BadRequest, match="holds 10 B"):
        s.get(k, "a", out=np.empty(10, np.uint8))
    assert np.array_equal(s.get(k, "a"), payload(0))
    assert s.metrics.checksum_failures.total() == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_bytes=-1), "page_bytes"),
        (dict(dram_pages=-3), "num_pages"),
        (dict(page_bytes=1 << 20, dram_pages=1 << 30), "exceeds this machine"),
        (dict(disk_pages=2), "disk_dir"),
        (dict(disk_pages=2, disk_dir="/no/such/dir"), "does not exist"),
        (dict(page_bytes=1 << 30, disk_pages=1 << 20, disk_dir="/tmp"), "does not fit"),
    ],
)
def test_bad_store_config_names_the_fix(kwargs, match):
    with pytest.raises(BadRequest, match=match):
        make_store(**kwargs)


def test_concurrent_readers_and_writers_never_see_wrong_bytes():
    s = make_store(page_bytes=4096, dram_pages=8)
    keys = make_keys(32)
    errors = []

    def writer(offset):
        for _ in range(20):
            for i in range(offset, 32, 2):
                try:
                    s.put(keys[i], payload(i, 4096), "a")
                except PoolFull:
                    pass

    def reader():
        for _ in range(40):
            for i in range(32):
                got = s.get(keys[i], "a")
                if got is not None and not np.array_equal(got, payload(i, 4096)):
                    errors.append(i)

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 1)] + [
        threading.Thread(target=reader) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert s.tenants.usage("a") == 4096 * len(s)
    assert s.metrics.checksum_failures.total() == 0


def page_bytes_of(s, tier, page):
    return s.slab(tier).page(page).copy()


def test_scrubbing_tenants_leave_no_residue_in_freed_pages(tmp_disk):
    from kvpool import Tenant

    s = make_store(dram_pages=2, disk_pages=2, disk_dir=tmp_disk,
                   tenants=[Tenant("secret", scrub=True), Tenant("plain")])
    ks, kp = make_keys(3, seed=1), make_keys(2, seed=2)
    s.put(kp[0], payload(7), "plain")
    s.put(ks[0], payload(1), "secret")
    where_plain, where_secret = s.locate(kp[0]), s.locate(ks[0])
    s.remove(kp[0], "plain")
    s.remove(ks[0], "secret")
    assert page_bytes_of(s, *where_plain)[:1000].any()  # the control: an ordinary page keeps residue
    assert not page_bytes_of(s, *where_secret).any()  # removed: zeros
    # Demotion frees the DRAM page the chunk leaves: no page of DRAM may still hold its bytes,
    # even the one a short payload of another tenant reuses at once.
    s.put(ks[1], payload(2), "secret")
    s.put(ks[2], payload(3), "secret")
    s.put(kp[1], payload(4, 100), "plain")  # needs a DRAM page: ks[1], the LRU, goes down to disk
    assert s.locate(ks[1])[0] == "disk"
    dram = [page_bytes_of(s, "dram", p) for p in range(2)]
    assert not any(np.array_equal(d[100:1000], payload(2)[100:1000]) for d in dram)
    assert np.array_equal(s.get(ks[1], "secret"), payload(2))  # and the data itself is intact


def test_scrub_must_be_a_bool():
    from kvpool import BadRequest, Tenant

    with pytest.raises(BadRequest, match="scrub must be true or false"):
        Tenant("x", scrub="yes")


@pytest.mark.parametrize("path", ["abort", "expiry", "drain"])
def test_a_scrubbing_writers_reserved_page_is_zeroed_on_every_free_path(path):
    """A writer in another process copies its bytes into the reserved page before it commits: a
    reservation that is aborted, that expires, or that a draining shard ends frees that page,
    and for a scrubbing tenant nothing of what it copied stays (a plain tenant's page, the
    control, keeps it)."""
    from kvpool import Tenant

    s = make_store(dram_pages=4, tenants=[Tenant("secret", scrub=True), Tenant("plain")])
    pages = {}
    for tenant, seed in (("secret", 1), ("plain", 2)):
        keys = make_keys(1, seed=seed)
        hid, (place,) = s.reserve(keys, [1000], tenant, ttl_s=0.0 if path == "expiry" else 30.0)
        s.slab("dram").buf[place.offset : place.offset + 1000] = payload(seed)
        pages[tenant] = (hid, place.offset)
    for hid, _ in pages.values():
        if path == "abort":
            s.abort(hid)
    if path == "expiry":
        assert s.expire_holds() == 2
    if path == "drain":
        assert s.expire_holds(now=float("inf")) == 2  # what a draining shard does before it closes
    buf = s.slab("dram").buf
    assert not buf[pages["secret"][1] : pages["secret"][1] + 1000].any()
    assert np.array_equal(buf[pages["plain"][1] : pages["plain"][1] + 1000], payload(2))  # the control


@pytest.mark.parametrize("share, mallory_leases, alice_stores", [(0.25, 2, True), (1.0, 8, False)])
def test_one_tenants_read_leases_cannot_stop_everyone_elses_writes(share, mallory_leases, alice_stores):
    """A read lease costs its tenant nothing and a leased chunk cannot be evicted: a tenant that
    leases its whole full pool (and renews) would stop every other tenant's writes. Its leases are
    bounded to a share of the pages (beyond, a read is a miss); with no bound (the control, share
    1.0) the victim's write fails with 507."""
    from kvpool import PoolFull, Tenant

    s = make_store(dram_pages=8, tenants=[Tenant("alice"), Tenant("mallory")], max_read_hold_fraction=share,
                   max_hold_ttl_s=5.0)
    keys = make_keys(8, seed=3)
    assert sum(s.put_many(keys, [payload(i) for i in range(8)], "mallory")) == 8
    hid, places = s.lease_reads(keys, "mallory", ttl_s=1e9)  # asks for ever: gets max_hold_ttl_s
    assert len(places) == mallory_leases
    assert s.lease_reads(keys, "mallory")[1] == [] or share == 1.0  # a second lease gets nothing more
    mine = make_keys(4, seed=4)
    if alice_stores:
        assert sum(s.put_many(mine, [payload(i) for i in range(4)], "alice")) == 4
    else:
        with pytest.raises(PoolFull):
            s.put_many(mine, [payload(i) for i in range(4)], "alice")
    assert s.expire_holds(now=time.monotonic() + 6.0) >= 1  # the lease lapsed at the capped TTL
