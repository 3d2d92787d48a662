"""Attention mass from the transformers connector to the ``importance`` policy (issue 18, part 5).

The connector computes each saved chunk's attention mass (kvpool.connectors.compress.chunk_attention)
when its pool evicts by ``importance``; ``LocalPool.save(attention=...)`` hands it to the policy,
which then keeps a well-attended chunk over a newer, unattended one.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from kvpool.connectors.compress import chunk_attention
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import tiny_llama
from kvpool.connectors.pools import close_local_pools
from kvpool.pool import LocalPool
from kvpool.spec import KVSpec
from kvpool.tenants import Tenant, TenantRegistry

SPEC = KVSpec("test/importance", 1, 1, 4, dtype="float32", block_size=4, chunk_tokens=4)
ZERO = torch.zeros(1, 2, 4, 1, 4)


def pool_of(pages: int, policy: str = "importance") -> LocalPool:
    return LocalPool.create(SPEC, TenantRegistry([Tenant("a")]), pages, policy=policy)


def save(pool, tokens, attention=None) -> list:
    keys = pool.keys("a", tokens)
    assert pool.save("a", keys, [ZERO] * len(keys), attention=attention) == len(keys)
    return keys


@pytest.mark.parametrize("att_old, att_new, survivor", [
    ([1.0, 1.0], [0.0, 0.0], "old"),  # attention outweighs recency
    (None, None, "new"),  # without it the older prompt's leaf goes first
])
def test_the_policy_keeps_the_chunk_the_model_attended_to(att_old, att_new, survivor):
    pool = pool_of(4)
    old = save(pool, list(range(8)), att_old)
    new = save(pool, list(range(100, 108)), att_new)
    save(pool, list(range(200, 204)))  # one more chunk: one leaf must go
    kept = {"old": pool.lookup("a", old), "new": pool.lookup("a", new)}
    assert kept[survivor] == 8 and kept[({"old", "new"} - {survivor}).pop()] == 4


def test_attention_outside_zero_to_one_is_clamped():
    pool = pool_of(4)
    save(pool, list(range(8)), [7.0, -3.0])
    policy = pool.store._cache.policies[0]
    assert sorted(policy.attention[s] for s in policy.members) == [0.0, 1.0]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, layers=2)


def test_chunk_attention_is_relative_to_the_most_attended_chunk(model):
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 70))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    att = chunk_attention(model, cache, ids, 16, window=16)
    assert len(att) == 4 and max(att) == 1.0 and all(0 <= a <= 1 for a in att)
    assert len(set(att)) == 4  # the chunks differ
    assert chunk_attention(model, cache, ids, 128) == []  # no whole chunk


def test_the_connector_reports_attention_only_to_an_importance_pool(model):
    close_local_pools()
    cfg = {"chunk_tokens": 16, "dram_mib": 16, "tenants": ["a"], "tenant": "a"}
    try:
        seen = {}
        ids = torch.randint(0, 1000, (1, 50), generator=torch.Generator().manual_seed(1))
        for policy in ("importance", "adaptive"):
            conn = HFConnector(model, config={**cfg, "pool": f"imp-{policy}", "policy": policy})
            real_save = conn.pool.save

            def spy(*a, _p=policy, _s=real_save, **kw):
                seen[_p] = kw.get("attention")
                return _s(*a, **kw)

            conn.pool.save = spy
            conn.prefill(ids)
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
        assert seen["adaptive"] is None
        assert seen["importance"] == pytest.approx(chunk_attention(model, cache, ids, 16), abs=1e-5)
        assert len(seen["importance"]) == 3
    finally:
        close_local_pools()


def test_bench_importance_prints_only_json(capfd):
    from kvpool.cli import main

    rc = main(["bench", "importance", "--model", "tiny", "--docs", "4", "--hot", "1", "--doc-tokens", "64",
               "--capacity", "6", "--requests", "30", "--seeds", "2", "--json"])
    out = json.loads(capfd.readouterr().out)
    assert rc == 0 and [(r["policy"], r["attention"]) for r in out["rows"]] == [
        ("lru", False), ("adaptive", False), ("importance", False), ("importance", True)]
    for r in out["rows"]:
        assert 0 <= r["hit_rate"][0] <= r["hit_rate"][1] <= 1 and len(r["runs"]) == 2
        for run in r["runs"]:  # every prompt token is either loaded or recomputed
            total = run["recomputed_tokens"] / (1 - run["hit_rate"])
            assert total == pytest.approx(30 * (64 + 12))
