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
from kvpool.slices import Slicing, tp_heads
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


def _pools():
    """A full-model pool (its keys) and, over the same store, one of the slices (``lookup``: tokens
    of leading slices, each counted as a chunk of the pool's chunk_tokens)."""
    reg = TenantRegistry([Tenant("a")])
    store = ChunkStore(StoreConfig(page_bytes=SPEC.chunk_nbytes, dram_pages=64), reg)
    one = Slicing.of(SPEC).slice_spec(SPEC)
    return LocalPool(SPEC, store), LocalPool(one, store)


def _rank_part(chunk: torch.Tensor, s: Slicing) -> torch.Tensor:
    a, b = s.layers
    return chunk[a:b, ..., s.heads.start: s.heads.stop, :]


@pytest.mark.parametrize("write_tp,read_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (8, 16), (16, 1)])
def test_kv_saved_at_one_tp_size_loads_exactly_at_another(write_tp, read_tp):
    full, sliced = _pools()
    tokens = list(range(3 * SPEC.chunk_tokens))
    keys = full.keys("a", tokens)
    g = torch.Generator().manual_seed(write_tp * 31 + read_tp)
    chunks = [torch.randn(SPEC.chunk_shape, generator=g) for _ in keys]
    for r in range(write_tp):  # each writing rank saves its heads' slices of every chunk
        s = Slicing.of(SPEC, write_tp, r)
        if s.writes:
            parts = [p for c in chunks for p in s.split(_rank_part(c, s))]
            assert sliced.save("a", s.keys(keys), parts) == len(parts)
    reader0 = Slicing.of(SPEC, read_tp, 0)
    assert sliced.lookup("a", reader0.all_keys(keys)) // SPEC.chunk_tokens // reader0.per_chunk == len(keys)
    for r in range(read_tp):
        s = Slicing.of(SPEC, read_tp, r)
        got = sliced.load("a", s.keys(keys))
        n = len(s.heads)
        assert len(got) == n * len(keys)
        for i, c in enumerate(chunks):
            assert torch.equal(s.merge(got[i * n: (i + 1) * n]), _rank_part(c, s))


def test_a_missing_slice_is_a_miss_of_its_chunk_for_every_rank():
    full, sliced = _pools()
    keys = full.keys("a", list(range(2 * SPEC.chunk_tokens)))
    chunk = torch.randn(SPEC.chunk_shape)
    for r in (0, 1):  # TP=2, but rank 1 saved only the first chunk (it died before the second)
        s = Slicing.of(SPEC, 2, r)
        mine = keys if r == 0 else keys[:1]
        parts = [p for _ in mine for p in s.split(_rank_part(chunk, s))]
        sliced.save("a", s.keys(mine), parts)
    for tp in (1, 2, 4):
        s = Slicing.of(SPEC, tp, 0)
        assert sliced.lookup("a", s.all_keys(keys)) // SPEC.chunk_tokens // s.per_chunk == 1  # the second chunk is nobody's hit


def test_split_refuses_a_chunk_that_is_not_the_ranks():
    s = Slicing.of(SPEC, 2, 1)
    with pytest.raises(BadRequest, match="4 layers and 4 heads"):
        s.split(torch.zeros(4, 2, 8, 8, 8))
