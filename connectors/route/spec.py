"""The KV spec vLLM's connector keys a model's chunks with, built without vLLM, so that a router
keys a prompt exactly as the engines behind it do and the pool's index tells it where each chunk is.

It is :func:`kvpool.connectors.vllm_spec.model_spec`'s spec for the same checkpoint folder and
settings: the whole model's layers (and what each one's KV is) and KV heads from its config, the K
width, the KV cache's dtype (``vllm serve --dtype``: give the same; the config's by default), the
checkpoint's files' fingerprint, the model id the engines use (their ``model_id``, else the path
exactly as ``vllm serve`` was given it), revision, chunk tokens and storage format from the
connector's config. tests/engines/test_route.py checks it against the one vLLM's connector builds.

A router whose spec differs from its engines' finds none of their chunks: it routes on the GPU
caches and the load alone (never a wrong answer: each engine keys its own loads), and its
``kvpool_route_predicted_cached_tokens`` stays below the engines' own count.
"""

from __future__ import annotations

from typing import Any

from kvpool.errors import BadRequest
from kvpool.spec import KVSpec


def engine_spec(model: str, pool_config: dict[str, Any], own: dict[str, Any], dtype: str | None = None) -> KVSpec:
    """The spec of ``model`` (a local checkpoint folder) as vLLM's connector with this extra config
    (``pool_config`` and ``own``: :func:`kvpool.connectors.vllm_config.split_config`) builds it."""
    from kvpool.cluster.sizing import config_dtype, kv_layout, read_config
    from kvpool.connectors.families import engine_scope
    from kvpool.connectors.pools import spec_for
    from kvpool.connectors.weights import weights_of_folder

    config, raw = read_config(model)
    kinds, heads, k_dim, v_dim = kv_layout(config)
    if v_dim or "latent" in kinds:
        raise BadRequest(f"kvpool route: {model} uses latent attention, which vLLM's connector does not store: "
                         "route its instances without --model (on load alone)")
    return spec_for(str(own.get("model_id") or model), len(kinds), heads, k_dim, dtype or config_dtype(config, raw),
                    chunk_tokens=int(pool_config.get("chunk_tokens", 256)),
                    revision=str(own.get("model_revision") or "main"),
                    weights=weights_of_folder(model, None, own.get("model_weights"), engine="kvpool route"),
                    layer_kinds=kinds, engine=engine_scope(config, "vllm"),
                    storage_format=pool_config.get("storage_format", "raw"))
