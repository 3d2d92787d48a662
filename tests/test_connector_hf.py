"""The transformers connector with a real random-weight Llama: logits after loading a cached
prefix equal the logits of recomputing it, on the in-process pool and on a Ray pool whose shard
dies and comes back."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import wait_for

from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import cache_argument, tiny_llama
from kvpool.connectors.pools import close_local_pools

CHUNK = 32


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.fixture
def conn(model):
    close_local_pools()
    c = HFConnector(model, config={"chunk_tokens": CHUNK, "tenants": ["a", "b"], "dram_mib": 16, "pool": "hf-test"},
                    model_id="test/tiny-llama", tenant="a")
    yield c
    close_local_pools()


def close(a, b):
    """Equal within 1e-5 of the logits' scale (their largest magnitude)."""
    return (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def suffix_on_computed_kv(model, ids, hit):
    """Logits of ``ids[hit:]`` on the prefix KV the model computes itself (no pool)."""
    from transformers import DynamicCache

    arg = cache_argument(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{arg: cache})
        cache.crop(hit - ids.shape[1])  # a negative count removes that many trailing tokens
        return model(input_ids=ids[:, hit:], use_cache=True, **{arg: cache}).logits


def prompt(n, seed=0):
    return torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunks, extra", [(1, 5), (2, 1), (7, 19)])
def test_logits_after_loading_a_prefix_equal_recomputed_logits(model, conn, chunks, extra):
    ids = prompt(chunks * CHUNK + extra, seed=chunks)
    full = model(input_ids=ids).logits
    cold = conn.prefill(ids)
    assert cold.loaded_tokens == 0 and cold.saved_chunks == chunks
    warm = conn.prefill(ids)
    assert warm.loaded_tokens == chunks * CHUNK and warm.saved_chunks == 0
    assert warm.logits.shape[1] == extra  # only the suffix ran
    # Bit for bit: the suffix run on the pool's KV and on the KV the model itself computed.
    assert torch.equal(warm.logits, suffix_on_computed_kv(model, ids, chunks * CHUNK))
    # Against one forward of the whole prompt: within 1e-5 of the logits' scale, not bitwise, as running 5
    # tokens instead of 37 changes the matmul shapes and so the order of fp32 sums; a wrong byte
    # moves logits by > 1e-2 (the negative control below).
    assert close(warm.logits[0], full[0, -extra:])
    assert torch.equal(cold.logits[0, -1], full[0, -1])


def test_a_full_hit_still_computes_the_last_token(model, conn):
    ids = prompt(3 * CHUNK, seed=11)
    conn.prefill(ids)
    warm = conn.prefill(ids)
    # All three chunks load, cut before the last token: only that token is computed (for logits).
    assert warm.loaded_tokens == 3 * CHUNK - 1 and warm.logits.shape[1] == 1 and warm.saved_chunks == 0
    assert torch.equal(warm.logits, suffix_on_computed_kv(model, ids, 3 * CHUNK - 1))
    assert close(warm.logits[0, -1], model(input_ids=ids).logits[0, -1])


def test_a_longer_prompt_reuses_the_shared_prefix_and_saves_only_new_chunks(model, conn):
    base = prompt(4 * CHUNK, seed=3)
    conn.prefill(base)
    longer = torch.cat([base, prompt(2 * CHUNK + 3, seed=4)], dim=1)
    r = conn.prefill(longer)
    assert r.loaded_tokens == 4 * CHUNK and r.saved_chunks == 2
    assert close(r.logits[0, -1], model(input_ids=longer).logits[0, -1])
    tokens, _ = conn.generate(longer, max_new_tokens=4)
    ref = longer
    for _ in range(4):
        ref = torch.cat([ref, model(input_ids=ref).logits[:, -1:].argmax(-1)], dim=1)
    assert tokens == ref[0, longer.shape[1]:].tolist()


def test_tenants_never_load_each_others_prefix(model, conn):
    ids = prompt(3 * CHUNK + 1, seed=5)
    conn.prefill(ids, tenant="a")
    assert conn.prefill(ids, tenant="b").loaded_tokens == 0
    assert conn.prefill(ids, tenant="a").loaded_tokens == 3 * CHUNK


def test_wrong_kv_in_the_pool_would_change_the_logits(model, conn):
    """The negative control: the equality above is sensitive to the loaded bytes."""
    ids = prompt(2 * CHUNK + 1, seed=6)
    other = prompt(2 * CHUNK + 1, seed=7)
    keys = conn.pool.keys("a", ids[0].tolist())
    wrong = conn._chunks_from_cache(conn.prefill(other, save=False).cache, 0, 2)
    conn.pool.save("a", keys, wrong)  # another prompt's KV under this prompt's keys
    r = conn.prefill(ids)
    assert r.loaded_tokens == 2 * CHUNK
    assert (r.logits[0, -1] - model(input_ids=ids).logits[0, -1]).abs().max() > 1e-2


def test_a_forward_that_ignores_the_cache_fails_loudly(model, conn):
    ids = prompt(2 * CHUNK + 1, seed=8)
    conn.prefill(ids)
    conn._arg = "past_kv_renamed_away"  # what a transformers rename does to a stale connector
    with pytest.raises(RuntimeError, match="ignored"):
        conn.prefill(ids)


def test_on_a_cluster_pool_a_dead_shard_means_recompute_with_the_same_logits(model, tmp_path, monkeypatch):
    import ray

    from kvpool.cluster.bootstrap import up
    from kvpool.cluster.local import local_cluster_pool
    from kvpool.cluster.shard import shard_name
    from kvpool.connectors.hf_model import model_spec
    from kvpool.tenants import Tenant

    spec = model_spec(model, model_id="test/tiny-llama", chunk_tokens=CHUNK)
    ids = prompt(4 * CHUNK + 2, seed=9)
    full = model(input_ids=ids).logits[0, -1]
    monkeypatch.setenv("KVPOOL_RUN_DIR", str(tmp_path))  # before ray.init: the shard inherits it
    with local_cluster_pool(spec, [Tenant("a")], dram_chunks=64) as pool:
        conn = HFConnector(model, pool, tenant="a")
        assert conn.prefill(ids).saved_chunks == 4
        warm = conn.prefill(ids)
        assert warm.loaded_tokens == 4 * CHUNK and close(warm.logits[0, -1], full)
        (sid,) = pool.client.shards
        ray.kill(ray.get_actor(shard_name("default", sid), namespace="kvpool-demo"))
        t0 = time.monotonic()
        dead = conn.prefill(ids)  # the mapped memory, each chunk verified, until the engine notices
        assert close(dead.logits[0, -1], full)
        # the engine lets go of the dead shard's memory...
        wait_for(lambda: not pool.client.shards, 30, interval_s=0.2, what="the client to drop the dead shard")
        gone = conn.prefill(ids)
        assert gone.loaded_tokens == 0 and close(gone.logits[0, -1], full)
        assert time.monotonic() - t0 < 30  # no hang: misses, recomputed
        from kvpool.cluster.controller import CONTROLLER

        controller = ray.get_actor(CONTROLLER, namespace="kvpool-demo")
        wait_for(lambda: sid not in ray.get(controller.state.remote(), timeout=10)["shards"], 30, interval_s=0.2,
                 what="the controller to drop the dead shard")
        up(store={"page_bytes": spec.chunk_nbytes, "dram_pages": 64}, tenants=[{"id": "a"}], namespace="kvpool-demo")
        # ...and a new one joins (the restart)
        wait_for(lambda: pool.client.shards, 30, interval_s=0.2, what="a new shard to join")
        assert conn.prefill(ids).saved_chunks == 4  # empty again: recompute, save
        again = conn.prefill(ids)
        assert again.loaded_tokens == 4 * CHUNK and close(again.logits[0, -1], full)


def test_a_refused_save_is_a_future_miss_not_a_failed_request(model):
    from kvpool.connectors.hf_model import model_spec
    from kvpool.pool import LocalPool
    from kvpool.tenants import Tenant, TenantRegistry

    spec = model_spec(model, model_id="test/tiny-llama", chunk_tokens=CHUNK)
    pool = LocalPool.create(spec, TenantRegistry([Tenant("small", quota_bytes=spec.chunk_nbytes)]), dram_chunks=8)
    conn = HFConnector(model, pool, tenant="small")
    ids = prompt(3 * CHUNK + 1, seed=12)
    r = conn.prefill(ids)  # three chunks against a one-chunk quota: 429 inside, logits outside
    assert r.saved_chunks == 0 and conn.save_refused == 1
    assert close(r.logits[0, -1], model(input_ids=ids).logits[0, -1])
    assert conn.prefill(ids).loaded_tokens == 0  # nothing was stored: a miss, recomputed
    pool.store.close()
