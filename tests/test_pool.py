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
