"""The real model in vLLM: its CPU build serves SmolLM2-135M-Instruct (its safetensors checkpoint)
with transformers' greedy tokens; and quantized KV across engines: vLLM serving it
with ``storage_format: int4-kivi`` saves its chunks quantized, and its greedy tokens on a pool hit
equal transformers' greedy tokens loading the same chunks (and transformers' own saves load in vLLM
the same way). The chunks are lossy: the log-probs differ from a recompute, yet both engines read
the same dequantized KV."""

from __future__ import annotations

import pytest
from conftest import IN_CI, need_engines

need_engines("transformers", "vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.codec import stored_nbytes  # noqa: E402
from kvpool.connectors.bench.ttft_real import prompts  # noqa: E402
from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine  # noqa: E402
from kvpool.connectors.breakeven import BreakEven  # noqa: E402
from kvpool.connectors.demo import smollm2  # noqa: E402
from kvpool.connectors.hf import HFConnector  # noqa: E402
from kvpool.connectors.pools import close_local_pools  # noqa: E402

if not smollm2.available():  # pragma: no cover - make engines installs it
    if IN_CI:
        pytest.fail("SmolLM2 is not installed: make engines", pytrace=False)
    pytest.skip("SmolLM2 is not installed (make engines)", allow_module_level=True)

CHUNK = 64  # two vLLM blocks of 32
FORMAT = "int4-kivi"
POOL = {"backend": "local", "pool": "smollm2-formats", "chunk_tokens": CHUNK, "dram_mib": 128, "storage_format": FORMAT}
NEW = 8
LOGPROB_TOL = 2e-3  # the two engines' kernels agree to ~1e-3 on the same KV


@pytest.fixture(scope="module")
def engines():
    folder = str(smollm2.checkpoint())
    model = smollm2.load()[0]
    hf = HFConnector(model, config=POOL, model_id=smollm2.MODEL_ID, breakeven=BreakEven(margin=0.0))
    llm = make_engine(folder, {**POOL, "model_id": smollm2.MODEL_ID, "breakeven_margin": 0.0},
                      enable_prefix_caching=False, max_model_len=1024)
    yield hf, llm, scheduler_connector(llm)
    shutdown_engine(llm)
    close_local_pools()


def vllm_run(llm, conn, tokens, n=NEW):
    sp = SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True)
    before = dict(conn.stats())
    o = llm.generate([{"prompt_token_ids": list(tokens)}], sp, use_tqdm=False)[0].outputs[0]
    gained = {k: v - before.get(k, 0) for k, v in conn.stats().items() if isinstance(v, int)}
    return list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)], gained


def hf_loaded(hf, tokens):
    new, first = hf.generate(tokens, max_new_tokens=NEW, save=False)
    lp = torch.log_softmax(first.logits[0, -1].float(), -1)[new[0]].item()
    return new, lp, first.loaded_tokens


def stored_sizes(hf, tokens):
    pool = hf.pool
    where = [a for chunk in pool.addresses("default", pool.keys("default", tokens)) for a in chunk]  # its slices
    return [None if got is None else got.shape[0] for got in pool.store.get_many(where, "default")]


QUESTIONS = ["What is the capital of France?", "Name the three primary colors.",
             "Write one sentence about the sea."]


def hf_greedy(model, tokens, n):
    """transformers' greedy tokens (argmax every step, never stopping at EOS, as vLLM's
    ignore_eos), with transformers' own cache: no kvpool involved."""
    out, past, step = [], None, torch.tensor([list(tokens)])
    with torch.no_grad():
        for _ in range(n):
            r = model(input_ids=step, past_key_values=past, use_cache=True)
            past, nxt = r.past_key_values, int(r.logits[0, -1].argmax())
            out.append(nxt)
            step = torch.tensor([[nxt]])
    return out


def test_vllm_answers_paris_and_matches_transformers(engines):
    """Chat prompts shorter than a chunk: nothing of the pool is involved, only the two engines."""
    _, llm, conn = engines
    tok = smollm2.tokenizer()
    asked = [smollm2.chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert all(len(ids) < CHUNK for ids in asked)
    got = [vllm_run(llm, conn, ids, n=12)[0] for ids in asked]
    assert "Paris" in tok.decode(got[0], skip_special_tokens=True), tok.decode(got[0])
    model = smollm2.load()[0]
    want = [hf_greedy(model, ids, 12) for ids in asked]
    assert got == want, [(tok.decode(g), tok.decode(w)) for g, w in zip(got, want)]
    assert len({tuple(g) for g in got}) == len(QUESTIONS)  # three questions, three answers


def test_vllm_and_transformers_read_the_same_quantized_chunks_of_the_real_model(engines):
    hf, llm, conn = engines
    assert conn.spec.fingerprint() == hf.spec.fingerprint() and conn.spec.storage_format == FORMAT
    one, two = prompts([4 * CHUNK + 20, 4 * CHUNK + 30])  # real English (pydoc), 4 whole chunks each
    cold = vllm_run(llm, conn, one)
    assert cold[2].get("saved_chunks") == 4
    assert stored_sizes(hf, one[: 4 * CHUNK]) == [stored_nbytes(hf.pool.part.spec)] * 4 * conn.spec.num_kv_heads  # quantized
    warm = vllm_run(llm, conn, one)
    assert warm[2].get("loaded_tokens") == 4 * CHUNK and warm[2].get("load_failures", 0) == 0
    tokens, lp, loaded = hf_loaded(hf, one)
    assert loaded == 4 * CHUNK
    tok = smollm2.tokenizer()
    assert warm[0] == tokens, (tok.decode(warm[0]), tok.decode(tokens))
    assert abs(warm[1][0] - lp) <= LOGPROB_TOL
    assert max(abs(x - y) for x, y in zip(warm[1], cold[1])) > 1e-4  # lossy: not the recomputed KV
    # and the other way round: what transformers saves in int4, vLLM loads with transformers' tokens
    assert hf.prefill(two).saved_chunks == 4
    tokens, lp, _ = hf_loaded(hf, two)
    warm = vllm_run(llm, conn, two)
    assert warm[2].get("loaded_tokens") == 4 * CHUNK and warm[2].get("saved_chunks", 0) == 0
    assert warm[0] == tokens and abs(warm[1][0] - lp) <= LOGPROB_TOL
