"""Correct reuse on every model family the transformers connector serves (tests/zoo.py).

For each family and prompt length around its chunk size and window: a first request saves the
prompt's whole chunks, a second loads them; its next-token logits must equal one plain forward of
the whole prompt (fp32, within 1e-4 of the logits' scale) and its 20 greedy tokens those of the
model decoding on its own. A second turn that extends the prompt reuses the first turn's chunks
the same way. Negative controls show the comparison sees wrong KV, including the KV that
transformers' own sliding-window cache would have handed us; families the pool cannot serve
are refused at construction.
"""

from __future__ import annotations

import pytest
import torch
import zoo

from kvpool.connectors.families import UnsupportedModel
from kvpool.connectors.hf import HFConnector, _cache_argument
from kvpool.connectors.pools import close_local_pools

GREEDY = 20


def within(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> bool:
    return (a - b).abs().max().item() <= rel * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module", params=sorted(zoo.FAMILIES))
def family(request):
    close_local_pools()
    name = request.param
    model = zoo.build(name)
    conn = HFConnector(model, config={"chunk_tokens": zoo.chunk_tokens(name), "dram_mib": 256, "pool": f"zoo-{name}"},
                       tenant="default")
    yield name, model, conn
    close_local_pools()


def test_loaded_prefixes_give_the_logits_and_tokens_of_recomputing(family):
    name, model, conn = family
    c = conn.spec.chunk_tokens
    for i, n in enumerate(zoo.FAMILIES[name][2]):
        ids = zoo.prompt(n, seed=100 + i)
        want_logits, want_tokens = zoo.reference(model, ids, GREEDY)
        cold = conn.prefill(ids)
        assert cold.loaded_tokens == 0 and cold.saved_chunks == n // c, (name, n)
        tokens, warm = conn.generate(ids, max_new_tokens=GREEDY)
        assert warm.loaded_tokens == min(n // c * c, n - 1), (name, n)  # every whole chunk, cut before the last token
        assert within(warm.logits[0, -1], want_logits), (name, n, (warm.logits[0, -1] - want_logits).abs().max())
        assert tokens == want_tokens, (name, n)


def test_a_second_turn_reuses_the_first(family):
    name, model, conn = family
    c = conn.spec.chunk_tokens
    first = zoo.prompt(zoo.FAMILIES[name][2][0], seed=7)
    conn.prefill(first)
    second = torch.cat([first, zoo.prompt(c + 9, seed=8)], dim=1)  # the answer and a new question
    want_logits, want_tokens = zoo.reference(model, second, GREEDY)
    tokens, r = conn.generate(second, max_new_tokens=GREEDY)
    assert r.loaded_tokens == first.shape[1] // c * c
    assert within(r.logits[0, -1], want_logits) and tokens == want_tokens


def test_the_spec_says_what_each_layer_is(family):
    name, model, conn = family
    expected = {
        "mistral": {"sliding:40"}, "gemma2": {"sliding:40", "full"}, "gemma3": {"sliding:40", "full"},
        "llama4-chunked": {"chunked:40", "full"}, "phi3-2047": {"sliding:2047"},
        "mistral-long-window": {"sliding:4096"}, "deepseek-v3-mla": {"latent"},
    }.get(name, {"full"})
    assert set(conn.spec.layer_kinds or ("full",)) == expected
    if name == "deepseek-v3-mla":  # per token one latent (kv_lora_rank) and one rope key, side by side
        assert (conn.spec.num_kv_heads, conn.spec.head_dim, conn.spec.v_head_dim) == (1, 32, 16)
        assert conn.spec.chunk_shape == (3, zoo.CHUNK, 1, 48)
    else:
        assert conn.spec.v_head_dim == 0 and len(conn.spec.chunk_shape) == 5


def test_wrong_kv_moves_the_logits(family):
    """The negative control: another prompt's KV under this prompt's keys is visible."""
    name, model, conn = family
    c = conn.spec.chunk_tokens
    n = 2 * c + 1
    ids, other = zoo.prompt(n, seed=21), zoo.prompt(n, seed=22)
    conn.prefill(other)
    wrong = conn.pool.load("default", conn.pool.keys("default", other[0].tolist()))
    assert len(wrong) == 2
    conn.pool.save("default", conn.pool.keys("default", ids[0].tolist()), wrong)
    r = conn.prefill(ids)
    assert r.loaded_tokens == 2 * c
    assert not within(r.logits[0, -1], zoo.reference(model, ids, 1)[0], rel=1e-2)


@torch.no_grad()
def test_chunks_cut_from_transformers_own_sliding_cache_would_be_wrong():
    """What the connector did before: it cut chunks out of transformers' cache by position, but a
    sliding layer keeps only its last W - 1 tokens. Those chunks have the right shape and the
    wrong positions; loaded, they change the answer (so the zoo above can see that bug)."""
    from transformers import DynamicCache

    close_local_pools()
    model = zoo.build("mistral")
    conn = HFConnector(model, config={"chunk_tokens": zoo.CHUNK, "dram_mib": 16, "pool": "zoo-old"})
    ids = zoo.prompt(zoo.WINDOW + 10, seed=3)  # 50 tokens: the window keeps 11..49
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, **{_cache_argument(model): cache})
    assert cache.layers[0].keys.shape[2] == zoo.WINDOW - 1  # it dropped the oldest tokens
    old = torch.stack([torch.stack([layer.keys[0, :, :zoo.CHUNK], layer.values[0, :, :zoo.CHUNK]])
                       for layer in cache.layers]).permute(0, 1, 3, 2, 4).contiguous()
    conn.pool.save("default", conn.pool.keys("default", ids[0].tolist()), [old])
    r = conn.prefill(ids)
    assert r.loaded_tokens == zoo.CHUNK
    assert not within(r.logits[0, -1], zoo.reference(model, ids, 1)[0], rel=1e-2)
    close_local_pools()


@pytest.mark.parametrize("family, fields, match", [
    ("llama", dict(layer_types=["full_attention", "linear_attention", "full_attention"]), "linear_attention"),
    ("llama", dict(layer_types=["full_attention", "mamba", "full_attention"]), "mamba"),
    ("gemma3", dict(layer_types=["sliding_attention", "full_attention"]), "names 2 layers"),
])
def test_families_it_cannot_serve_are_refused_at_construction(family, fields, match):
    model = zoo.build(family)
    for k, v in fields.items():
        setattr(model.config, k, v)
    with pytest.raises(UnsupportedModel, match=match):
        HFConnector(model, config={"chunk_tokens": zoo.CHUNK, "dram_mib": 16, "pool": "zoo-refused"})


def test_a_real_linear_attention_model_is_refused():
    import transformers

    cfg = transformers.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(Exception, match="linear|cache|past_key_values") as e:
        HFConnector(model, config={"chunk_tokens": zoo.CHUNK, "dram_mib": 16, "pool": "zoo-mamba"})
    assert "without the pool" in str(e.value) or "not a transformers causal LM" in str(e.value)


def test_a_failing_load_is_a_miss_and_a_recompute():
    """Anything unexpected on the load path (here the pool raises mid-load) never fails the
    request: it recomputes and answers as if nothing was cached."""
    close_local_pools()
    model = zoo.build("gemma2")
    conn = HFConnector(model, config={"chunk_tokens": zoo.CHUNK, "dram_mib": 16, "pool": "zoo-fail"})
    ids = zoo.prompt(3 * zoo.CHUNK + 4, seed=5)
    conn.prefill(ids)

    def broken(*a, **k):
        raise RuntimeError("a shard answered garbage")

    conn.pool.load = broken
    r = conn.prefill(ids)
    assert r.loaded_tokens == 0 and conn.load_failed == 1
    assert within(r.logits[0, -1], zoo.reference(model, ids, 1)[0])
    close_local_pools()
