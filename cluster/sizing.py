"""A pool's page size from a model: the bytes one stored chunk of it takes, as its connectors
compute them (`kvpool up --model`).

The model's layers come from its Hugging Face config the way every connector reads them
(:func:`kvpool.connectors.families.layer_kinds`: a family the connectors refuse is refused here
with the same message), and each layer's K/V shape the way the transformers connector finds it in
its cache: ``num_key_value_heads`` (else ``num_attention_heads``) heads of ``head_dim`` (else
``hidden_size // num_attention_heads``); a latent-attention (MLA) model caches one latent of
``kv_lora_rank`` and one rope key of ``qk_rope_head_dim`` per token and layer. A chunk holds every
layer (sliding and chunked ones too), so the window does not change its size.

No Ray and no engine here: transformers reads the config (no weights are loaded).
"""

from __future__ import annotations

import json
import os

from kvpool.errors import BadRequest

DEFAULT_CHUNK_TOKENS = 256  # the connectors' default (kvpool.connectors.pools.check_config)


def read_config(model: str):
    """(transformers config, its JSON dict) of a local model folder holding config.json, or of a
    config.json path."""
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise BadRequest(f"--model {model!r}: no such folder or config.json; give a local Hugging Face model folder "
                         "(with config.json) or the path of its config.json (download the model first)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise BadRequest(f"--model {model!r}: cannot read {path} as JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise BadRequest(f"--model {model!r}: {path} has no model_type: not a Hugging Face model config; "
                         "pass --page-size instead")
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(**raw)
    except (ValueError, KeyError, TypeError) as e:
        raise BadRequest(f"--model {model!r}: transformers cannot build a {raw['model_type']!r} config ({e}); "
                         "pass --page-size (bytes of one stored chunk) instead") from None
    return config, raw


def config_dtype(config, raw: dict) -> str:
    """The dtype a config says its weights (hence its KV) are in; float16 when it says none."""
    from kvpool.connectors.families import text_config

    for src in (text_config(config), config):
        d = getattr(src, "dtype", None) or getattr(src, "torch_dtype", None)
        if d:
            return str(d)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return str(raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
               or "float16")


def _declared(cfg, name: str):
    """``cfg.name`` when the config's class declares that field, else None: a config.json may carry
    keys its family ignores (a GPT-NeoX config with num_key_value_heads still runs every head)."""
    import inspect

    cls = type(cfg)
    known = {n for k in cls.__mro__ for n in getattr(k, "__annotations__", {})}
    try:
        known |= set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    return getattr(cfg, name, None) if name in known else None


def kv_layout(config) -> tuple[tuple[str, ...], int, int, int]:
    """(layer kinds, KV heads, K width, V width (0: K's)) of a decoder's config."""
    from kvpool.connectors.families import STATEFUL, architecture, is_latent, layer_kinds, text_config

    kinds = layer_kinds(config, engine="kvpool up", states=True)  # NOTE: the connectors' refusals, word for word
    if "state" in kinds:
        if architecture(config) not in STATEFUL:
            layer_kinds(config, engine="kvpool up")  # refused as every connector refuses it
        raise BadRequest(f"kvpool up --model: {type(config).__name__} has recurrent layers, whose state the "
                         "transformers connector stores in its chunks (sized from the model's own cache, not its "
                         "config): pass --page-size with the bytes of one slice, "
                         "HFConnector(model, ...).spec.chunk_nbytes // spec.num_kv_heads, instead of --model")
    cfg = text_config(config)
    if is_latent(config):
        kinds = tuple("latent" if k == "full" else k for k in kinds)
        return kinds, 1, int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
    q_heads = getattr(cfg, "num_attention_heads", None)
    heads = _declared(cfg, "num_key_value_heads") or q_heads
    head_dim = _declared(cfg, "head_dim")
    if not head_dim and isinstance(q_heads, int) and q_heads > 0 and isinstance(getattr(cfg, "hidden_size", None), int):
        head_dim = cfg.hidden_size // q_heads
    if not (isinstance(heads, int) and heads > 0 and isinstance(head_dim, int) and head_dim > 0):
        raise BadRequest(f"kvpool up: {type(cfg).__name__} names no KV heads and head width (num_key_value_heads, "
                         "head_dim): pass --page-size (bytes of one stored chunk) instead of --model")
    return kinds, heads, head_dim, 0


def model_chunk(model: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, dtype: str | None = None,
                storage_format: str = "raw") -> dict:
    """What a page must hold for ``model``: ``{"spec", "chunk_bytes" (a chunk stored), "raw_bytes",
    "dtype", "page_bytes" (a slice stored: what a page holds), "slices" (per chunk)}``."""
    from kvpool.codec import page_bytes
    from kvpool.connectors.pools import spec_for
    from kvpool.slices import Slicing

    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise BadRequest(f"--chunk-tokens is a positive number of tokens (the connectors' chunk_tokens, default "
                         f"{DEFAULT_CHUNK_TOKENS}), got {chunk_tokens!r}")
    config, raw = read_config(model)
    kinds, heads, k_dim, v_dim = kv_layout(config)
    name = dtype or config_dtype(config, raw)
    try:
        spec = spec_for(os.path.basename(os.path.normpath(model)) or "model", len(kinds), heads, k_dim, name,
                        chunk_tokens=chunk_tokens, storage_format=storage_format, layer_kinds=kinds,
                        v_head_dim=v_dim)
    except BadRequest as e:
        raise BadRequest(f"kvpool up --model {model}: {e.message} (set --dtype, --storage-format or --chunk-tokens)"
                         ) from None
    part = Slicing.of(spec).slice_spec(spec)  # what a page holds: one KV head's slice of a chunk (kvpool.slices)
    return {"spec": spec, "chunk_bytes": page_bytes(spec), "raw_bytes": spec.chunk_nbytes, "dtype": spec.dtype,
            "page_bytes": page_bytes(part), "slices": spec.num_kv_heads}
