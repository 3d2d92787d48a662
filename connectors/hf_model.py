"""What a transformers model is to the pool: the kinds of its layers, the K and V shapes its cache
really holds, its weights' fingerprint, and the name of the forward argument that carries its
cache. :class:`kvpool.connectors.hf.HFConnector` serves requests with them.

NOTE: transformers renamed the forward argument that carries the cache (``past_key_values`` in
5.0-5.23, ``cache`` from 5.24), and an argument a model does not know is swallowed by its
``**kwargs``: the prefix would be silently recomputed and the suffix attend to nothing. So the
name is read from the model's signature (:func:`cache_argument`), and the connector checks after
every forward that the cache it passed has grown by exactly the tokens it ran.
"""

from __future__ import annotations

import inspect
import logging

import torch

from kvpool.connectors.families import UnsupportedModel, engine_scope, is_latent, layer_kinds, text_config
from kvpool.connectors.pools import spec_for
from kvpool.connectors.weights import (
    check_given,
    config_fields,
    local_checkpoint,
    tensors_fingerprint,
    verified_files_fingerprint,
)
from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.connectors.hf")


def model_spec(model, *, model_id: str | None = None, chunk_tokens: int = 256, revision: str = "main",
               weights: str | None = None, storage_format: str = "raw"):
    """The KV spec of a transformers decoder: its layers' kinds (from the config), the K and V
    shapes its cache really holds (one probe token), and its weights' fingerprint
    (``weights``: None or ``"auto"``, ``"files"``, ``"tensors"``, or your own name for them; see
    :mod:`kvpool.connectors.weights`) and how its chunks are stored (``storage_format``: ``"raw"``,
    or a LOSSY, opt-in format of :mod:`kvpool.codec`). Raises :class:`UnsupportedModel` for a family the
    connector cannot serve correctly."""
    kinds, heads, k_dim, v_dim, dtype = model_layout(model, chunk_tokens)
    if "state" in kinds and storage_format != "raw":
        raise BadRequest(f"transformers connector: {type(model).__name__} keeps recurrent state, which a lossy "
                         f"storage_format ({storage_format!r}) would change: use storage_format 'raw'")
    name = model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return spec_for(name, len(kinds), heads, k_dim, dtype, chunk_tokens=chunk_tokens, revision=revision,
                    weights=model_weights(model, weights, revision), layer_kinds=kinds, v_head_dim=v_dim,
                    engine=engine_scope(model.config, "transformers", type(model).__name__),
                    storage_format=storage_format)


def model_layout(model, chunk_tokens: int = 256) -> tuple[tuple[str, ...], int, int, int, object]:
    """(layer kinds, KV heads, K width, V width, dtype) of a transformers decoder; a model with
    recurrent layers: its chunks' storage layers (kvpool.connectors.hf_state)."""
    kinds = layer_kinds(model.config, engine="transformers connector", states=True)
    _check_cache_layers(model, kinds)
    if "state" in kinds:
        lay = model_states(model, kinds, chunk_tokens)
        return lay.kinds, lay.heads, lay.dim, lay.dim, lay.dtype
    heads, k_dim, v_dim, dtype = _probe_kv(model, len(kinds))
    if is_latent(model.config):
        cfg = text_config(model.config)
        if (heads, k_dim, v_dim) == (1, cfg.kv_lora_rank, cfg.qk_rope_head_dim):
            # NOTE: transformers >= 5.2x caches MLA compressed: per token one normalised latent
            # (the "keys") and one rotated rope key (the "values"), expanded per head at attention.
            kinds = tuple("latent" if k == "full" else k for k in kinds)
    return kinds, heads, k_dim, v_dim, dtype


def model_states(model, kinds: tuple[str, ...] | None = None, chunk_tokens: int = 256):
    """The StateLayout of a model with recurrent layers (kvpool.connectors.hf_state), else None."""
    from kvpool.connectors.hf_state import state_layout

    kinds = kinds if kinds is not None else layer_kinds(model.config, engine="transformers connector", states=True)
    if "state" not in kinds:
        return None
    arg = cache_argument(model)
    return state_layout(model, kinds, chunk_tokens, lambda ids, cache: model(input_ids=ids, use_cache=True,
                                                                            **{arg: cache}))


def same_layout(spec, model) -> bool:
    kinds, heads, k_dim, v_dim, dtype = model_layout(model, spec.chunk_tokens)
    other = spec_for(spec.model_id, len(kinds), heads, k_dim, dtype, chunk_tokens=spec.chunk_tokens,
                     revision=spec.model_revision, weights=spec.weights, layer_kinds=kinds, v_head_dim=v_dim,
                     storage_format=spec.storage_format,
                     engine=engine_scope(model.config, "transformers", type(model).__name__))
    return other.fingerprint() == spec.fingerprint()


def model_weights(model, weights: str | None = None, revision: str | None = None) -> str:
    """The weights fingerprint of a loaded model. ``auto``: its checkpoint folder's files when it
    was loaded from one with the folder's own config and a sample of the files equals its
    parameters (so vLLM serving that folder shares its chunks), else its tensors."""
    if weights not in (None, "auto", "files", "tensors"):
        return check_given(weights)
    if weights != "tensors":
        source = getattr(model.config, "_name_or_path", "") or ""
        folder = local_checkpoint(source, None if revision in (None, "main") else revision)
        why = (f"{type(model).__name__} was not loaded from a checkpoint folder ({source!r})" if folder is None else
               None if _config_is_the_folders(model.config, folder) else
               f"its config differs from the one in {folder}")
        if why is None:
            fingerprint, mismatch = verified_files_fingerprint(folder, model)
            if fingerprint is not None:
                return fingerprint
            why = f"{folder} does not hold the weights it has: {mismatch}"
            log.warning("transformers connector: %s; keying %s by its tensors (it shares no chunks with engines "
                        "that serve the folder)", why, type(model).__name__)
        if weights == "files":
            raise BadRequest(f"weights='files' but {why}: use weights='tensors' or name the weights yourself")
    return tensors_fingerprint(model)


def _config_is_the_folders(config, folder: str) -> bool:
    """Whether the model runs with its folder's config (no override of a field that changes KV)."""
    try:
        disk = type(config).from_pretrained(folder).to_dict()
    except Exception:  # noqa: BLE001 - a folder whose config does not load: not this model's
        return False
    skip = ("dtype", "torch_dtype", "use_cache")
    here = {k: v for k, v in config_fields(config.to_dict()).items() if k not in skip}
    return here == {k: v for k, v in config_fields(disk).items() if k not in skip}


def _check_cache_layers(model, kinds: tuple[str, ...]) -> None:
    """transformers' own cache for the model must agree with the kinds read from its config (a
    layer class or window we did not expect means the model does something we cannot vouch for)."""
    from transformers import DynamicCache

    layers = DynamicCache(config=model.config).layers
    if len(layers) != len(kinds):
        raise UnsupportedModel(f"transformers connector: {type(model).__name__}'s cache has {len(layers)} layers but "
                               f"its config {len(kinds)}: kvpool cannot tell what each layer's KV is")
    for i, (layer, kind) in enumerate(zip(layers, kinds)):
        cls = type(layer).__name__
        window = int(kind.partition(":")[2] or 0)
        ok = (cls == "DynamicLayer" and not window and kind != "state") or (kind == "state" and cls == "LinearAttentionLayer") or (
            cls == "DynamicSlidingWindowLayer" and window and getattr(layer, "sliding_window", None) == window)
        if not ok:
            raise UnsupportedModel(f"transformers connector: layer {i} of {type(model).__name__} caches through "
                                   f"{cls} but its config says {kind!r}; kvpool cannot vouch for reusing its KV. "
                                   "Serve this model without the pool")


def _probe_kv(model, num_layers: int) -> tuple[int, int, int, object]:
    """(KV heads, K width, V width, dtype) that the model's cache holds, from one probe token."""
    from transformers import DynamicCache

    cache = DynamicCache()
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True,
              **{cache_argument(model): cache})
    shapes = set()
    for layer in range(num_layers):
        if layer >= len(cache.layers) or getattr(cache.layers[layer], "keys", None) is None:
            raise UnsupportedModel(f"transformers connector: {type(model).__name__} left layer {layer} of its cache "
                                   "empty: kvpool cannot rebuild a cache it does not fill")
        k, v = layer_kv(cache, layer)
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.dtype != v.dtype:
            raise UnsupportedModel(f"transformers connector: layer {layer} caches K {tuple(k.shape)} and V "
                                   f"{tuple(v.shape)}; kvpool stores [batch, heads, tokens, dim] K and V")
        shapes.add((k.shape[1], k.shape[3], v.shape[3], k.dtype))
    if len(shapes) != 1:
        raise UnsupportedModel(f"transformers connector: {type(model).__name__}'s layers cache KV of different shapes "
                               f"{sorted(map(str, shapes))}; kvpool chunks hold one shape for every layer")
    return shapes.pop()


def cache_argument(model) -> str:
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise BadRequest(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`: "
                     "not a transformers causal LM this connector knows")




def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # pragma: no cover - older releases


def tiny_llama(seed: int = 0, *, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
               vocab: int = 1024, max_positions: int = 32768, init_range: float = 0.2):
    """A random-weight Llama (no download), deterministic by seed, in fp32 and eval mode.

    NOTE: a larger init than the default 0.02 makes logits depend on the KV (perturbing K moved 0.02's by ~1e-3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      initializer_range=init_range, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    return model

