"""Recurrent state in the pool (kvpool.connectors.hf_state), through the transformers connector:
a pure state-space model (Mamba-2) and a hybrid of gated DeltaNet and attention layers
(Qwen3-Next), random weights, fp32.

A first turn saves its whole chunks, each holding the attention layers' KV and every recurrent
layer's state at the chunk's end; a second turn that extends it loads them and runs on from the
last loaded chunk's boundary: the logits of every token it computes equal one plain forward of the
whole second turn (within 1e-4 of the logits' scale), and its greedy tokens the model's own. A
negative control shows the comparison sees a wrong state; what cannot be continued exactly is
refused.
"""

from __future__ import annotations

import pytest
import torch
import zoo

from kvpool.connectors.families import UnsupportedModel
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.pools import close_local_pools
from kvpool.errors import BadRequest

CHUNK = 64  # a multiple of both models' own scan chunk
COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "mamba2": ("Mamba2Config", dict(state_size=16, num_heads=8, head_dim=32, expand=2, n_groups=1, conv_kernel=4,
                                    chunk_size=32)),
    "qwen3-next": ("Qwen3NextConfig", dict(intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
                                           linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64, full_attention_interval=2,
                                           max_position_embeddings=4096)),
}


def build(name: str, seed: int = 0, **fields):
    import transformers

    cls, own = CONFIGS[name]
    cfg = getattr(transformers, cls)(**{**COMMON, **own, **fields})
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    finally:
        torch.random.set_rng_state(state)


@torch.no_grad()
def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one plain forward (the model's own cache)."""
    from transformers import DynamicCache

    from kvpool.connectors.hf_model import cache_argument

    return model(input_ids=ids, use_cache=True, **{cache_argument(model): DynamicCache(config=model.config)}).logits[0]


def within(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> bool:
    return (a - b).abs().max().item() <= rel * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def stateful(request):
    close_local_pools()
    model = build(request.param)
    conn = HFConnector(model, config={"chunk_tokens": CHUNK, "dram_mib": 64, "pool": f"state-{request.param}"})
    yield request.param, model, conn
    close_local_pools()


def test_the_spec_stores_each_recurrent_layers_state_in_the_chunk(stateful):
    name, model, conn = stateful
    kinds = conn.spec.layer_kinds
    assert "state" in kinds and len(kinds) == conn.spec.num_layers >= model.config.num_hidden_layers
    if name == "qwen3-next":  # the attention layers keep their KV layers, the others their state
        assert sum(k == "full" for k in kinds) == 2
    lay = conn.states
    assert set(lay.shapes) == {i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"}


def test_a_second_turn_loads_kv_and_state_with_the_logits_of_recomputing(stateful):
    name, model, conn = stateful
    turn1 = zoo.prompt(200, seed=1, vocab=512)
    first = conn.prefill(turn1)
    assert first.loaded_tokens == 0 and first.saved_chunks == 3
    assert within(first.logits[0], full_logits(model, turn1)), name  # run chunk by chunk: the same logits
    answer, _ = conn.generate(turn1, max_new_tokens=8)
    turn2 = torch.cat([turn1, torch.tensor([answer]), zoo.prompt(62, seed=2, vocab=512)], dim=1)  # 270 tokens
    want = full_logits(model, turn2)
    second = conn.prefill(turn2)
    assert second.loaded_tokens == 3 * CHUNK and second.saved_chunks == 1, (second.loaded_tokens, second.saved_chunks)
    assert within(second.logits[0], want[3 * CHUNK:]), (name, (second.logits[0] - want[3 * CHUNK:]).abs().max())
    tokens, third = conn.generate(turn2, max_new_tokens=12)  # every whole chunk of the second turn now
    assert third.loaded_tokens == 4 * CHUNK
    assert tokens == zoo.reference(model, turn2, 12)[1]


def test_a_wrong_state_moves_the_logits(stateful):
    """The negative control: the first turn's chunks with their state storage layers scaled are
    loaded (a pool of their own) and the logits move far past the tolerance."""
    name, model, conn = stateful
    ids = zoo.prompt(3 * CHUNK + 10, seed=7, vocab=512)
    conn.prefill(ids)
    keys = conn.pool.keys("default", ids[0].tolist())
    chunks = conn.pool.load("default", keys)
    assert len(chunks) == 3
    bad = HFConnector(model, config={"chunk_tokens": CHUNK, "dram_mib": 64, "pool": f"state-bad-{name}"})
    state_layers = [i for i, k in enumerate(conn.spec.layer_kinds) if k == "state"]
    wrong = [c.clone() for c in chunks]
    wrong[-1][state_layers] *= 1.5
    assert bad.pool.save("default", keys, wrong) == 3
    r = bad.prefill(ids)
    assert r.loaded_tokens == 3 * CHUNK
    assert not within(r.logits[0], full_logits(model, ids)[3 * CHUNK:], rel=1e-2)


def test_what_cannot_be_continued_exactly_is_refused():
    with pytest.raises(UnsupportedModel, match="multiple of 32"):
        HFConnector(build("mamba2"), config={"chunk_tokens": 48, "dram_mib": 16, "pool": "state-refused"})
    with pytest.raises(BadRequest, match="storage_format 'raw'"):
        HFConnector(build("mamba2"), config={"chunk_tokens": CHUNK, "dram_mib": 16, "pool": "state-lossy",
                                             "storage_format": "int8"})
    import transformers  # Jamba's Mamba-1 layers: transformers' many-token scan starts from zero, not the state

    cfg = transformers.JambaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_experts=2, attn_layer_period=2,
                                   attn_layer_offset=1, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False)
    with pytest.raises(UnsupportedModel, match="without the pool"):
        HFConnector(transformers.AutoModelForCausalLM.from_config(cfg).eval(),
                    config={"chunk_tokens": CHUNK, "dram_mib": 16, "pool": "state-jamba"})
    close_local_pools()


@pytest.mark.parametrize("cls", ["Gemma3nTextConfig", "Gemma4TextConfig"])
def test_layers_that_reuse_another_layers_kv_are_refused_clearly(cls):
    """KV sharing (Gemma 3n and 4: the last layers read an earlier layer's KV and keep none of
    their own): refused, naming the layer and why, in every connector."""
    import transformers

    from kvpool.connectors.families import layer_kinds

    types = ["sliding_attention", "full_attention"] * 3
    cfg = getattr(transformers, cls)(num_hidden_layers=6, layer_types=types, num_kv_shared_layers=2)
    plain = getattr(transformers, cls)(num_hidden_layers=6, layer_types=types, num_kv_shared_layers=0)
    assert len(layer_kinds(plain)) == 6  # without sharing: every layer's own KV
    for engine in ("transformers connector", "KVPoolConnector"):
        with pytest.raises(UnsupportedModel, match=r"layer 4 .* reuses another layer's.*without the pool"):
            layer_kinds(cfg, engine=engine, states=engine.startswith("transformers"))


def test_kvpool_up_sizes_pages_for_them_only_from_page_size(tmp_path):
    from kvpool.cluster.sizing import model_chunk

    build("qwen3-next").save_pretrained(tmp_path)  # a checkpoint: its config names the architecture
    with pytest.raises(BadRequest, match="--page-size .*chunk_nbytes"):
        model_chunk(str(tmp_path), CHUNK, "float32")


def test_kv_and_state_through_a_nodes_shard_serve_another_instance():
    """The chunks with their states through the node path (a shard on local Ray, its slab and page
    table, the checksums): a second model instance loads the first one's KV and state and gives
    the logits of recomputing."""
    from kvpool.cluster.local import local_cluster_pool
    from kvpool.tenants import Tenant

    close_local_pools()
    first = build("qwen3-next")
    spec = HFConnector(first, config={"chunk_tokens": CHUNK, "dram_mib": 16, "pool": "state-spec"}).spec
    close_local_pools()
    ids = zoo.prompt(3 * CHUNK + 20, seed=11, vocab=512)
    with local_cluster_pool(spec, [Tenant("a")], dram_chunks=16) as pool:
        assert HFConnector(first, pool, tenant="a").prefill(ids).saved_chunks == 3
        other = build("qwen3-next")  # another instance of the same weights
        r = HFConnector(other, pool, tenant="a").prefill(ids)
        assert r.loaded_tokens == 3 * CHUNK
        assert within(r.logits[0], full_logits(other, ids)[3 * CHUNK:])
