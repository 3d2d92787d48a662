"""In-place reads of a node's slab (kvpool.node.inplace): a clean read gives exactly the bytes the
copying read (PageTable.read) gives, and a page rewritten or withdrawn while a view is in use is
caught when the view is released (ChunkChanged), never accepted."""

import mmap
import os
import random
import struct

import numpy as np
import pytest

import kvpool.node.inplace as inplace
from kvpool.checksum import checksum
from kvpool.node.inplace import ChunkChanged, views
from kvpool.node.table import PageTable

PAGE = 1 << 16
PAGES = 8


@pytest.fixture
def node(tmp_path):
    """(writer table, reader table, slab as uint8, the published addresses and their bytes)."""
    path = str(tmp_path / "slab")
    with open(path, "wb") as f:
        f.truncate(PAGE * PAGES)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, PAGE * PAGES, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    buf = np.frombuffer(mm, dtype=np.uint8)
    w = PageTable.create(str(tmp_path / "t.kvtab"), PAGE, PAGES)
    r = PageTable.attach(str(tmp_path / "t.kvtab"))
    rng = np.random.default_rng(3)
    addrs, data = [], []
    for i in range(4):
        a = struct.pack("<QQ", random.Random(i).getrandbits(64) | 1, i + 1)
        d = rng.integers(0, 256, PAGE - 64 * i, dtype=np.uint8)
        buf[i * PAGE : i * PAGE + d.shape[0]] = d
        w.publish(a, i * PAGE, d.shape[0], checksum(d))
        addrs.append(a)
        data.append(d)
    yield w, r, buf, addrs, data
    inplace.before_verify = None
    r.close()
    w.close()


def _use(view) -> np.ndarray:
    """What a caller does with a view: copies its bytes out (the vLLM worker's scatter)."""
    return np.array(view.kv, copy=True)


def test_a_clean_in_place_read_gives_the_copying_reads_bytes_without_a_copy(node):
    w, r, buf, addrs, data = node
    got = []
    for view in views(r, buf, addrs, lambda b: b):
        assert np.shares_memory(view.kv, buf)  # the slab's page itself
        with view:
            got.append(_use(view))
        assert view.kv is None  # given back on release
    assert len(got) == 4
    for a, d, g in zip(addrs, data, got):
        copied = r.read(a, buf)
        assert copied is not None and np.array_equal(g, copied) and np.array_equal(g, d)


def test_a_run_ends_at_the_first_chunk_not_found_or_not_decoding(node):
    w, r, buf, addrs, data = node
    w.withdraw(addrs[2])
    assert len([v for v in views(r, buf, addrs, lambda b: b)]) == 2
    small = data[3].shape[0]
    assert len(list(views(r, buf, addrs[::-1][:1] + addrs, lambda b: b if b.shape[0] != small else None))) == 0


def test_a_page_rewritten_between_the_scatter_and_the_validation_is_a_failure(node):
    w, r, buf, addrs, data = node
    it = views(r, buf, addrs, lambda b: b)
    first = next(it)
    with first:
        _use(first)  # verifies

    def rewrite(view):  # the shard reuses the page: withdraw, rewrite, publish new bytes there
        w.withdraw(addrs[1])
        buf[PAGE : PAGE + 16] ^= 0xFF
        w.publish(addrs[1], PAGE, data[1].shape[0], checksum(buf[PAGE : PAGE + data[1].shape[0]]))

    inplace.before_verify = rewrite
    second = next(it)
    _use(second)
    with pytest.raises(ChunkChanged):
        second.release()  # the checksum matches the new bytes, the slot's seq does not
    inplace.before_verify = None
    again = next(views(r, buf, addrs[1:2], lambda b: b))
    with again:
        assert not np.array_equal(_use(again), data[1])  # the new chunk, verified on its own


def test_bytes_changed_under_an_unchanged_slot_fail_the_checksum(node):
    w, r, buf, addrs, data = node

    def tear(view):  # a writer breaking the ordering rule: the slot stays, the bytes change
        buf[2 * PAGE] ^= 1

    inplace.before_verify = tear
    view = next(views(r, buf, addrs[2:3], lambda b: b))
    _use(view)
    with pytest.raises(ChunkChanged):
        with view:
            pass
    inplace.before_verify = None
    assert r.read(addrs[2], buf) is None  # the copying read agrees: not the published chunk


def test_a_withdraw_or_a_stale_table_during_the_read_is_a_failure(node, tmp_path):
    w, r, buf, addrs, data = node
    inplace.before_verify = lambda view: w.withdraw(addrs[0])
    view = next(views(r, buf, addrs, lambda b: b))
    with pytest.raises(ChunkChanged):
        view.release()
    view.release()  # once: a second release does nothing
    inplace.before_verify = lambda view: PageTable.create(str(tmp_path / "t.kvtab"), PAGE, PAGES).close()
    view = next(views(r, buf, addrs[3:], lambda b: b))
    with pytest.raises(ChunkChanged):
        view.release()


def test_a_node_pools_in_place_views_match_load_and_a_changed_page_fails(tmp_path, monkeypatch):
    """NodePool over this node's shard (a real one-node Ray pool): the in-place views are the
    slab's pages, with ``load``'s values; bytes changed while a view is in use fail its release."""
    import torch

    from kvpool.cluster.local import local_cluster_pool
    from kvpool.connectors.pools import spec_for
    from kvpool.tenants import Tenant

    monkeypatch.setenv("KVPOOL_RUN_DIR", str(tmp_path))  # before ray.init: the shard inherits it
    for k in ("KVPOOL_SECRET", "KVPOOL_SECRET_FILE"):
        monkeypatch.delenv(k, raising=False)
    spec = spec_for("inplace-model", 2, 1, 32, "float32", chunk_tokens=16)  # one KV head: one slice a chunk
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(spec.chunk_shape, generator=g) for _ in range(3)]
    with local_cluster_pool(spec, [Tenant("a")], dram_chunks=16) as pool:
        keys = pool.keys("a", list(range(3 * spec.chunk_tokens)))
        assert pool.save("a", keys, data) == 3
        slab = pool.client._attached().slab.buf
        seen = []
        for view in pool.load_views_in_place("a", keys):
            assert np.shares_memory(view.kv.numpy(), slab)
            with view:
                seen.append(view.kv.clone())
        assert len(seen) == 3 and all(torch.equal(s, d) for s, d in zip(seen, data))
        assert all(torch.equal(s, x) for s, x in zip(seen, pool.load("a", keys)))

        def tear(view):
            view.data[0] ^= 1

        monkeypatch.setattr(inplace, "before_verify", tear)
        it = pool.load_views_in_place("a", keys)
        view = next(it)
        view.kv.clone()
        with pytest.raises(ChunkChanged):
            view.release()
        it.close()
        monkeypatch.setattr(inplace, "before_verify", None)
        assert pool.load("a", keys) == []  # the copying read agrees: the chunk no longer verifies
