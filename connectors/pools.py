"""The pool a connector talks to, opened from the connector's config, and the KV spec of a model.

Every connector (transformers, vLLM, SGLang) describes its model the same way (``spec_for``) and
opens its pool the same way (``open_pool``), so the same tokens of the same model hit the same
chunks whichever engine wrote them.

Config (a dict; vLLM passes it as ``kv_connector_extra_config``, SGLang as the backend's extra
config):

- ``backend``: ``"local"`` (default: an in-process pool, shared by every connector of this
  process that names the same ``pool``) or ``"ray"`` (the cluster: ``ray_address``,
  ``namespace``, ``index_url`` for a Redis index, ``timeout_s``);
- ``pool``: the local pool's name (default ``"default"``); ``dram_mib`` its size (default 1024);
- ``tenants``: tenant ids the pool serves (default ``["default"]``); ``tenant``: the one this
  connector writes as when a request names none;
- ``chunk_tokens`` (default 256).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from kvpool.errors import BadRequest
from kvpool.pool import LocalPool
from kvpool.spec import KVSpec
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry

KNOWN_KEYS = {"backend", "pool", "dram_mib", "tenants", "tenant", "chunk_tokens", "ray_address", "namespace",
              "index_url", "timeout_s", "policy", "load_min_tokens"}
DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
               "float": "float32", "half": "float16", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

_local_stores: dict[str, ChunkStore] = {}
_lock = threading.Lock()


def spec_for(model_id: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: object, *,
             chunk_tokens: int = 256, block_size: int | None = None, revision: str = "main",
             storage_format: str = "raw", weights: str = "", layer_kinds: tuple[str, ...] = (),
             v_head_dim: int = 0, engine: str = "") -> KVSpec:
    """The KV spec of a decoder model. ``dtype`` may be a torch dtype or its name; ``weights`` is
    the weights' fingerprint (:mod:`kvpool.connectors.weights`), ``layer_kinds`` one kind per layer
    (:func:`kvpool.connectors.families.layer_kinds`)."""
    name = str(dtype)
    name = DTYPE_NAMES.get(name, name.removeprefix("torch."))
    return KVSpec(model_id, num_layers, num_kv_heads, head_dim, dtype=name,
                  block_size=block_size or chunk_tokens, chunk_tokens=chunk_tokens,
                  storage_format=storage_format, model_revision=revision, weights=weights,
                  layer_kinds=tuple(layer_kinds), v_head_dim=v_head_dim, engine=engine)


def check_config(config: dict[str, Any]) -> dict[str, Any]:
    unknown = set(config) - KNOWN_KEYS
    if unknown:
        raise BadRequest(f"unknown kvpool connector settings {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}")
    backend = config.get("backend", "local")
    if backend not in ("local", "ray"):
        raise BadRequest(f"kvpool backend {backend!r} is not 'local' or 'ray'")
    return {"backend": backend, "pool": config.get("pool", "default"), "dram_mib": int(config.get("dram_mib", 1024)),
            "tenants": list(config.get("tenants", ["default"])), "chunk_tokens": int(config.get("chunk_tokens", 256)),
            **{k: config[k] for k in ("tenant", "ray_address", "namespace", "index_url", "timeout_s", "policy",
                                      "load_min_tokens") if k in config}}


def open_pool(spec: KVSpec, config: dict[str, Any] | None = None):
    """A ``LocalPool`` or a ``ClusterPool`` for ``spec``: same surface (keys, lookup, begin, load,
    save, end)."""
    cfg = check_config(config or {})
    tenants = [Tenant(t) if isinstance(t, str) else Tenant(**t) for t in cfg["tenants"]]
    if cfg["backend"] == "local":
        with _lock:
            store = _local_stores.get(cfg["pool"])
            if store is None:
                pages = max(1, (cfg["dram_mib"] << 20) // spec.chunk_nbytes)
                store = ChunkStore(StoreConfig(spec.chunk_nbytes, pages, policy=cfg.get("policy", "adaptive")),
                                   TenantRegistry(tenants))
                _local_stores[cfg["pool"]] = store
            else:
                for t in tenants:
                    store.tenants.add(t)
        return LocalPool(spec, store)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from kvpool.cluster.client import PoolClient
    from kvpool.cluster.pool import ClusterPool

    if not ray.is_initialized():
        ray.init(address=cfg.get("ray_address", "auto"), namespace=cfg.get("namespace"), logging_level="ERROR",
                 log_to_driver=False)
    client = PoolClient(index_url=cfg.get("index_url"), timeout_s=float(cfg.get("timeout_s", 5.0)),
                        namespace=cfg.get("namespace"))
    return ClusterPool(spec, client, tenants)


def close_local_pools() -> None:
    """Forgets the in-process pools (tests; a fresh engine process starts with none anyway)."""
    with _lock:
        for store in _local_stores.values():
            store.close()
        _local_stores.clear()
