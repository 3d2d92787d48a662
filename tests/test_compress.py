"""Token eviction on save (kvpool.connectors.compress, compress_store): LOSSY and opt-in.

What must hold: the new tokens after a compressed prefix run at their ORIGINAL positions (so a
budget that keeps everything reproduces the uncompressed logits, and a real eviction equals the
uncompressed run with the evicted keys masked out); ragged methods attend to exactly their kept
entries; a compressed prefix is keyed apart from the raw one and loaded only whole; and on the
real model a compressed passage still answers a question about it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import IN_CI
from transformers import DynamicCache

from kvpool.connectors import compress as C
from kvpool.connectors.compress_store import check_compress, derived_keys
from kvpool.connectors.demo import smollm2
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import model_spec, tiny_llama
from kvpool.connectors.pools import close_local_pools
from kvpool.errors import BadRequest

L, NEW = 96, 8


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, layers=2)


@pytest.fixture(scope="module")
def prompt(model):
    torch.manual_seed(3)
    ids = torch.randint(0, 1000, (1, L))
    nxt = torch.randint(0, 1000, (1, NEW))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        full = model(input_ids=torch.cat([ids, nxt], 1)).logits[:, L:]
    return ids, nxt, cache, full


def close(a, b, tol=1e-5):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("method", C.METHODS)
def test_a_budget_that_keeps_everything_reproduces_the_uncompressed_logits(model, prompt, method):
    ids, nxt, cache, full = prompt
    ckv = C.compress_cache(model, cache, method=method, budget=L, input_ids=ids)
    assert ckv.kept_tokens == L and ckv.length == L and not ckv.ragged
    assert close(C.continue_logits(model, ckv, nxt), full)


def masked_reference(model, ids, nxt, kept):
    """The uncompressed run of ids+nxt in which the new tokens cannot see the evicted prompt tokens."""
    n = ids.shape[1] + nxt.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    seen = torch.zeros(ids.shape[1], dtype=torch.bool)
    seen[kept] = True
    allowed[ids.shape[1]:, : ids.shape[1]] &= seen
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        return model(input_ids=torch.cat([ids, nxt], 1), attention_mask=mask).logits[:, ids.shape[1]:]


def test_after_an_eviction_new_tokens_run_at_their_original_positions(model, prompt):
    ids, nxt, cache, full = prompt
    ckv = C.compress_cache(model, cache, method="streaming_llm", budget=40, n_sink=4)
    kept = ckv.positions[0][0, 0]
    assert kept.tolist() == [0, 1, 2, 3, *range(L - 36, L)] and ckv.entries == 40
    got = C.continue_logits(model, ckv, nxt)
    assert close(got, masked_reference(model, ids, nxt, kept), 1e-4)
    assert not close(got, full, 1e-2)  # the eviction is real
    # without explicit positions the model would put the new tokens at len(cache) = 40: wrong
    with torch.no_grad():
        naive = model(input_ids=nxt, cache=ckv.cache()).logits
    assert not close(naive, got, 1e-2)


def test_greedy_continues_a_compressed_prefix_like_its_logits(model, prompt):
    ids, nxt, cache, _ = prompt
    ckv = C.compress_cache(model, cache, method="snapkv", budget=48, window=16, input_ids=ids)
    tokens = C.greedy(model, ckv, nxt, 3)
    assert tokens[0] == int(C.continue_logits(model, ckv, nxt)[0, -1].argmax())
    assert tokens[1] == int(C.continue_logits(model, ckv, torch.cat([nxt, torch.tensor([tokens[:1]])], 1))[0, -1].argmax())


def test_ragged_methods_attend_to_exactly_their_kept_entries(model, prompt):
    ids, nxt, cache, _ = prompt
    ckv = C.compress_cache(model, cache, method="snapkv", budget=48, window=16, input_ids=ids)
    want = C.continue_logits(model, ckv, nxt)
    # the same entries with 5 garbage slots padding layer 0's heads: masked out, so no change
    k, v, p = ckv.keys[0], ckv.values[0], ckv.positions[0]
    junk = torch.randn(1, k.shape[1], 5, k.shape[-1]) * 10
    padded = C.CompressedKV("adakv", 48, L, [torch.cat([k, junk], 2), *ckv.keys[1:]],
                            [torch.cat([v, junk], 2), *ckv.values[1:]],
                            [torch.cat([p, torch.full((1, k.shape[1], 5), -1)], 2), *ckv.positions[1:]])
    assert padded.ragged and padded.nbytes == ckv.nbytes
    assert close(C.continue_logits(model, padded, nxt), want, 1e-4)
    with pytest.raises(BadRequest, match="DynamicCache"):
        padded.cache()
    for method in ("pyramidkv", "adakv"):
        r = C.compress_cache(model, cache, method=method, budget=32, window=16, input_ids=ids)
        assert r.ragged and r.kept_tokens == 32
        assert torch.isfinite(C.continue_logits(model, r, nxt)).all()


def test_queries_are_the_prompts_own_and_must_match_its_cache(model, prompt):
    ids, _, cache, _ = prompt
    every = C.prompt_queries(model, cache, ids, L)
    last = C.prompt_queries(model, cache, ids, 8)
    assert all(close(a[:, :, -8:], b, 1e-4) for a, b in zip(every, last))
    assert cache.get_seq_length() == L  # not changed
    with pytest.raises(BadRequest, match="not the prompt"):
        C.prompt_queries(model, cache, (ids + 1) % 1000, 8)


@pytest.mark.parametrize("kw, match", [
    ({"method": "nope", "budget": 8}, "unknown compression method"),
    ({"method": "snapkv", "budget": 0}, "budget"),
    ({"method": "snapkv", "budget": 32}, "pass input_ids"),
    ({"method": "h2o", "budget": 32, "window": 8}, "no observation window"),
    ({"method": "snapkv", "budget": 32, "bogus": 1}, "takes no parameter bogus"),
])
def test_bad_compression_requests_name_the_fix(model, prompt, kw, match):
    with pytest.raises(BadRequest, match=match):
        C.compress_cache(model, prompt[2], **kw)


# ------------------------------------------------------------------ the connector
CFG = {"pool": "compress-test", "chunk_tokens": 16, "dram_mib": 16, "tenants": ["a"], "tenant": "a"}


@pytest.fixture
def pools():
    close_local_pools()
    yield
    close_local_pools()


def test_the_connector_stores_a_long_prompt_compressed_and_continues_it(model, pools):
    conn = HFConnector(model, config={**CFG, "compress": {"method": "snapkv", "budget": 32, "window": 8}})
    torch.manual_seed(5)
    doc = torch.randint(0, 1000, (100,)).tolist()
    first = conn.prefill(doc)
    assert first.saved_chunks == 3  # a header chunk and 32 entries in 2 chunks, for 96 tokens
    keys = conn.pool.keys("a", doc)
    assert conn.pool.lookup("a", keys) == 0  # never answers a raw lookup
    ask = doc + torch.randint(0, 1000, (10,)).tolist()
    second = conn.prefill(ask)
    assert (second.loaded_tokens, second.positions_ahead, second.saved_chunks) == (96, 64, 0)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([doc[:96]]), cache=cache)
    direct = C.compress_cache(model, cache, method="snapkv", budget=32, window=8, input_ids=torch.tensor([doc[:96]]))
    assert close(second.logits, C.continue_logits(model, direct, torch.tensor([ask[96:]])), 1e-5)
    tokens, _ = conn.generate(ask, max_new_tokens=4)
    assert tokens == C.greedy(model, direct, torch.tensor([ask[96:]]), 4)
    # another budget is another key: never loaded as this one
    other = HFConnector(model, pool=conn.pool, config={**CFG, "compress": {"method": "snapkv", "budget": 48}})
    assert other.prefill(ask, save=False).loaded_tokens == 0
    raw = HFConnector(model, pool=conn.pool, config=CFG)
    assert raw.prefill(ask, save=False).loaded_tokens == 0


def test_a_prompt_within_the_budget_is_stored_raw_and_exact(model, pools):
    conn = HFConnector(model, config={**CFG, "compress": {"method": "streaming_llm", "budget": 64}})
    ids = torch.randint(0, 1000, (70,)).tolist()
    assert conn.prefill(ids).saved_chunks == 4
    again = conn.prefill(ids)
    assert again.loaded_tokens == 64 and again.positions_ahead == 0


@pytest.mark.parametrize("cfg, match", [
    ({"method": "pyramidkv", "budget": 64}, "different number of tokens per layer"),
    ({"method": "adakv", "budget": 64}, "per head"),
    ({"method": "snapkv"}, "like"),
    ({"method": "snapkv", "budget": 64, "alpha": 0.2}, "takes no alpha"),
    ({"method": "h2o", "budget": 64, "window": 8}, "no observation window"),
    ({"method": "snapkv", "budget": 8, "window": 16}, "exceeds budget"),
])
def test_bad_compress_configs_name_the_fix(model, cfg, match):
    with pytest.raises(BadRequest, match=match):
        check_compress(cfg, model_spec(model, model_id="t", weights="t"))


def test_a_lossy_storage_format_and_compression_do_not_mix(model):
    with pytest.raises(BadRequest, match="storage_format"):
        check_compress({"method": "snapkv", "budget": 64}, model_spec(model, model_id="t", weights="t",
                                                                      storage_format="fp8"))


def test_derived_keys_depend_on_the_prefix_and_the_tag_and_stay_shared():
    from kvpool.keys import ChunkKey, SharedKey

    a, b = ChunkKey(bytes(16)), ChunkKey(bytes(15) + b"\x01")
    assert derived_keys(a, b"x", 3)[:2] == derived_keys(a, b"x", 2)
    assert not set(derived_keys(a, b"x", 2)) & set(derived_keys(b, b"x", 2) + derived_keys(a, b"y", 2))
    assert isinstance(derived_keys(SharedKey(bytes(16)), b"x", 1)[0], SharedKey)


# ------------------------------------------------------------------ the real model
@pytest.fixture(scope="module")
def real():
    if not smollm2.available():
        if IN_CI:
            pytest.fail("SmolLM2 is not installed (make venv)")
        pytest.skip("SmolLM2 is not installed")
    return smollm2.load()


def test_on_the_real_model_a_compressed_passage_still_answers_a_question(real):
    model, tok = real
    days = " ".join(f"Day {i}: the weather in the valley was mild and the farmers worked their fields." for i in range(15))
    passage = days + " Near the end of the month, the mayor of the town was Alice Johnson. She had a red bicycle."
    ids = smollm2.chat_ids(tok, [{"role": "user", "content": passage + "\n\nWho was the mayor of the town? "
                                                             "Answer with her name."}])
    n = len(ids) - 3  # the prompt is compressed but for its last tokens, which continue it
    pre, rest = torch.tensor([ids[:n]]), torch.tensor([ids[n:]])
    cache = DynamicCache()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[:, n:]
        model(input_ids=pre, cache=cache)
    for method in ("streaming_llm", "snapkv"):
        whole = C.compress_cache(model, cache, method=method, budget=n, input_ids=pre)
        assert close(C.continue_logits(model, whole, rest), want, 1e-4)
        small = C.compress_cache(model, cache, method=method, budget=128, input_ids=pre)
        assert small.kept_tokens == 128 and small.nbytes * n == whole.nbytes * 128
        answer = tok.decode(C.greedy(model, small, rest, 10))
        assert "Alice Johnson" in answer, (method, answer)
