"""The shared-memory page table: a single writer publishes where chunks lie in its slab; readers in
other processes find and copy them without a call to the writer, and a copy that raced a withdraw
or a page rewrite is a miss, never wrong bytes."""

import mmap
import multiprocessing as mp
import os
import random
import struct
import time

import numpy as np
import pytest
import xxhash

import kvpool.node.table as table_mod
from kvpool.checksum import checksum, copy_with_checksum
from kvpool.errors import BadRequest
from kvpool.node.table import PageTable
from kvpool.node.table_file import HEADER_BYTES, SLOT_BYTES, capacity_for

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _addr(rng: random.Random, home: int | None = None, mask: int = 0) -> bytes:
    """A random address; with ``home``, one whose probe run starts at slot ``home``."""
    hi = rng.getrandbits(64) | 1
    lo = rng.getrandbits(64)
    if home is not None:
        lo = (lo & ~mask) | home
    return struct.pack("<QQ", hi, lo)


def _slab(path: str, nbytes: int, write: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    if write:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def _seqs(t: PageTable) -> list[int]:
    return [struct.unpack_from("<Q", t._mm, HEADER_BYTES + i * SLOT_BYTES)[0] for i in range(t.capacity)]


def test_capacity_is_a_power_of_two_at_least_twice_the_pages():
    assert capacity_for(0) == 8 and capacity_for(4) == 8 and capacity_for(5) == 16
    assert capacity_for(1000) == 2048 and capacity_for(1024) == 2048


def test_random_ops_with_forced_collisions_match_a_dict_model(tmp_path):
    pages = 32
    w = PageTable.create(str(tmp_path / "t.kvtab"), 64, pages)
    r = PageTable.attach(str(tmp_path / "t.kvtab"))
    assert w.capacity == 64 and r.capacity == 64
    mask = w.capacity - 1
    rng = random.Random(7)
    # a few homes only, one at the last slot, so runs are long, overlap and wrap around the end
    homes = [0, 1, 5, mask - 1, mask]
    pool = [_addr(rng, rng.choice(homes), mask) for _ in range(50)] + [_addr(rng) for _ in range(30)]
    model: dict[bytes, tuple[int, int, int]] = {}
    for step in range(3000):
        a = rng.choice(pool)
        if rng.random() < 0.55 and (a in model or len(model) < pages):
            v = (rng.randrange(pages) * 64, rng.randrange(65), rng.getrandbits(64))
            w.publish(a, *v)
            model[a] = v
        else:
            assert w.withdraw(a) == (a in model)
            model.pop(a, None)
        if step % 50 == 0 or step > 2950:
            assert len(w) == len(r) == len(model)
            for b in pool:
                e = r.find(b)
                if b in model:
                    assert e is not None and (e.offset, e.nbytes, e.checksum) == model[b]
                    assert r.valid(e)
                else:
                    assert e is None
            assert all(s % 2 == 0 for s in _seqs(w))
    # empty it by withdrawals only: every remaining address stays findable after each shift
    for a in list(model):
        assert w.withdraw(a)
        del model[a]
        assert all(r.find(b) is not None for b in model)
    assert len(w) == 0 and all(r.find(b) is None for b in pool)
    r.close()
    w.close()


def test_every_write_or_shift_bumps_the_slot_seq_by_two(tmp_path):
    w = PageTable.create(str(tmp_path / "t.kvtab"), 64, 8)
    mask = w.capacity - 1
    rng = random.Random(1)
    a, b, c = (_addr(rng, 3, mask) for _ in range(3))
    w.publish(a, 0, 10, 1)
    w.publish(b, 64, 10, 2)
    w.publish(c, 128, 10, 3)
    ea, eb, ec = (w.find(x) for x in (a, b, c))
    assert (ea.slot, eb.slot, ec.slot) == (3, 4, 5) and ea.seq == eb.seq == ec.seq == 2
    w.publish(a, 0, 11, 1)  # overwrite in place
    assert not w.valid(ea) and w.find(a).seq == 4 and w.find(a).nbytes == 11
    assert w.withdraw(a)  # b and c shift back one slot each; their old slots change
    assert not w.valid(eb) and not w.valid(ec)
    assert w.find(b).slot == 3 and w.find(c).slot == 4 and w.find(b).offset == 64
    assert _seqs(w)[3:6] == [6, 4, 4]
    assert not w.withdraw(a) and len(w) == 2
    e = w.find(b)
    w.clear()
    assert len(w) == 0 and not w.valid(e) and w.find(b) is None and w.find(c) is None
    assert all(s % 2 == 0 for s in _seqs(w))
    w.close()


def test_a_full_table_is_an_assertion_and_bad_input_a_bad_request(tmp_path):
    w = PageTable.create(str(tmp_path / "t.kvtab"), 64, 4)
    rng = random.Random(2)
    for i in range(w.capacity - 1):
        w.publish(_addr(rng), i * 8, 8, 0)
    with pytest.raises(AssertionError, match="full"):
        w.publish(_addr(rng), 0, 8, 0)
    for bad in (b"short", bytes(16)):
        with pytest.raises(BadRequest):
            w.publish(bad, 0, 8, 0)
    with pytest.raises(BadRequest, match="inside the slab"):
        w.publish(_addr(rng), 200, 100, 0)
    with pytest.raises(BadRequest, match="checksum"):
        w.publish(_addr(rng), 0, 8, -1)
    r = PageTable.attach(str(tmp_path / "t.kvtab"))
    with pytest.raises(RuntimeError, match="read-only"):
        r.publish(_addr(rng), 0, 8, 0)
    assert r.find(bytes(16)) is None
    r.close()
    w.close()


def test_attach_errors_name_the_fix_and_the_file_is_private(tmp_path):
    with pytest.raises(BadRequest, match="shard running"):
        PageTable.attach(str(tmp_path / "missing.kvtab"))
    (tmp_path / "small").write_bytes(b"KVPTAB01")
    with pytest.raises(BadRequest, match="too small"):
        PageTable.attach(str(tmp_path / "small"))
    (tmp_path / "foreign").write_bytes(b"NOTATABL" + bytes(200))
    with pytest.raises(BadRequest, match="not a kvpool page table.*point the engine"):
        PageTable.attach(str(tmp_path / "foreign"))
    path = str(tmp_path / "t.kvtab")
    w = PageTable.create(path, 64, 4)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == ["foreign", "small", "t.kvtab"]  # no temporary left behind
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    with pytest.raises(BadRequest, match="version 99.*same kvpool version"):
        PageTable.attach(path)
    w.close()
    assert not os.path.exists(path)


def test_create_over_a_mapped_table_leaves_the_old_reader_intact_and_stale(tmp_path):
    path = str(tmp_path / "t.kvtab")
    _, slab = _slab(str(tmp_path / "slab"), 4 * 64)
    slab[:64] = 7
    rng = random.Random(3)
    a = _addr(rng)
    w1 = PageTable.create(path, 64, 4)
    w1.publish(a, 0, 64, checksum(slab[:64]))
    old = PageTable.attach(path)
    assert old.writer_pid == os.getpid() and not old.stale
    assert np.array_equal(old.read(a, slab), slab[:64])
    w2 = PageTable.create(path, 64, 4)
    # the old mapping is still whole (no SIGBUS), but stale: its reads miss
    assert old.find(a) is not None and old.stale and old.read(a, slab) is None
    new = PageTable.attach(path)
    assert new.epoch > old.epoch > old._attach_epoch and not new.stale
    assert new.find(a) is None
    w2.publish(a, 0, 64, checksum(slab[:64]))
    assert np.array_equal(new.read(a, slab), slab[:64])
    w1.close()  # not its file any more: it must leave w2's in place
    assert os.path.exists(path) and not new.stale
    w2.close()
    assert new.stale and not os.path.exists(path)
    old.close()
    new.close()


def test_read_into_out_and_bad_buffers(tmp_path):
    _, slab = _slab(str(tmp_path / "slab"), 4 * 64)
    slab[:] = np.arange(256, dtype=np.uint8)
    w = PageTable.create(str(tmp_path / "t.kvtab"), 64, 4)
    a = _addr(random.Random(4))
    w.publish(a, 64, 50, checksum(slab[64:114]))
    out = np.zeros(100, dtype=np.uint8)
    got = w.read(a, slab, out)
    assert got is not None and got.base is out and np.array_equal(got, slab[64:114])
    assert w.read(a, slab, np.zeros(49, dtype=np.uint8)) is None
    assert w.read(a, slab[:100]) is None  # a slab too small for the entry: a miss, not a short copy
    w.close()


def test_a_withdraw_and_rewrite_between_find_and_validation_is_a_miss(tmp_path, monkeypatch):
    path = str(tmp_path / "t.kvtab")
    _, slab = _slab(str(tmp_path / "slab"), 2 * 4096)
    old, new = np.full(4096, 1, np.uint8), np.full(4096, 2, np.uint8)
    slab[:4096] = old
    w = PageTable.create(path, 4096, 2)
    r = PageTable.attach(path)
    a = _addr(random.Random(5))
    w.publish(a, 0, 4096, checksum(old))

    # split by hand: find, then the writer withdraws, rewrites the page and republishes, then copy
    e = r.find(a)
    assert w.withdraw(a)
    slab[:4096] = new
    w.publish(a, 0, 4096, checksum(new))
    dst = np.empty(4096, np.uint8)
    digest = copy_with_checksum(dst, slab[e.offset : e.offset + e.nbytes])
    assert np.array_equal(dst, new)  # the copy did get the new bytes...
    assert not r.valid(e) and digest != e.checksum  # ...and both guards reject them

    real = copy_with_checksum

    def racing_copy(action):
        def copy(dst, src):
            half = src.shape[0] // 2
            real(dst[:half], src[:half])
            action()  # the writer runs in the middle of the reader's copy
            return real(dst, src)

        return copy

    def withdraw_rewrite_publish():
        w.withdraw(a)
        slab[:4096] = old
        w.publish(a, 0, 4096, checksum(old))

    monkeypatch.setattr(table_mod, "copy_with_checksum", racing_copy(withdraw_rewrite_publish))
    assert r.read(a, slab) is None

    # the seq alone guards: same bytes republished, a consistent copy, still a miss
    def withdraw_republish():
        w.withdraw(a)
        w.publish(a, 0, 4096, checksum(old))

    monkeypatch.setattr(table_mod, "copy_with_checksum", racing_copy(withdraw_republish))
    assert r.read(a, slab) is None

    # the checksum alone guards: a writer that breaks the ordering rule (rewrites without a withdraw)
    def rewrite_only():
        slab[:4096] = new

    monkeypatch.setattr(table_mod, "copy_with_checksum", racing_copy(rewrite_only))
    assert r.read(a, slab) is None

    monkeypatch.setattr(table_mod, "copy_with_checksum", real)
    w.publish(a, 0, 4096, checksum(new))
    assert np.array_equal(r.read(a, slab), new)
    r.close()
    w.close()


# ---------------------------------------------------------------- other processes

PAGE = 64 * 1024
PAGES = 16
NADDR = 28  # more addresses than pages, plus some never published: there are always misses


def _address(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"addr-%d" % i)


RAMP = (np.arange(PAGE + 256) & 0xFF).astype(np.uint8)


def _body(i: int, version: int, n: int) -> np.ndarray:
    """Bytes 16.. of what address ``i`` holds at ``version`` (a view: costs nothing to make)."""
    start = (i * 31 + version * 7) & 0xFF
    return RAMP[start : start + n - 16]


def _write_content(dst: np.ndarray, i: int, version: int) -> int:
    """Writes what address ``i`` holds at ``version`` into ``dst``: its first 16 bytes say which
    (version, address), the rest follows from them; returns the checksum."""
    dst[:16] = np.frombuffer(struct.pack("<QQ", version, i), dtype=np.uint8)
    dst[16:] = _body(i, version, dst.shape[0])
    return checksum(dst)


def _reader(table_path, slab_path, addresses, seconds, q):
    t = PageTable.attach(table_path)
    _, slab = _slab(slab_path, PAGE * PAGES, write=False)
    if seconds == 0:  # read each address once, return the bytes
        q.put([None if (x := t.read(a, slab)) is None else x.tobytes() for a in addresses])
        return
    hits = misses = wrong = rejected = 0
    out = np.empty(PAGE, np.uint8)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i, a in enumerate(addresses):
            if i & 1:
                got = t.read(a, slab, out)
            else:  # the same steps by hand, to count the copies that validation rejects
                e = t.find(a)
                got = None
                if e is not None:
                    dst = out[: e.nbytes]
                    digest = copy_with_checksum(dst, slab[e.offset : e.offset + e.nbytes])
                    if t.valid(e) and digest == e.checksum:
                        got = dst
                    else:
                        rejected += 1
            if got is None:
                misses += 1
                continue
            hits += 1
            version, owner = struct.unpack_from("<QQ", got)
            if owner != i or not np.array_equal(got[16:], _body(i, version, got.shape[0])):
                wrong += 1
    q.put((hits, misses, wrong, rejected))


def _shm_dir(tmp_path) -> str:
    return SHM or str(tmp_path)


def test_a_reader_in_another_process_reads_what_the_writer_published(tmp_path):
    d = _shm_dir(tmp_path)
    tpath, spath = os.path.join(d, f"kvt-{os.getpid()}-a.kvtab"), os.path.join(d, f"kvt-{os.getpid()}-a.slab")
    _, slab = _slab(spath, PAGE * PAGES)
    w = PageTable.create(tpath, PAGE, PAGES)
    try:
        addresses = [_address(i) for i in range(6)]
        expect = []
        for i, a in enumerate(addresses[:5]):
            data = np.random.default_rng(i).integers(0, 256, PAGE - i * 100, dtype=np.uint8)
            slab[i * PAGE : i * PAGE + data.shape[0]] = data
            w.publish(a, i * PAGE, data.shape[0], checksum(data))
            expect.append(data.tobytes())
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_reader, args=(tpath, spath, addresses, 0, q))
        p.start()
        got = q.get(timeout=60)
        p.join(timeout=30)
        assert got == expect + [None]
    finally:
        w.close()
        os.unlink(spath)  # the mapping goes with the last view of it


def test_concurrent_withdraw_rewrite_publish_never_yields_wrong_bytes(tmp_path):
    d = _shm_dir(tmp_path)
    tpath, spath = os.path.join(d, f"kvt-{os.getpid()}-b.kvtab"), os.path.join(d, f"kvt-{os.getpid()}-b.slab")
    _, slab = _slab(spath, PAGE * PAGES)
    w = PageTable.create(tpath, PAGE, PAGES)
    try:
        addresses = [_address(i) for i in range(NADDR)]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_reader, args=(tpath, spath, addresses, 3.0, q))
        p.start()
        rng = random.Random(11)
        placed: dict[int, int] = {}  # address index -> page
        free = list(range(PAGES))
        version = writes = 0
        while p.is_alive():
            i = rng.randrange(NADDR - 4)  # the last 4 are never published
            if i in placed:
                page = placed.pop(i)
                assert w.withdraw(addresses[i])  # withdraw BEFORE the page is rewritten
                if rng.random() < 0.3:
                    free.append(page)
                    continue
            elif free:
                page = free.pop(rng.randrange(len(free)))
            else:
                victim = rng.choice(list(placed))
                page = placed.pop(victim)
                assert w.withdraw(addresses[victim])
            version += 1
            n = PAGE - 16 * rng.randrange(8)
            digest = _write_content(slab[page * PAGE : page * PAGE + n], i, version)
            w.publish(addresses[i], page * PAGE, n, digest)
            placed[i] = page
            writes += 1
            if not q.empty():
                break
        hits, misses, wrong, rejected = q.get(timeout=60)
        p.join(timeout=30)
        print(f"stress: {writes} writes, {hits} hits, {misses} misses ({rejected} rejected after the copy)")
        assert wrong == 0
        assert hits > 0 and misses > 0 and writes > 100, (hits, misses, writes)
    finally:
        w.close()
        os.unlink(spath)  # the mapping goes with the last view of it
