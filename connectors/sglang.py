"""The SGLang HiCache storage backend: SGLang's third cache tier (L3) on the kvpool.

SGLang's hierarchical cache keeps KV in GPU memory (L1), in a host memory pool (L2) and in a
storage backend (L3). This module is such a backend, loaded by SGLang's own factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.connectors.sglang", "class_name": "KVPoolStorage",
        "tenant": "default", "dram_mib": 4096}'

SGLang's own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``tp_lcm_size``, the ``prefetch_*`` knobs, ...) are stripped; the rest is the pool config of
:mod:`kvpool.connectors.pools` (``backend`` local/node, ``pool``, ``dram_mib``, ``tenants``,
``tenant``, ...), checked by its ``check_config`` (an unknown key is a BadRequest naming the known
ones). ``"storage_format"`` (``"fp8"``, ``"int8"``, ``"int4-kivi"``, ``"int2-kivi"``) stores pages
quantized: LOSSY and opt-in, a page read back is close to, not equal to, the page written. The
backend declares SGLang's zero-copy interface (``interface_v1``) in that config unless
the operator set it, so SGLang moves pages with :meth:`KVPoolStorage.batch_get_v1` /
:meth:`KVPoolStorage.batch_set_v1`, which copy straight between the host pool's pages and pool
chunks: a page on an aligned run of host slots (what SGLang's host allocator hands out) is one
strided copy through a view of the host buffer; any other slots go through
``kvpool.kernels.paged`` with the host pool's ``sglang_layout``.

Lifecycle: SGLang constructs the backend with ``(storage_config, kwargs)``, then calls
``register_mem_pool_host(host_pool)``; only then are the KV geometry (layers, KV heads, head dim,
dtype, page size) known, so that is where the pool is opened. Host pool layouts ``layer_first``,
``page_first`` (SGLang's default) and ``page_first_direct`` are supported; ``page_head``,
``page_unified``, MLA pools and hybrid (v2, multi-pool) models are refused with a clear error.

Tenants: a call is served as the tenant of the request secret in ``extra_info["kvpool_secret"]``,
as the config's ``tenant`` without one, and not cached at all with a secret that is nobody's
(:mod:`kvpool.connectors.tenancy`; :mod:`kvpool.connectors.sglang_keys` says what SGLang passes).

Pages and keys. One kvpool chunk holds one SGLang page (:mod:`kvpool.connectors.sglang_pages`);
each SGLang page key becomes a ChunkKey in a namespace of the tenant, the model's weights and
shape, this rank's shard and the call's salt (:mod:`kvpool.connectors.sglang_keys`).

Misses and failures: a missing page is ``None`` / ``False`` / a shorter leading run, never an
exception; any failure of the pool on the read path (a timeout, a dead shard, a bad checksum) is
logged and read as a miss, and SGLang recomputes. Bad input (a key that is not a string, a page of
the wrong size or dtype, host indices that do not cover the pages, a missing host pool) is a
``kvpool.errors.BadRequest`` naming the fix. A full pool or an exhausted quota on a write returns
False for the pages not stored (SGLang logs it and moves on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvpool.connectors.breakeven import BreakEven
from kvpool.connectors.pool_start import verify_tenants
from kvpool.connectors.pools import NO_COMPRESS, check_config, open_pool, spec_for
from kvpool.connectors.sglang_keys import PageKeys, call_context, model_identity, total_kv_heads
from kvpool.connectors.sglang_pages import HostPages
from kvpool.connectors.tenancy import Route, Tenancy
from kvpool.errors import BadRequest, KvPoolError, UnknownTenant
from kvpool.keys import ChunkKey
from kvpool.slices import Slicing

logger = logging.getLogger(__name__)

# Keys of the extra config that SGLang reads itself (or its factory needs); not pool config.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "model_weights",  # ours, read here: a name for the weights when model_name is no checkpoint folder
})
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

__all__ = ["KVPoolStorage", "SGLANG_KEYS", "SUPPORTED_LAYOUTS", "model_identity"]


class KVPoolStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a kvpool pool (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise BadRequest(f"KVPoolStorage takes SGLang's HiCacheStorageConfig, got {type(storage_config).__name__}")
        if storage_config.is_mla_model:
            raise BadRequest("kvpool's SGLang backend stores MHA K/V pages; MLA models are not supported yet: "
                             "use another --hicache-storage-backend for this model")
        extra = storage_config.extra_config
        if extra is not None and not isinstance(extra, dict):
            raise BadRequest(f"the backend's extra config must be a JSON object, got {type(extra).__name__}")
        if "compress" in (extra or {}):
            raise BadRequest(NO_COMPRESS.format(engine="SGLang"))
        self.written = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}  # the pool config as given
        self.config = check_config(self.written, also=SGLANG_KEYS)  # a typo of any key: "did you mean"
        tenants = [t if isinstance(t, str) else t.get("id") for t in self.config["tenants"]]
        self.tenant = self.config.get("tenant", tenants[0] if tenants else "default")
        if self.tenant not in tenants:
            raise BadRequest(f"tenant {self.tenant!r} is not among the pool's tenants {tenants}: add it to "
                             "\"tenants\" in --hicache-storage-backend-extra-config")
        self.tenancy = Tenancy(self.config, fallback=self.tenant, engine="kvpool's SGLang backend")
        if extra is not None:
            # NOTE: SGLang picks the zero-copy path by reading this key of the very dict it handed us,
            # after constructing the backend; an operator's explicit 0 keeps the generic path.
            extra.setdefault("interface_v1", 1)
        c = storage_config
        self._keys = PageKeys((f"pp={c.pp_rank}/{c.pp_size}", f"cp={c.attn_cp_rank}/{c.attn_cp_size}"))
        self.storage_config = storage_config
        self.model_name = c.model_name or ""
        self.weights, self.layer_kinds, self.engine = model_identity(self.model_name, (extra or {}).get("model_weights"))
        self.mem_pool_host = None
        self.pool = None
        self.spec = None
        self.page_size = 0
        self._pages: Optional[HostPages] = None
        self._lock = threading.Lock()
        self.breakeven = BreakEven()
        self._counts = {"get_pages": 0, "get_hits": 0, "set_pages": 0, "set_stored": 0, "read_errors": 0,
                        "write_errors": 0}
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Learns the KV geometry from SGLang's host pool and opens the pool for it."""
        host = mem_pool_host
        layout = getattr(host, "layout", None)
        if getattr(host, "kv_buffer", None) is None or layout is None:
            raise BadRequest(f"{type(host).__name__} is not an SGLang MHA host pool (no kv_buffer/layout); "
                             "kvpool's backend needs MHATokenToKVPoolHost")
        if layout not in SUPPORTED_LAYOUTS:
            raise BadRequest(f"host pool layout {layout!r} is not supported by kvpool's backend: start SGLang with "
                             f"--hicache-mem-layout one of {SUPPORTED_LAYOUTS}")
        head_dim, v_head_dim = host.head_dim, getattr(host, "v_head_dim", host.head_dim)
        if head_dim != v_head_dim:
            raise BadRequest(f"K head dim {head_dim} != V head dim {v_head_dim}: kvpool chunks hold K and V of one "
                             "head dim")
        page_size = int(host.page_size)
        if "chunk_tokens" in (self.storage_config.extra_config or {}) and self.config["chunk_tokens"] != page_size:
            raise BadRequest(f"chunk_tokens={self.config['chunk_tokens']} but SGLang's page is {page_size} tokens: "
                             "this backend stores one page per chunk; drop chunk_tokens from the extra config")
        c, heads = self.storage_config, int(host.head_num)  # this rank's KV heads
        total = total_kv_heads(self.model_name) or heads * c.tp_size
        if heads != max(1, total // c.tp_size):
            raise BadRequest(f"SGLang's host pool holds {heads} KV heads at tp_size={c.tp_size}, but the model has "
                             f"{total}: not the split the pool stores")
        # NOTE: the spec is the whole model's heads (its keys are the same at every TP size); each
        # rank stores and reads its heads' slices (kvpool.slices).
        self.spec = spec_for(self.model_name or "sglang-model", int(host.layer_num), total,
                             int(head_dim), host.dtype, chunk_tokens=page_size, weights=self.weights,
                             layer_kinds=self.layer_kinds, engine=self.engine,
                             storage_format=self.config["storage_format"])
        self.slicing = Slicing.of(self.spec, c.tp_size, c.tp_rank)
        self.pool = open_pool(self.spec, {**self.config, "chunk_tokens": page_size}, self.slicing)
        verify_tenants(self.pool, self.tenancy.pool_routes(), self.written, "kvpool's SGLang backend", "sglang")
        self.page_size = page_size
        self.rank_bytes = self.slicing.rank_spec(self.spec).chunk_nbytes  # a page of this rank
        self._pages = HostPages(host, layout, self.spec.num_layers, heads, head_dim, page_size)
        self.mem_pool_host = host
        logger.info("kvpool HiCache backend: %s, %s pages of %d tokens, tenant %r, backend %s", self.model_name,
                    layout, page_size, self.tenant, self.config["backend"])

    def _need_pool(self) -> None:
        if self.pool is None:
            raise BadRequest("the kvpool backend has no host pool yet: SGLang calls register_mem_pool_host(host_pool) "
                             "after constructing it; do the same before reading or writing")

    # ------------------------------------------------------------------ keys

    def chunk_keys(self, keys: Sequence[str], tenant: Optional[str] = None,
                   salt: tuple[str, ...] = ()) -> list[ChunkKey]:
        """The pool's ChunkKeys of SGLang page keys (in the namespace of ``tenant``, what the pool is
        passed: the default tenant's when None; with ``salt``)."""
        self._need_pool()
        return self._keys.chunk_keys(self.pool, keys, tenant or self.tenancy.default.pool_as, salt)

    def _context(self, extra_info) -> tuple[Optional[Route], tuple[str, ...], Optional[str]]:
        """(where the call goes, None: not cached; salt parts; parent page key)."""
        secret, named, salt, parent = call_context(extra_info)
        return self.tenancy.route(secret, named), salt, parent

    # ------------------------------------------------------------------ pool access

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _load(self, tenant: str, ckeys: list[ChunkKey]) -> list[torch.Tensor]:
        """The leading run of chunks; any failure of the pool is a miss."""
        t0 = time.perf_counter()
        try:
            chunks = self.pool.load(tenant, ckeys) if ckeys else []
        except (BadRequest, UnknownTenant):
            raise
        except Exception as e:  # NOTE: the read path never fails a request: SGLang recomputes
            logger.warning("kvpool load of %d pages failed, read as a miss: %s", len(ckeys), e)
            self._count("read_errors")
            chunks = []
        dt = time.perf_counter() - t0
        nbytes = len(chunks) * self.rank_bytes
        self.breakeven.observe_load(nbytes, dt)
        with self._lock:  # SGLang's prefetch and backup threads call concurrently
            self._counts["get_pages"] += len(ckeys)
            self._counts["get_hits"] += len(chunks)
            if chunks:
                self._metrics["prefetch_pgs"].append(len(chunks))
                self._metrics["prefetch_bandwidth"].append(nbytes / dt / 1e9 if dt > 0 else 0.0)
        return chunks

    def _save(self, tenant: str, ckeys: list[ChunkKey], chunks: list[torch.Tensor],
              parent: Optional[ChunkKey]) -> int:
        """Stores the chunks (after ``parent`` when given, for prefix-aware eviction); returns how many
        of ``ckeys`` are resident afterwards (a leading run)."""
        t0 = time.perf_counter()
        keys, start = ([parent, *ckeys], 1) if parent is not None else (ckeys, 0)
        try:
            stored = self.pool.save(tenant, keys, chunks, start=start)
        except (BadRequest, UnknownTenant):
            raise
        except KvPoolError as e:  # full, over quota, cancelled: the chunks before it are kept
            logger.warning("kvpool stored only part of %d pages: %s", len(ckeys), e)
            self._count("write_errors")
            stored = 0
        dt = time.perf_counter() - t0
        try:
            resident = self.pool.lookup_mine(tenant, ckeys) // self.page_size  # this rank's part of each page
        except (BadRequest, UnknownTenant):
            raise
        except Exception as e:
            logger.warning("kvpool lookup after a write failed: %s", e)
            resident = 0
        with self._lock:
            self._counts["set_pages"] += len(ckeys)
            self._counts["set_stored"] += stored
            self._metrics["backup_pgs"].append(resident)
            nbytes = len(ckeys) * self.rank_bytes
            self._metrics["backup_bandwidth"].append(nbytes / dt / 1e9 if dt > 0 else 0.0)
        return resident

    def _parent(self, tenant, salt, parent_key: Optional[str]) -> Optional[ChunkKey]:
        """The chunk before a batch (SGLang passes the pages before it as ``prefix_keys`` when
        ``hicache_storage_pass_prefix_keys`` is on), when the pool holds it: the pool then evicts
        the batch before its prefix."""
        if not parent_key:
            return None
        key = self.chunk_keys([parent_key], tenant, salt)[0]
        try:
            return key if self.pool.lookup(tenant, [key]) else None
        except (BadRequest, UnknownTenant):
            raise
        except Exception:
            return None

    # ------------------------------------------------------------------ HiCacheStorage: generic path

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None, *,
            extra_info=None) -> torch.Tensor | None:
        """One page as a flat host page (written into ``target_location`` when given), or None."""
        out = self.batch_get([key], [target_location] if target_location is not None else None, target_sizes,
                             extra_info=extra_info)
        return out[0]

    def batch_get(self, keys: list[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None,
                  *, extra_info=None) -> list[torch.Tensor | None]:
        """Flat pages of the leading run of hits; None from the first miss on (a page after a hole is
        useless to a prefix)."""
        self._need_pool()
        if target_locations is not None and len(target_locations) != len(keys):
            raise BadRequest(f"{len(keys)} keys but {len(target_locations)} target locations")
        targets = [self._pages.check_flat(t, f"target_locations[{i}]") for i, t in enumerate(target_locations or [])]
        route, salt, _ = self._context(extra_info)
        ckeys = self.chunk_keys(keys, route.pool_as if route else None, salt)  # bad keys fail either way
        chunks = self._load(route.pool_as, ckeys) if route else []
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, chunk in enumerate(chunks):
            flat = targets[i] if targets else self._pages.empty_flat()
            out[i] = self._pages.chunk_into_flat(chunk, flat)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None, *, extra_info=None) -> bool:
        """Stores one flat host page; True when it is in the pool afterwards."""
        return self.batch_set([key], [value], target_location, target_sizes, extra_info=extra_info)

    def batch_set(self, keys: list[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None, *, extra_info=None) -> bool:
        """Stores flat host pages (``keys[i]`` follows ``keys[i-1]``); True when all are in the pool."""
        self._need_pool()
        if values is None or len(values) != len(keys):
            raise BadRequest(f"{len(keys)} keys but {0 if values is None else len(values)} values: pass one flat "
                             "host page per key")
        chunks = [self._pages.flat_to_chunk(self._pages.check_flat(v, f"values[{i}]")) for i, v in enumerate(values)]
        if not keys:
            return True
        route, salt, parent_key = self._context(extra_info)
        tenant = route.pool_as if route else None
        ckeys = self.chunk_keys(keys, tenant, salt)  # bad keys fail either way
        if route is None:
            return False
        return self._save(tenant, ckeys, chunks, self._parent(tenant, salt, parent_key)) == len(keys)

    def exists(self, key: str, *, extra_info=None) -> bool:
        return self.batch_exists([key], extra_info) == 1

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """How many leading pages of ``keys`` the pool holds."""
        self._need_pool()
        route, salt, _ = self._context(extra_info)
        tenant = route.pool_as if route else None
        ckeys = self.chunk_keys(keys, tenant, salt)  # bad keys fail either way
        if not ckeys or route is None:
            return 0
        try:
            return self.pool.lookup(tenant, ckeys) // self.page_size
        except (BadRequest, UnknownTenant):
            raise
        except Exception as e:
            logger.warning("kvpool lookup of %d pages failed, read as a miss: %s", len(ckeys), e)
            self._count("read_errors")
            return 0

    # ------------------------------------------------------------------ HiCacheStorage: zero-copy path

    def _host_slots(self, keys: list[str], host_indices) -> torch.Tensor:
        self._need_pool()
        return self._pages.check_slots(len(keys), host_indices)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        """Loads the leading run of pages straight into the host pool at ``host_indices``; a True per
        page loaded."""
        slots = self._host_slots(keys, host_indices)
        route, salt, _ = self._context(extra_info)
        ckeys = self.chunk_keys(keys, route.pool_as if route else None, salt)  # bad keys fail either way
        chunks = self._load(route.pool_as, ckeys) if route else []
        self._pages.write(chunks, slots)
        n = len(chunks)
        return [True] * n + [False] * (len(keys) - n)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        """Stores the host pool's pages at ``host_indices`` under ``keys``; a True per page whose
        slices from this rank are in the pool afterwards (SGLang agrees across ranks on reads: the
        least of the ranks' hits)."""
        slots = self._host_slots(keys, host_indices)
        if not keys:
            return []
        route, salt, parent_key = self._context(extra_info)
        tenant = route.pool_as if route else None
        ckeys = self.chunk_keys(keys, tenant, salt)  # bad keys fail either way
        if route is None:
            return [False] * len(keys)
        chunks = self._pages.read(slots)
        resident = self._save(tenant, ckeys, chunks, self._parent(tenant, salt, parent_key))
        return [i < resident for i in range(len(keys))]

    # ------------------------------------------------------------------ housekeeping

    def clear(self) -> None:
        # NOTE: the pool is shared (other engines, other tenants) and has its own eviction; a
        # flush of one SGLang instance must not drop anyone else's chunks, so nothing is removed.
        logger.warning("kvpool HiCache backend: clear() leaves the shared pool as it is (its eviction policy "
                       "frees space)")

    def stats(self) -> dict:
        """Counters of this backend and its measured load bandwidth."""
        return {**self._counts, **self.tenancy.stats(), "tenant": self.tenant, "page_size": self.page_size,
                "layout": None if self._pages is None else self._pages.layout.variant, **self.breakeven.stats()}

    def get_stats(self):
        """SGLang's StorageMetrics since the last call (None when SGLang's metrics module is absent)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # pragma: no cover - SGLang without its metrics dependencies
            return None
        m = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(m, name).extend(values)
            values.clear()
        return m

    def close(self) -> None:
        """Forgets the pool (a local pool stays open for its other users, by name)."""
        self.pool = None
        self.mem_pool_host = None
