"""kvpool: a distributed KV-cache pool for LLM inference.

The core (this package) imports neither Ray nor an inference engine: keys, specs, slabs, the
per-node chunk store, tenants and quotas, metrics and the CLI. ``kvpool.cluster`` adds Ray,
``kvpool.connectors`` the engines, ``kvpool.kernels`` the Triton kernels.
"""

import os as _os
import sys as _sys


def _off_the_checkout() -> None:
    """Takes a kvpool checkout off ``sys.path``.

    NOTE: the checkout's top-level folders install as subpackages of kvpool (``kvpool.kernels``, ...).
    With the checkout itself on sys.path (``python -m`` run from it, or a Ray worker of a driver
    started there: Ray adds the driver's cwd to its workers' path), its ``kernels/`` folder would be
    imported as Hugging Face's ``kernels`` package, which transformers (>= 5.25) requires and
    imports, and transformers would fail. Every kvpool process imports this package first."""
    checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if not (_os.path.isfile(_os.path.join(checkout, "pyproject.toml"))
            and _os.path.isdir(_os.path.join(checkout, "connectors"))):
        return  # an installed kvpool: its parent folder is site-packages
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != checkout]


_off_the_checkout()

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
