"""kvpool: a distributed KV-cache pool for LLM inference.

The core (this package) imports neither Ray nor an inference engine: keys, specs, slabs, the
per-node chunk store, tenants and quotas, metrics and the CLI. ``kvpool.cluster`` adds Ray,
``kvpool.connectors`` the engines, ``kvpool.kernels`` the Triton kernels.
"""

from kvpool.errors import (
    BadRequest,
    ChunkTooLarge,
    KvPoolError,
    LayoutMismatch,
    PoolFull,
    QuotaExceeded,
    Unavailable,
    UnknownTenant,
)
from kvpool.keys import ChunkKey, Namespace, chunk_keys
from kvpool.metrics import Metrics
from kvpool.spec import KVSpec
from kvpool.store import ChunkStore, ChunkView, Lease, StoreConfig
from kvpool.tenants import SHARED_SALT, Tenant, TenantRegistry

__version__ = "0.1.0"

__all__ = [
    "BadRequest", "ChunkKey", "ChunkStore", "ChunkTooLarge", "ChunkView", "KVSpec", "KvPoolError",
    "LayoutMismatch", "Lease", "Metrics", "Namespace", "PoolFull", "QuotaExceeded", "SHARED_SALT",
    "StoreConfig", "Tenant", "TenantRegistry", "Unavailable", "UnknownTenant", "chunk_keys",
]
