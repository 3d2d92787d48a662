"""The pool a connector talks to, opened from the connector's config, and the KV spec of a model.

Every connector (transformers, vLLM, SGLang) describes its model the same way (``spec_for``) and
opens its pool the same way (``open_pool``), so the same tokens of the same model hit the same
chunks whichever engine wrote them.

Config (a dict; vLLM passes it as ``kv_connector_extra_config``, SGLang as the backend's extra
config):

- ``backend``: ``"local"`` (an in-process pool, shared by every connector of this process that
  names the same ``pool``; the default, but vLLM's connector defaults to ``"node"``) or ``"node"``
  (the pool, through this node's shard);
- ``"node"`` (:class:`kvpool.node.pool.NodePool`): the engine never joins Ray. It finds its
  node's shard through ``kvpool-<pool>-<shard>.node`` in ``run_dir`` (default
  ``$KVPOOL_RUN_DIR``, else /dev/shm: the shard's), reads same-node hits straight from shared
  memory and makes every other call on the shard's Unix socket, each within ``timeout_s``
  (default 2). A pool that is down (shard, Ray head or Redis) makes reads misses and writes store
  nothing, tried again at most every second (at start, see below: ``degraded``). ``shard``
  names this node's shard where one machine runs several (else ``$KVPOOL_SHARD``). Every engine
  process opens its own client, so vLLM's scheduler and worker may run apart;
- ``pool``: the pool's name (default ``"default"``); ``dram_mib`` a local pool's size (default 1024);
- ``tenants``: the tenants the pool serves (default ``["default"]``), each an id or a dict with
  ``id``, the :class:`~kvpool.tenants.Tenant` settings (``quota_bytes``, ``priority``,
  ``storage_format`` to store its chunks in a format of its own, ...) and,
  for the engines' request routing (:mod:`kvpool.connectors.tenancy`), optional
  ``request_secret`` (what an API user sends to be served as this tenant) and ``credential`` (the
  tenant's pool credential, ``kvp1...``, for a secured pool); ``tenant``: the one a request
  without a secret is served as;
- ``credentials_file``: a JSON file ``{tenant: credential}`` (a mounted Kubernetes Secret; for a
  ``"node"`` pool, default ``~/.kvpool/credentials.json``, where `kvpool connect` writes them);
- ``secret_file``: the pool secret of a *local* pool that should be secured (else
  ``$KVPOOL_SECRET_FILE`` / ``$KVPOOL_SECRET`` when set): the pool then takes credentials, and the
  configured tenants' credentials are issued here. A cluster's engines never hold its secret:
  they take credentials;
- ``chunk_tokens`` (default 256);
- ``storage_format``: how chunks are stored, ``"raw"`` (default: the KV's own bytes, exact) or one
  of the LOSSY formats ``"fp8"``, ``"int8"``, ``"int4-kivi"``, ``"int2-kivi"`` (opt-in: chunks are
  quantized on save and dequantized on load, so the model continues from KV close to, not equal
  to, its own; see :mod:`kvpool.codec` and docs/formats.md). The format is part of every chunk's
  key: engines of other formats never read each other's chunks. A chunk is stored as one slice per
  KV head (:mod:`kvpool.slices`, so any tensor-parallel size reads it). A local pool sizes its
  pages to the stored slice (``dram_mib`` holds ~1/bytes-ratio more chunks); a cluster pool needs
  ``kvpool up --page-size`` of at least the stored slice (``kvpool up --model`` sizes it);
- start-up: a ``"node"`` pool must answer when the connector starts (``open_pool``): the node's
  shard (its node file in ``run_dir``, then a ping on its socket) within ``start_timeout_s``
  (default 30: a pool that is starting is waited for, with a log line every few seconds). If it
  does not, the engine does not start: ``Unavailable`` (503) names what did not answer and the
  fix. ``degraded`` (default false; ``"node"`` only) starts the engine anyway (``start_timeout_s`` then defaults to 0): it
  logs that it runs DEGRADED, recomputing every prompt, until the pool answers (looked for again
  at most every second), and says so in its figures (``PoolHealth``: the connector's stats and
  its reports to ``kvpool stats``). Then the shard checks each tenant's credential, and a missing
  one, one of another pool secret or a tenant the pool does not serve stops the engine too
  (:mod:`kvpool.connectors.pool_start`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Any

from kvpool.auth import SECRET_FILE_ENV, Authority
from kvpool.codec import page_bytes
from kvpool.errors import BadRequest, LayoutMismatch
from kvpool.pool import LocalPool
from kvpool.slices import SlicedPool, Slicing
from kvpool.spec import STORAGE_FORMATS, KVSpec
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry

log = logging.getLogger("kvpool.connectors")
BACKENDS = ("local", "node")
REPORT_S = 5.0  # how often a connector reports its figures (a heartbeat for `kvpool stats`)
POKE_GAP_S = 0.5  # at most this often when its figures change
KNOWN_KEYS = {"backend", "pool", "dram_mib", "tenants", "tenant", "chunk_tokens", "timeout_s", "policy", "load_min_tokens", "credentials_file", "secret_file", "shard",
              "run_dir", "storage_format", "degraded", "start_timeout_s",
              "compress"}  # transformers connector only (kvpool.connectors.compress_store); paged engines refuse it
NO_COMPRESS = ("compress (token eviction on save) is for the transformers connector only: {engine} is a paged "
               "engine whose blocks hold every token at its own position, so it cannot load a compressed prefix "
               "(fewer entries than positions); remove `compress` from this config (see docs/compression.md)")
# Keys of a tenant's dict that route requests (kvpool.connectors.tenancy); the rest are Tenant's.
TENANT_AUTH_KEYS = ("request_secret", "credential")
TENANT_KEYS = frozenset(f.name for f in dataclasses.fields(Tenant)) | set(TENANT_AUTH_KEYS)
DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
               "float": "float32", "half": "float16", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

_local_stores: dict[str, ChunkStore] = {}
_local_auth: dict[str, Authority] = {}
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


def unknown_keys(unknown: set, known: set, what: str) -> str:
    """The message for ``unknown`` keys of ``what``: each with its likely intended key, then the known ones."""
    import difflib

    guesses = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), sorted(known), 1, 0.6))
               else repr(k) for k in sorted(unknown, key=str)]
    return f"unknown {what} {', '.join(guesses)}; known: {sorted(known)}"


def check_keys(config: dict[str, Any], also=frozenset(), what: str = "kvpool connector settings") -> None:
    """Every key is a pool setting or one of ``also`` (an engine's own); else a BadRequest naming,
    for each unknown key, the key it likely meant ("did you mean"), then every known key."""
    if unknown := set(config) - KNOWN_KEYS - set(also):
        raise BadRequest(unknown_keys(unknown, KNOWN_KEYS | set(also), what))


def check_config(config: dict[str, Any], also=frozenset()) -> dict[str, Any]:
    """The pool config checked (``also``: keys the engine reads itself) and its defaults filled in."""
    check_keys(config, also)
    backend = config.get("backend", "local")
    if backend not in BACKENDS:
        raise BadRequest(f"kvpool backend {backend!r} is not one of {', '.join(map(repr, BACKENDS))} (a cluster's "
                         "engines reach it through their node's shard: 'node')")
    tenants = config.get("tenants", ["default"])
    if not isinstance(tenants, (list, tuple)):
        raise BadRequest(f"tenants is a list of tenant ids or {{'id': ...}} dicts, got {type(tenants).__name__}")
    for t in tenants:
        _check_tenant(t)
    for k in ("shard", "run_dir"):
        if k in config and (backend != "node" or not isinstance(config[k], str) or not config[k]):
            raise BadRequest(f"{k} is a non-empty string, for backend 'node' only")
    if "timeout_s" in config:
        try:
            ok = float(config["timeout_s"]) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise BadRequest(f"timeout_s is a number of seconds > 0, got {config['timeout_s']!r}")
    if not isinstance(config.get("degraded", False), bool):
        raise BadRequest(f"degraded is true or false, got {config['degraded']!r}")
    if config.get("degraded") and backend != "node":
        raise BadRequest("degraded: true needs backend 'node' (a local pool has no pool to miss): use backend "
                         "'node', or remove degraded")
    if "start_timeout_s" in config:
        try:
            ok = float(config["start_timeout_s"]) >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise BadRequest(f"start_timeout_s is a number of seconds >= 0, got {config['start_timeout_s']!r}")
    for k in ("credentials_file", "secret_file"):
        if k in config and (not isinstance(config[k], str) or not config[k]):
            raise BadRequest(f"{k} is the path of a file, got {type(config[k]).__name__}")
    fmt = config.get("storage_format", "raw")
    if fmt not in STORAGE_FORMATS:
        raise BadRequest(f"storage_format {fmt!r} is not one of {', '.join(map(repr, STORAGE_FORMATS))} "
                         "('raw' is exact; the others are lossy and opt-in)")
    if "secret_file" in config and backend != "local":
        raise BadRequest("secret_file secures a local pool; a cluster's engines take credentials, never its secret: "
                         "set credentials_file or the tenants' credential instead")
    return {"backend": backend, "pool": config.get("pool", "default"), "dram_mib": int(config.get("dram_mib", 1024)),
            "tenants": list(tenants), "chunk_tokens": int(config.get("chunk_tokens", 256)), "storage_format": fmt,
            **{k: config[k] for k in ("tenant", "timeout_s", "policy",
                                      "load_min_tokens", "credentials_file", "secret_file", "shard", "run_dir",
                                      "degraded", "start_timeout_s")
               if k in config}}


def _check_tenant(t: object) -> None:
    if isinstance(t, str):
        return
    if not isinstance(t, dict) or not isinstance(t.get("id"), str):
        raise BadRequest(f"each of tenants is a tenant id or a dict with an 'id', got {type(t).__name__}")
    unknown = set(t) - TENANT_KEYS
    if unknown:
        raise BadRequest(f"tenant {t['id']!r}: " + unknown_keys(unknown, set(TENANT_KEYS), "settings"))
    for k in TENANT_AUTH_KEYS:
        if k in t and (not isinstance(t[k], str) or not t[k]):  # NOTE: never show the value: it is a secret
            raise BadRequest(f"tenant {t['id']!r}: {k} is a non-empty string, got {type(t[k]).__name__}")


def tenant_ids(config: dict[str, Any]) -> list[str]:
    """The ids of the config's tenants."""
    return [t if isinstance(t, str) else t["id"] for t in check_config(config)["tenants"]]


def pool_tenants(cfg: dict[str, Any]) -> list[Tenant]:
    """The config's tenants as the pool registers them (without their routing keys)."""
    return [Tenant(t) if isinstance(t, str) else Tenant(**{k: v for k, v in t.items() if k not in TENANT_AUTH_KEYS})
            for t in cfg["tenants"]]


def pool_authority(config: dict[str, Any]) -> Authority:
    """Who checks credentials in the pool ``config`` opens, seen from this process: a local pool's
    secret (``secret_file``, else ``$KVPOOL_SECRET_FILE`` / ``$KVPOOL_SECRET``; open without one),
    the same for every opener of that pool; ``Authority(None)`` for a cluster (its shards hold the
    secret, the engine only credentials)."""
    cfg = check_config(config)
    if cfg["backend"] != "local":
        return Authority(None)
    path = cfg.get("secret_file")
    auth = Authority.from_env({SECRET_FILE_ENV: path} if path else None)
    with _lock:
        known = _local_auth.setdefault(cfg["pool"], auth)
    if not known.same_secret(auth):
        raise BadRequest(f"local pool {cfg['pool']!r} is already open {'with another' if known.secured else 'without a'}"
                         " pool secret in this process: give every connector of it the same secret_file")
    return known


def open_pool(spec: KVSpec, config: dict[str, Any] | None = None, slicing: Slicing | None = None) -> SlicedPool:
    """The pool for ``spec``'s chunks of one engine rank (``slicing``: its heads and layers; default
    the whole model), stored as per-head slices (kvpool.slices) in a ``LocalPool`` or a ``NodePool``
    (through this node's shard): keys, lookup, begin, load, save, end."""
    slicing = slicing or Slicing.of(spec)
    cfg = check_config(config or {})
    if "storage_format" in (config or {}) and cfg["storage_format"] != spec.storage_format:
        raise BadRequest(f"the config's storage_format {cfg['storage_format']!r} is not the spec's "
                         f"{spec.storage_format!r}: build the spec with spec_for(..., storage_format=)")
    tenants = pool_tenants(cfg)
    whole, spec = spec, slicing.slice_spec(spec)
    if cfg["backend"] == "local":
        with _lock:
            store = _local_stores.get(cfg["pool"])
            if store is None:
                page = page_bytes(spec, [t.storage_format for t in tenants])  # quantized, in a lossy format
                pages = max(1, (cfg["dram_mib"] << 20) // page)
                store = ChunkStore(StoreConfig(page, pages, policy=cfg.get("policy", "default"),
                                               storage_format=spec.storage_format), TenantRegistry(tenants))
                _local_stores[cfg["pool"]] = store
            else:
                need = page_bytes(spec, [t.storage_format for t in tenants])
                if need > store.page_bytes:
                    raise LayoutMismatch(f"local pool {cfg['pool']!r} was opened with pages of {store.page_bytes} B, "
                                         f"for a smaller chunk (another model or storage_format); a chunk of this "
                                         f"spec takes {need} B: give this connector its own pool name")
                for t in tenants:
                    store.tenants.add(t)
        return SlicedPool(LocalPool(spec, store, pool_authority(cfg), keyed_as=whole), whole, slicing)
    from kvpool.node.client import NodeClient  # NOTE: no Ray on this path: the engine never joins the cluster

    client = NodeClient(pool=cfg["pool"], shard=cfg.get("shard"), directory=cfg.get("run_dir"),
                        timeout_s=float(cfg.get("timeout_s", 2.0)))
    from kvpool.connectors.pool_start import node_answers

    node_answers(client, cfg)
    return node_pool(whole, client, tenants, slicing)


def node_pool(spec: KVSpec, client, tenants, slicing: Slicing | None = None) -> SlicedPool:
    """A rank's pool of ``spec``'s chunks (``slicing``; default the whole model) over an open
    ``NodeClient``, stored as slices (tools that hold a client of their own: warm-up)."""
    from kvpool.node.pool import NodePool

    slicing = slicing or Slicing.of(spec)
    return SlicedPool(NodePool(slicing.slice_spec(spec), client, list(tenants), keyed_as=spec), spec, slicing)


def local_pool(spec: KVSpec, tenants: TenantRegistry, chunks: int, *, authority: Authority | None = None,
               **config: Any) -> SlicedPool:
    """An in-process pool of its own (benchmarks, demos, tests) that holds ``chunks`` whole chunks of
    ``spec`` as slices, its pages one slice each (``LocalPool.create``'s ``config``)."""
    slicing = Slicing.of(spec)
    part = LocalPool.create(slicing.slice_spec(spec), tenants, chunks * slicing.per_chunk, authority=authority,
                            keyed_as=spec, **config)
    return SlicedPool(part, spec, slicing)


def as_sliced(pool) -> SlicedPool:
    """``pool`` as a :class:`SlicedPool` of the whole model: a ``LocalPool`` or ``NodePool`` given to a
    connector directly (tests, tools) stores the same slices an opened one does."""
    if isinstance(pool, SlicedPool):
        return pool
    from kvpool.node.pool import NodePool

    if isinstance(pool, NodePool):
        return node_pool(pool.spec, pool.client, pool._tenants.values())
    if not isinstance(pool, LocalPool):
        raise BadRequest(f"a connector's pool is a LocalPool, a NodePool or one open_pool made, not {type(pool).__name__}")
    slicing = Slicing.of(pool.spec)
    return SlicedPool(LocalPool(slicing.slice_spec(pool.spec), pool.store, pool.auth, keyed_as=pool.spec), pool.spec,
                      slicing)


class PoolHealth:
    """Whether a connector's pool answers now (looked at most every ``every_s``). A connector
    started ``degraded`` recomputes everything while it does not; the transitions are logged, and
    ``figures`` (in the connector's stats and reports) say DEGRADED and for how long."""

    def __init__(self, pool, every_s: float = 1.0) -> None:
        self.pool, self.every_s = pool, every_s
        self._up, self._checked, self._down_since = True, float("-inf"), None
        self.degraded_s, self.outages = 0.0, 0
        self._lock = threading.Lock()  # the reporter's thread asks too
        self.up()

    def up(self) -> bool:
        with self._lock:
            return self._look()

    def _look(self) -> bool:
        now = time.monotonic()
        if now - self._checked < self.every_s:
            return self._up
        self._checked = now
        client = getattr(self.pool, "client", None)
        up = client is None or bool(client.shards)  # a NodePool: its shard answers
        if up != self._up:
            if up:
                self.degraded_s += now - self._down_since
                log.warning("kvpool: pool %r answers again: no longer degraded (%.0f s degraded)",
                            getattr(client, "pool", ""), now - self._down_since)
            else:
                self.outages += 1
                log.warning("kvpool: pool %r does not answer: running DEGRADED, recomputing every prompt until it "
                            "does", getattr(client, "pool", ""))
            self._down_since = None if up else now
            self._up = up
        return up

    def figures(self) -> dict[str, Any]:
        with self._lock:
            up = self._look()
            now_s = 0.0 if up else time.monotonic() - self._down_since
        return {"degraded": not up, "degraded_s": round(self.degraded_s + now_s, 3), "outages": self.outages}


class Reporter:
    """Sends a connector's figures to its pool's controller (``kvpool stats``) every ``every_s``
    from a daemon thread, a heartbeat: the controller marks an engine that stopped reporting
    silent (kvpool.cluster.reports.Reports); ``close`` says goodbye. Nothing for a pool that takes
    no reports (a local one). ``figures`` is held weakly: the thread ends with its connector.
    ``credential``: what every report goes with (an engine serving several tenants reports as
    one, its default tenant: the pool keeps an engine's reports apart by the tenant sending them);
    None: the pool client's choice."""

    def __init__(self, pool, name: str, figures, every_s: float = REPORT_S, credential: str | None = None) -> None:
        self.name, self.every_s = name, every_s
        self._as = {"credential": credential} if credential else {}
        self._send = getattr(pool, "report", None)
        self._stop, self._wake = threading.Event(), threading.Event()
        if self._send is None:
            return
        ref = weakref.WeakMethod(figures) if hasattr(figures, "__self__") else (lambda: figures)
        threading.Thread(target=self._run, args=(ref,), daemon=True, name="kvpool-reporter").start()

    def _run(self, ref) -> None:
        while True:
            fn = ref()
            if fn is None or self._stop.is_set():
                return
            try:
                self.send(fn())
            except Exception as e:  # noqa: BLE001 - a figure that cannot be read now: next time
                log.debug("kvpool: figures of %s failed (%s)", self.name, e)
            del fn
            self._wake.wait(self.every_s)
            self._wake.clear()
            if self._stop.wait(POKE_GAP_S):  # a burst of pokes: one report
                return

    def poke(self) -> None:
        """Reports soon (a load or a recompute just happened), not at the next heartbeat."""
        self._wake.set()

    def send(self, figures: dict[str, Any]) -> None:
        if self._send is not None:
            try:
                self._send(self.name, {**figures, "every_s": self.every_s}, **self._as)
            except Exception as e:  # noqa: BLE001 - figures are best effort, never a failed request
                log.debug("kvpool: report of %s failed (%s)", self.name, e)

    def close(self) -> None:
        """Stops the heartbeat and tells the controller this engine is gone."""
        if self._send is not None and not self._stop.is_set():
            self._stop.set()
            self._wake.set()
            try:
                self._send(self.name, {"goodbye": True}, **self._as)
            except Exception:  # noqa: BLE001 - the controller forgets it after a few intervals anyway
                pass


def close_local_pools() -> None:
    """Forgets the in-process pools (tests; a fresh engine process starts with none anyway)."""
    with _lock:
        for store in _local_stores.values():
            store.close()
        _local_stores.clear()
        _local_auth.clear()
