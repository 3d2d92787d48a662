"""Another process on the same node reads and writes a store's DRAM pages directly: the store
reserves and leases, the other process copies (and checksums), then commits or releases."""

import multiprocessing as mp
import os

import numpy as np
import pytest
from conftest import make_keys, payload

from kvpool import BadRequest, ChunkStore, QuotaExceeded, StoreConfig, Tenant, TenantRegistry
from kvpool.checksum import checksum, copy_with_checksum
from kvpool.errors import ReservationGone
from kvpool.slab import Slab

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def shm_store(tmp_path, pages=8, quota=10**9, name="t"):
    cfg = StoreConfig(1024, pages, dram_dir=SHM or str(tmp_path), name=f"{name}-{os.getpid()}-{id(tmp_path)}",
                      policy="lru")
    return ChunkStore(cfg, TenantRegistry([Tenant("a", quota_bytes=quota), Tenant("b")]))


def _writer(path, offsets, seed, q):
    slab = Slab.attach(path, 1024, 8)
    sums = []
    for i, off in enumerate(offsets):
        src = payload(seed + i)
        sums.append(copy_with_checksum(slab.buf[off : off + len(src)], src))
    q.put(sums)


def test_another_process_writes_then_reads_through_the_mapped_slab(tmp_path):
    s = shm_store(tmp_path)
    try:
        keys = make_keys(3)
        hid, places = s.reserve(keys, [1000] * 3, "a")
        assert [p.key for p in places] == keys
        assert not any(s.contains_many(keys, "a"))  # bytes before index: nothing findable yet
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_writer, args=(s.slab("dram").path, [pl.offset for pl in places], 0, q))
        p.start()
        sums = q.get(timeout=60)
        p.join(timeout=30)
        assert s.commit(hid, sums) == 3
        assert all(np.array_equal(s.get(k, "a"), payload(i)) for i, k in enumerate(keys))
        # and the other way: lease, copy out of the mapping, verify, release
        rid, reads = s.lease_reads(keys + make_keys(1, seed=9), "a")
        assert len(reads) == 3
        other = Slab.attach(s.slab("dram").path, 1024, 8)
        for i, r in enumerate(reads):
            got = other.buf[r.offset : r.offset + r.nbytes].copy()
            assert checksum(got) == r.checksum and np.array_equal(got, payload(i))
        s.release(rid)
        assert s.stats()["tiers"]["dram"]["leased_pages"] == 0
    finally:
        s.close()
    assert not os.path.exists(os.path.join(SHM or str(tmp_path), f"kvpool-{s.config.name}-dram.kvslab"))


def test_reservations_charge_quota_up_front_and_abort_or_expire_gives_it_back(tmp_path):
    s = shm_store(tmp_path, quota=2500)
    try:
        keys = make_keys(3)
        with pytest.raises(QuotaExceeded):
            s.reserve(keys, [1000] * 3, "a")
        assert s.tenants.usage("a") == 0
        hid, places = s.reserve(keys[:2], [1000, 1000], "a")
        assert s.tenants.usage("a") == 2000
        s.abort(hid)
        assert s.tenants.usage("a") == 0 and s.stats()["tiers"]["dram"]["pages_used"] == 0
        hid, places = s.reserve(keys[:2], [1000, 1000], "a", ttl_s=0.0)
        assert s.expire_holds() == 1  # the writer never came back
        assert s.tenants.usage("a") == 0 and len(s) == 0
        with pytest.raises(ReservationGone, match="expired") as e:  # a failed write, not the caller's bad input
            s.commit(hid, [0, 0])
        assert e.value.status == 410
    finally:
        s.close()


def test_partial_commit_keeps_the_copied_prefix(tmp_path):
    s = shm_store(tmp_path)
    try:
        keys = make_keys(3)
        hid, places = s.reserve(keys, [1000] * 3, "a")
        slab = s.slab("dram")
        sums = [copy_with_checksum(slab.buf[p.offset : p.offset + 1000], payload(i)) for i, p in enumerate(places[:2])]
        assert s.commit(hid, sums) == 2
        assert s.contains_many(keys, "a") == [True, True, False]
        assert s.tenants.usage("a") == 2000
    finally:
        s.close()


def test_a_reader_that_finds_bad_bytes_drops_the_chunk(tmp_path):
    s = shm_store(tmp_path)
    try:
        k = make_keys(1)[0]
        s.put(k, payload(1), "a")
        rid, (r,) = s.lease_reads([k], "a")
        buf = s.slab("dram").buf
        buf[r.offset] ^= 1
        assert checksum(buf[r.offset : r.offset + r.nbytes]) != r.checksum
        s.release(rid)  # the reader's word drops nothing: the shard's verify reads it again
        assert s.contains(k, "a") and s.get_many([k], "a", touch=False) == [None]
        assert not s.contains(k, "a") and s.metrics.checksum_failures.get("dram") == 1
    finally:
        s.close()


def test_other_tenants_get_no_placement(tmp_path):
    s = shm_store(tmp_path)
    try:
        k = make_keys(1)[0]
        s.put(k, payload(1), "a")
        rid, reads = s.lease_reads([k], "b")
        assert reads == []
        s.release(rid)
    finally:
        s.close()


def test_attach_to_a_missing_slab_is_a_clear_error(tmp_path):
    with pytest.raises(BadRequest, match="is the shard on this node running"):
        Slab.attach(str(tmp_path / "nope"), 1024, 8)
