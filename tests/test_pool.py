import numpy as np
import pytest
import torch

from kvpool import KVSpec, LayoutMismatch, Tenant, TenantRegistry
from kvpool.pool import LocalPool

SPEC = KVSpec("test/tiny", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, chunk_tokens=8)


def make_pool(dram_chunks=8):
    return LocalPool.create(SPEC, TenantRegistry([Tenant("a"), Tenant("b")]), dram_chunks)


def chunks_for(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.chunk_shape, generator=g) for _ in range(n)]


def test_save_then_load_the_leading_run():
    pool = make_pool()
    tokens = np.arange(8 * 3 + 5)  # 3 whole chunks and a partial one
    keys = pool.keys("a", tokens)
    assert len(keys) == 3
    kv = chunks_for(3)
    assert pool.save("a", keys, kv) == 3
    assert pool.lookup("a", keys) == 24
    loaded = pool.load("a", keys)
    assert len(loaded) == 3 and all(torch.equal(x, y) for x, y in zip(loaded, kv))
    # a prompt that diverges in chunk 2 hits only the first two chunks
    other = tokens.copy()
    other[20] += 1
    keys2 = pool.keys("a", other)
    assert pool.lookup("a", keys2) == 16 and len(pool.load("a", keys2)) == 2
    m = pool.store.metrics
    assert m.hits_tokens.get("a") == 24 + 16 and m.misses_tokens.get("a") == 8


def test_other_tenant_misses_the_same_prompt():
    pool = make_pool()
    tokens = np.arange(16)
    pool.save("a", pool.keys("a", tokens), chunks_for(2))
    assert pool.keys("a", tokens) != pool.keys("b", tokens)
    assert pool.lookup("b", pool.keys("b", tokens)) == 0
    assert pool.load("b", pool.keys("a", tokens)) == []  # even a guessed key of a's is a miss


def test_shared_prefix_is_visible_to_every_tenant():
    pool = make_pool()
    system_prompt = np.arange(16)
    keys_a = pool.keys("a", system_prompt, shared=True)
    pool.save("a", keys_a, chunks_for(2), shared=True)
    keys_b = pool.keys("b", system_prompt, shared=True)
    assert keys_b == keys_a
    assert pool.lookup("b", keys_b) == 16


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(SPEC.chunk_shape, dtype=torch.float16), "dtype"),
        (torch.zeros(2, 2, 5, 2, 8), "partial chunk of 5 tokens"),
        (torch.zeros(2, 2, 8, 4, 8), "shape"),
        (np.zeros(SPEC.chunk_shape, np.float32), "torch.Tensor"),
    ],
)
def test_layout_mismatch_names_the_fix_and_stores_nothing(bad, match):
    pool = make_pool()
    keys = pool.keys("a", np.arange(16))
    with pytest.raises(LayoutMismatch, match=match):
        pool.save("a", keys, [chunks_for(1)[0], bad])
    assert len(pool.store) == 0 and pool.tenants.usage("a") == 0


def test_more_chunks_than_keys_is_rejected():
    pool = make_pool()
    with pytest.raises(LayoutMismatch, match="only whole chunks"):
        pool.save("a", pool.keys("a", np.arange(12)), chunks_for(2))


def test_store_pages_too_small_for_the_spec():
    from kvpool import ChunkStore, StoreConfig

    store = ChunkStore(StoreConfig(page_bytes=100, dram_pages=2), TenantRegistry([Tenant("a")]))
    with pytest.raises(LayoutMismatch, match="page_bytes >= spec.chunk_nbytes"):
        LocalPool(SPEC, store)


# ---------------------------------------------------------------------------------------------
# load_views: the leading run verified in place, leased until each view is released


def leased_pages(pool):
    return pool.store.stats()["tiers"]["dram"]["leased_pages"]


def test_load_views_gives_the_load_run_in_place_and_leases_until_release():
    pool = make_pool()
    keys = pool.keys("a", np.arange(8 * 3))
    kv = chunks_for(3)
    pool.save("a", keys, kv)
    it = pool.load_views("a", keys)
    assert leased_pages(pool) == 0  # lazy: nothing read before the iterator is advanced
    first = next(it)
    assert torch.equal(first.kv, kv[0]) and first.kv.dtype == torch.float32
    assert not first.data.flags.writeable
    tier, page = pool.store.locate(pool.addresses("a", keys)[0])
    assert first.kv.data_ptr() == pool.store.slab(tier).page(page).ctypes.data  # the pool's page, no copy
    assert leased_pages(pool) == 1
    rest = list(it)
    assert [torch.equal(v.kv, c) for v, c in zip(rest, kv[1:])] == [True, True]
    assert leased_pages(pool) == 3  # every view stays leased until its release
    first.release()
    for v in rest:
        with v:
            pass
    assert leased_pages(pool) == 0
    assert pool.store.metrics.hits_tokens.get("a") == 24


def test_load_views_stops_at_a_miss_like_load():
    pool = make_pool()
    tokens = np.arange(8 * 3)
    keys = pool.keys("a", tokens)
    pool.save("a", keys, chunks_for(3))
    other = tokens.copy()
    other[20] += 1  # the third chunk differs
    keys2 = pool.keys("a", other)
    views = list(pool.load_views("a", keys2))
    assert len(views) == len(pool.load("a", keys2)) == 2
    for v in views:
        v.release()
    m = pool.store.metrics
    assert m.hits_tokens.get("a") == 16 + 16 and m.misses_tokens.get("a") == 8 + 8
    assert list(pool.load_views("b", keys)) == []  # another tenant's chunks are misses


def test_load_views_drops_a_corrupt_chunk_and_ends_the_run():
    pool = make_pool()
    keys = pool.keys("a", np.arange(8 * 3))
    kv = chunks_for(3)
    pool.save("a", keys, kv)
    tier, page = pool.store.locate(pool.addresses("a", keys)[1])
    pool.store.slab(tier).page(page)[5] ^= 0x10
    views = list(pool.load_views("a", keys))
    assert len(views) == 1 and torch.equal(views[0].kv, kv[0])
    views[0].release()
    assert leased_pages(pool) == 0
    assert pool.store.metrics.checksum_failures.get("dram") == 1
    assert pool.lookup("a", keys) == 8  # the corrupt chunk is gone; the next request recomputes it
    assert pool.store.metrics.misses_tokens.get("a") == 16


def test_load_views_closed_early_reads_nothing_more():
    pool = make_pool()
    keys = pool.keys("a", np.arange(8 * 3))
    pool.save("a", keys, chunks_for(3))
    it = pool.load_views("a", keys)
    with next(it):
        pass
    it.close()
    assert leased_pages(pool) == 0
    m = pool.store.metrics
    assert m.hits_tokens.get("a") == 8 and m.misses_tokens.get("a") == 0
    assert pool.store.metrics.hits_chunks.get("a") == 1


def test_load_views_checks_the_tenant_before_reading():
    from kvpool import UnknownTenant

    pool = make_pool()
    keys = pool.keys("a", np.arange(8))
    pool.save("a", keys, chunks_for(1))
    with pytest.raises(UnknownTenant):
        pool.load_views("nobody", keys)  # raised by the call, not by the first next()
    assert leased_pages(pool) == 0


def test_load_views_of_a_misaligned_page_still_gives_the_verified_chunk():
    from kvpool import ChunkStore, StoreConfig

    store = ChunkStore(StoreConfig(page_bytes=SPEC.chunk_nbytes + 1, dram_pages=4), TenantRegistry([Tenant("a")]))
    pool = LocalPool(SPEC, store)  # page 1 starts at an odd address: no float32 view over it
    keys = pool.keys("a", np.arange(8 * 2))
    kv = chunks_for(2)
    pool.save("a", keys, kv)
    views = list(pool.load_views("a", keys))
    assert [torch.equal(v.kv, c) for v, c in zip(views, kv)] == [True, True]
    assert all(v.kv.data_ptr() % 4 == 0 for v in views)  # page 1's chunk was copied to an aligned tensor
    for v in views:
        v.release()
    assert store.stats()["tiers"]["dram"]["leased_pages"] == 0


@pytest.mark.parametrize("policy", ["request-fifo", "request-lru", "tiered"])
def test_requests_through_two_pools_and_the_store_are_three_requests(policy):
    """Request ids come from the store alone: two pools on one store (two engines' connectors) and
    a write straight to the store once each minted id 1, and whole-request policies took three
    requests for one. Filling the store must evict the oldest request's chunks, and only them."""
    from kvpool.store import ChunkStore, StoreConfig

    store = ChunkStore(StoreConfig(SPEC.chunk_nbytes, 6, policy=policy), TenantRegistry([Tenant("a")]))
    one, two = LocalPool(SPEC, store), LocalPool(SPEC, store)
    first = one.keys("a", np.arange(16))
    assert one.save("a", first, chunks_for(2, seed=1)) == 2
    direct = one.keys("a", np.arange(100, 116))
    assert sum(store.put_many(one.addresses("a", direct), [c.reshape(-1).view(torch.uint8).numpy() for c in chunks_for(2, seed=2)],
                              "a")) == 2
    second = two.keys("a", np.arange(200, 216))
    assert two.save("a", second, chunks_for(2, seed=3)) == 2
    third = one.keys("a", np.arange(300, 316))
    assert one.save("a", third, chunks_for(2, seed=4)) == 2  # the store is full: one request must go
    assert one.lookup("a", first) == 0
    assert [one.lookup("a", k) for k in (direct, second, third)] == [16, 16, 16]
