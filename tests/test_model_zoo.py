"""Correct reuse on every model family the transformers connector serves (tests/zoo.py).

For each family and prompt length around its chunk size and window: a first request saves the
prompt's whole chunks, a second loads them; its next-token logits must equal one plain forward of
the whole prompt (fp32, within 1e-4 of the logits' scale) and its 20 greedy tokens those of the
model decoding on its own. A second turn that extends the prompt reuses the first turn's chunks
the same way, and a batch of prompts (padded left or right, or ragged) is served row by row: each
row's logits are its own recompute's. A checkpoint saved over a loaded model's folder never lends
the loaded model its fingerprint. Negative controls show the comparison sees wrong KV, including the
KV that transformers' own sliding-window cache would have handed us; families the pool cannot serve
are refused at construction.
"""

from __future__ import annotations

import pytest
import torch
import zoo

from kvpool.connectors import compress
from kvpool.connectors.families import UnsupportedModel
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import cache_argument
from kvpool.connectors.pools import close_local_pools
from kvpool.errors import BadRequest

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


def padded(rows: list[torch.Tensor], side: str, pad: int = 0):
    """(input_ids, attention_mask) of ``[1, n_i]`` rows as one batch padded on ``side``; "ragged":
    (a list of token lists, None)."""
    if side == "ragged":
        return [r[0].tolist() for r in rows], None
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = r.shape[1]
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, cols], mask[i, cols] = r[0], 1
    return ids, mask


@torch.no_grad()
def every_logit(model, ids: torch.Tensor) -> torch.Tensor:
    """``[n, vocab]``: the logits of every position of one plain forward of the prompt ``[1, n]``."""
    from transformers import DynamicCache

    return model(input_ids=ids, use_cache=True, **{cache_argument(model): DynamicCache(config=model.config)}).logits[0]


@pytest.mark.parametrize("side", ["left", "right", "ragged"])
@pytest.mark.parametrize("size", [2, 4])
def test_a_batch_is_served_row_by_row(family, size, side):
    """Prompts sharing a prefix, submitted as one batch: each row is keyed, loaded and saved on its
    own (never as the rows' concatenation), and its logits are its own recompute's, on the first
    request (row 0 saves the shared chunks, the others load them) and on the second (all load)."""
    name, model, conn = family
    c = conn.spec.chunk_tokens
    seed = 1000 + 10 * size + ["left", "right", "ragged"].index(side)
    shared = zoo.prompt(2 * c + 3, seed=seed)
    rows = [torch.cat([shared, zoo.prompt(c // 2 + 7 * i + 1, seed=seed + 1 + i)], dim=1) for i in range(size)]
    want = [every_logit(model, r) for r in rows]
    ids, mask = padded(rows, side)
    for turn in ("first", "second"):
        results = conn.prefill(ids, attention_mask=mask)
        assert isinstance(results, list) and len(results) == size, (name, turn)
        for i, (r, row, logits) in enumerate(zip(results, rows, want)):
            n = row.shape[1]
            assert r.prompt_tokens == n, (name, turn, i)
            hit = (0 if i == 0 else 2 * c) if turn == "first" else min(n // c * c, n - 1)
            assert r.loaded_tokens == hit, (name, turn, i, r.loaded_tokens)
            assert r.logits.shape[1] == n - hit
            assert within(r.logits[0], logits[hit:]), (name, turn, i, (r.logits[0] - logits[hit:]).abs().max())
    tokens, results = conn.generate(ids, max_new_tokens=6, attention_mask=mask)
    assert tokens == [zoo.reference(model, row, 6)[1] for row in rows], name


def test_shapes_a_batch_cannot_be_served_in_are_refused():
    close_local_pools()
    model = zoo.build("llama")
    conn = HFConnector(model, config={"chunk_tokens": zoo.CHUNK, "dram_mib": 16, "pool": "zoo-shapes"})
    ids = zoo.prompt(2 * zoo.CHUNK, seed=4).repeat(2, 1)
    holes = torch.ones_like(ids)
    holes[1, 5] = 0
    for bad, match in [
        (dict(input_ids=ids, attention_mask=holes), "padding between real tokens"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 3)), "shape"),
        (dict(input_ids=ids, attention_mask=torch.zeros_like(ids)), "no real token"),
        (dict(input_ids=ids[None]), "shape"),
        (dict(input_ids=[[1, 2, 3], [4, 5]], attention_mask=[[1, 1, 1], [1, 1, 0]]), "ragged"),
        (dict(input_ids=ids.float()), "integer"),
        (dict(input_ids=[[]]), "empty"),
    ]:
        with pytest.raises(BadRequest, match=match):
            conn.prefill(**bad)
    before = conn.pool.lookup("default", conn.pool.keys("default", ids[0].tolist()))
    assert before == 0  # nothing refused was saved
    with pytest.raises(BadRequest, match="call it once per row"):  # one prompt only: refused, not merged
        compress.prompt_queries(model, conn.prefill(ids[:1]).cache, ids, 4)
    close_local_pools()


def test_a_checkpoint_saved_over_a_loaded_model_does_not_lend_it_its_fingerprint(family, tmp_path):
    """Model A is loaded from a folder, then checkpoint B is saved over it (a fine-tune over its
    base) before A's connector is built: A must be keyed by its own tensors, not B's files, so B
    loads none of A's KV and answers as its own recompute; each model still hits its own chunks."""
    from transformers import AutoModelForCausalLM

    name, _, fixture_conn = family
    c = fixture_conn.spec.chunk_tokens
    folder = str(tmp_path / "ckpt")
    pool = {"chunk_tokens": c, "dram_mib": 64, "pool": f"zoo-ckpt-{name}"}
    zoo.build(name, seed=0).save_pretrained(folder)
    a = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    zoo.build(name, seed=1).save_pretrained(folder)
    b = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    conn_a, conn_b = HFConnector(a, config=pool, model_id="org/same"), HFConnector(b, config=pool, model_id="org/same")
    assert conn_a.spec.weights.startswith("tensors:"), (name, conn_a.spec.weights)
    assert conn_a.spec.fingerprint() != conn_b.spec.fingerprint()
    if name != "deepseek-v3-mla":  # its experts are fused on load: no folder vouches for it (weights_sample)
        assert conn_b.spec.weights.startswith("files:"), (name, conn_b.spec.weights)
    ids = zoo.prompt(3 * c + 2, seed=40)
    assert conn_a.prefill(ids).saved_chunks == 3
    r = conn_b.prefill(ids)
    assert r.loaded_tokens == 0, name
    assert within(r.logits[0, -1], zoo.reference(b, ids, 1)[0])
    assert conn_a.prefill(ids).loaded_tokens == 3 * c  # A's own chunks are still A's


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
    model(input_ids=ids, use_cache=True, **{cache_argument(model): cache})
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
