"""Chunks of parallel engines (kvpool.slices): what each tensor-parallel rank and pipeline stage
stores is the same whatever the writer's TP size, so a reader at any other TP size finds and
loads exactly its heads; a hit needs every slice."""

from __future__ import annotations

import pytest
import torch

from kvpool import KVSpec, Tenant, TenantRegistry
from kvpool.errors import BadRequest
from kvpool.keys import ChunkKey
from kvpool.pool import LocalPool
from kvpool.slices import SlicedPool, Slicing, tp_heads
from kvpool.store import ChunkStore, StoreConfig

SPEC = KVSpec("test/tp", num_layers=4, num_kv_heads=8, head_dim=8, dtype="float32", block_size=4, chunk_tokens=8)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_head_is_held_by_exactly_one_writing_rank(tp):
    held = [h for r in range(tp) for h in tp_heads(8, tp, r)[0]]
    assert sorted(held) == list(range(8)) and all(tp_heads(8, tp, r)[1] for r in range(tp))


def test_more_ranks_than_heads_replicate_each_head_and_the_first_replica_writes():
    got = [tp_heads(2, 8, r) for r in range(8)]
    assert [list(h) for h, _ in got] == [[0]] * 4 + [[1]] * 4
    assert [w for _, w in got] == [True, False, False, False, True, False, False, False]


@pytest.mark.parametrize("heads,tp,fix", [(8, 3, "divides 8"), (4, 6, "multiple of the model's 4")])
def test_a_tp_size_the_heads_do_not_split_over_is_refused_with_the_fix(heads, tp, fix):
    with pytest.raises(BadRequest, match=fix):
        tp_heads(heads, tp, 0)


def test_slice_keys_do_not_depend_on_the_writers_tp_size():
    keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
    written = {tp: {k for r in range(tp) if Slicing.of(SPEC, tp, r).writes
                    for k in Slicing.of(SPEC, tp, r).keys(keys)} for tp in (1, 2, 4, 8, 16)}
    assert all(w == written[1] for w in written.values())
    assert written[1] == set(Slicing.of(SPEC).all_keys(keys)) and len(written[1]) == 3 * 8
    assert len(set(Slicing.of(SPEC, 2, 0).keys(keys)) & set(Slicing.of(SPEC, 2, 1).keys(keys))) == 0


def test_pipeline_stages_have_their_own_slices_and_a_hit_needs_all_of_them():
    keys = [ChunkKey(bytes([7]) * 16)]
    stages = ((0, 1), (1, 4))
    s0, s1 = (Slicing.of(SPEC, 2, 0, stages, p) for p in (0, 1))
    assert set(s0.keys(keys)).isdisjoint(s1.keys(keys))
    assert s0.per_chunk == 16 and set(s0.all_keys(keys)) == set(s1.all_keys(keys))
    assert s0.slice_spec(SPEC).chunk_shape == (1, 2, 8, 1, 8) and s1.slice_spec(SPEC).chunk_shape == (3, 2, 8, 1, 8)
    with pytest.raises(BadRequest, match="do not cover layers"):
        Slicing.of(SPEC, stages=((0, 2), (3, 4)))


def _store(pages: int = 256) -> ChunkStore:
    return ChunkStore(StoreConfig(page_bytes=Slicing.of(SPEC).slice_spec(SPEC).chunk_nbytes, dram_pages=pages),
                      TenantRegistry([Tenant("a"), Tenant("b")]))


def _rank_pool(store: ChunkStore, tp: int = 1, rank: int = 0, stages=(), pp_rank: int = 0) -> SlicedPool:
    """What an engine rank opens (kvpool.connectors.pools.open_pool does the same over its store)."""
    s = Slicing.of(SPEC, tp, rank, stages, pp_rank)
    return SlicedPool(LocalPool(s.slice_spec(SPEC), store, keyed_as=SPEC), SPEC, s)


def _rank_part(chunk: torch.Tensor, s: Slicing) -> torch.Tensor:
    a, b = s.layers
    return chunk[a:b, ..., s.heads.start: s.heads.stop, :]


def _chunks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.chunk_shape, generator=g) for _ in range(n)]


def _save_all(store, tp: int, keys, chunks, ranks=None) -> None:
    for r in range(tp) if ranks is None else ranks:  # each rank saves its part of every chunk
        pool = _rank_pool(store, tp, r)
        stored = pool.save("a", keys, [_rank_part(c, pool.slicing) for c in chunks])
        assert stored == (len(chunks) if pool.slicing.writes else 0)  # a replica of a head writes nothing


@pytest.mark.parametrize("write_tp,read_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (8, 16), (16, 1)])
def test_kv_saved_at_one_tp_size_loads_exactly_at_another(write_tp, read_tp):
    store = _store()
    tokens = list(range(3 * SPEC.chunk_tokens))
    keys = _rank_pool(store).keys("a", tokens)
    assert all(_rank_pool(store, tp, tp - 1).keys("a", tokens) == keys for tp in (2, 4, 16))  # no TP in a key
    chunks = _chunks(len(keys), write_tp * 31 + read_tp)
    _save_all(store, write_tp, keys, chunks)
    for r in range(read_tp):
        pool = _rank_pool(store, read_tp, r)
        assert pool.lookup("a", keys) == len(keys) * SPEC.chunk_tokens
        want = [_rank_part(c, pool.slicing) for c in chunks]
        assert all(torch.equal(a, b) for a, b in zip(pool.load("a", keys), want, strict=True))
        for read in (pool.load_views, pool.load_views_in_place):
            got = []
            for view in read("a", keys):
                with view:
                    got.append(view.kv.clone())
            assert len(got) == len(keys) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_missing_slice_is_a_miss_of_its_chunk_for_every_rank():
    store = _store()
    keys = _rank_pool(store).keys("a", list(range(2 * SPEC.chunk_tokens)))
    chunks = _chunks(2, 1)
    _save_all(store, 2, keys, chunks, ranks=[0])
    _save_all(store, 2, keys[:1], chunks[:1], ranks=[1])  # rank 1 died before saving the second chunk
    for tp in (1, 2, 4):
        assert all(_rank_pool(store, tp, r).lookup("a", keys) == SPEC.chunk_tokens for r in range(tp))
    assert len(_rank_pool(store, 2, 1).load("a", keys)) == 1
    assert _rank_pool(store, 2, 0).lookup_mine("a", keys) == 2 * SPEC.chunk_tokens  # its own part of both is in
    assert _rank_pool(store, 2, 1).lookup_mine("a", keys) == SPEC.chunk_tokens
    assert len(_rank_pool(store).load("a", keys)) == 1  # TP=1 holds every head: the second chunk lacks four


def test_a_corrupt_slice_fails_its_chunk_and_a_resave_repairs_it():
    store = _store()
    keys = _rank_pool(store).keys("a", list(range(2 * SPEC.chunk_tokens)))
    chunks = _chunks(2, 2)
    _save_all(store, 1, keys, chunks)
    pool = _rank_pool(store, 2, 1)
    where = pool.addresses("a", keys)
    assert len(where) == 2 and all(len(w) == 4 for w in where)
    tier, page = store.locate(where[1][2])  # chunk 1, rank 1's third head
    store.slab(tier).page(page)[5] ^= 0x40
    assert len(pool.load("a", keys)) == 1 and len(_rank_pool(store, 2, 0).load("a", keys)) == 2
    assert _rank_pool(store).lookup("a", keys) == SPEC.chunk_tokens  # the bad slice was dropped on read
    assert pool.save("a", keys, [_rank_part(chunks[1], pool.slicing)], start=1) == 1
    assert all(len(_rank_pool(store, 4, r).load("a", keys)) == 2 for r in range(4))


def test_tenants_never_read_each_others_slices():
    store = _store()
    pool = _rank_pool(store, 2, 0)
    tokens = list(range(SPEC.chunk_tokens))
    ka, kb = pool.keys("a", tokens), pool.keys("b", tokens)
    _save_all(store, 2, ka, _chunks(1, 3))
    assert pool.lookup("a", ka) == SPEC.chunk_tokens
    assert pool.lookup("b", kb) == pool.lookup("b", ka) == 0 and pool.load("b", ka) == []


def test_a_pipeline_hit_needs_every_stages_slices():
    store = _store()
    stages = ((0, 1), (1, 4))
    s0, s1 = (_rank_pool(store, 2, 0, stages, p) for p in (0, 1))
    keys = s0.keys("a", list(range(SPEC.chunk_tokens)))
    chunk = _chunks(1, 4)[0]
    assert s0.save("a", keys, [_rank_part(chunk, s0.slicing)]) == 1
    assert s0.lookup("a", keys) == 0  # stage 1 and rank 1 of stage 0 are missing
    for tp_rank, pp in ((1, 0), (0, 1), (1, 1)):
        p = _rank_pool(store, 2, tp_rank, stages, pp)
        p.save("a", keys, [_rank_part(chunk, p.slicing)])
    assert s1.lookup("a", keys) == SPEC.chunk_tokens
    assert torch.equal(s1.load("a", keys)[0], chunk[1:4, ..., 0:4, :])
    whole = _rank_pool(store)  # TP=1, one stage: its slices are other keys (another layer range)
    assert whole.lookup("a", keys) == 0


def test_split_refuses_a_chunk_that_is_not_the_ranks():
    s = Slicing.of(SPEC, 2, 1)
    with pytest.raises(BadRequest, match="4 layers and 4 heads"):
        s.split(torch.zeros(4, 2, 8, 8, 8))
