"""Tenants never see each other's cache. With salts in every key, tenant B's request on tenant
A's prompt is always a miss: not a hit that is then refused (which a timing side channel could
tell apart from a miss), but keys that do not exist, the same path as a prompt nobody sent."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.pool import LocalPool
from kvpool.spec import KVSpec
from kvpool.tenants import Tenant, TenantRegistry

SPEC = KVSpec("iso/model", 1, 1, 8, dtype="float32", block_size=4, chunk_tokens=4)


def make_pool():
    tenants = [Tenant("a"), Tenant("b"), Tenant("c", salt=b"a-secret-salt")]
    return LocalPool.create(SPEC, TenantRegistry(tenants), dram_chunks=64)


def chunks_for(tokens, seed=0):
    n = len(tokens) // SPEC.chunk_tokens
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.chunk_shape, generator=g) for _ in range(n)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=4, max_size=40), st.sampled_from(["b", "c"]))
def test_another_tenant_always_misses_and_its_keys_never_meet(tokens, other):
    pool = make_pool()
    ka = pool.keys("a", tokens)
    pool.save("a", ka, chunks_for(tokens))
    kb = pool.keys(other, tokens)
    assert not set(map(bytes, ka)) & set(map(bytes, kb))  # not one key in common
    assert pool.lookup(other, kb) == 0 and pool.load(other, kb) == []
    # B asking with A's own keys (stolen, guessed) is a miss too: the store checks the owner.
    assert pool.lookup(other, ka) == 0 and pool.load(other, ka) == []
    # The same answer, through the same path, as a prompt nobody ever sent.
    stranger = pool.keys(other, [t ^ 1 for t in tokens])
    assert pool.lookup(other, stranger) == 0 and pool.load(other, stranger) == []
    pool.store.close()


def test_a_miss_on_another_tenants_prompt_costs_what_a_miss_on_nothing_costs():
    """Timing: B's requests for A's cached prompt run the miss path, never the hit path (counted
    by the store: no chunk is read, no lease taken, for either)."""
    pool = make_pool()
    rng = np.random.default_rng(0)
    theirs = rng.integers(0, 32000, 64)
    pool.save("a", pool.keys("a", theirs), chunks_for(theirs))
    m = pool.store.metrics
    before = (m.get_bytes.total(), m.hits_chunks.total())
    for prompt in (theirs, rng.integers(0, 32000, 64)):
        keys = pool.keys("b", prompt)
        assert pool.lookup("b", keys) == 0 and pool.load("b", keys) == []
    assert (m.get_bytes.total(), m.hits_chunks.total()) == before
    assert m.misses_tokens.get("b") == 2 * 64
    pool.store.close()


def test_shared_only_when_published_as_shared():
    pool = make_pool()
    system = list(range(100, 116))
    pool.save("a", pool.keys("a", system), chunks_for(system))
    assert pool.lookup("b", pool.keys("b", system, shared=True)) == 0  # private to a
    pool.save("a", pool.keys("a", system, shared=True), chunks_for(system), shared=True)
    assert pool.lookup("b", pool.keys("b", system, shared=True)) == 16  # published: everyone hits
    assert pool.lookup("b", pool.keys("b", system)) == 0  # b's own namespace still misses
    pool.store.close()
