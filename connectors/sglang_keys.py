"""The kvpool keys of SGLang pages: which model, rank, tenant and salt a page key is read under.

Keys. SGLang names a page by a hex SHA-256 chained over the page's tokens (the chain of the
request's earlier pages, seeded by the request's ``extra_key`` / ``cache_salt`` when it has one:
``sglang.srt.mem_cache.utils.storage_namespace_seed``). The backend never sees tokens, so it
cannot derive kvpool's token keys; instead each page key becomes a ChunkKey
``xxh3_128(root || page key)``, where ``root`` is the kvpool namespace root
(``Namespace.root()``) of: the tenant's salt, the spec fingerprint (model, shape, dtype, page
size), this rank's pipeline stage and context-parallel rank (never its tensor-parallel rank: a page is
stored as per-head slices, :mod:`kvpool.slices`, which any TP size reads), and any
``extra_key`` / ``cache_salt`` the call carries. Because the SGLang key already names its whole
prefix, so does the ChunkKey, and "how many leading pages exist" stays a leading-run lookup. The
model in the spec fingerprint is its weights (:func:`model_identity`), so a checkpoint rewritten in
place never reads the old one's pages.

NOTE: cross-engine sharing does not reach this path: vLLM and transformers chunks are keyed over
tokens, SGLang pages over SGLang's hashes, so the same prompt lands in two key spaces. Sharing
between SGLang instances (of one model, dtype, page size and sharding) works.

Tenants. A call is served as the tenant whose request secret is
``extra_info.extra_info["kvpool_secret"]`` (:mod:`kvpool.connectors.tenancy`), as the config's
``tenant`` (default: the first of ``tenants``) when it carries none, and not cached at all when its
secret is nobody's. A ``"tenant"`` name in the extra info is ignored (counted). ``extra_key`` and
``cache_salt`` enter the namespace too. SGLang 0.5.23 passes none of them to backends (its
``HiCacheStorageExtraInfo.extra_info`` is only filled by Mooncake's session linker), so a stock
SGLang server serves every request as the default tenant; it folds the salt into the page hashes
instead, so salted requests already arrive with disjoint keys. Taking the salt into the namespace
when it is given closes the hole where a path drops it from the hash (tenants would then share
pages): the same page key under two salts, or under two tenants, never names the same chunk, and
the store additionally refuses to show one tenant's chunk to another.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Optional

import xxhash

from kvpool.connectors.families import UnsupportedModel, engine_scope, layer_kinds
from kvpool.connectors.weights import local_checkpoint, weights_of_folder
from kvpool.errors import BadRequest
from kvpool.keys import ChunkKey

KEY_SCHEME = b"sglang-page/v2"  # names this key derivation: a change of scheme misses, never collides
_MAX_KEY_CHARS = 1024


def model_identity(model_name: str, given: str | None) -> tuple[str, tuple[str, ...], str]:
    """(weights fingerprint, layer kinds, engine scope) of the model SGLang serves; refuses families
    this backend does not serve (sliding, chunked or linear-attention layers) and a model it cannot
    fingerprint (or whose checkpoint changed since SGLang loaded it: :func:`weights_of_folder`)."""
    folder = local_checkpoint(model_name)
    if folder is None:  # the user named the weights; the layers are MHA pages (checked at registration)
        return weights_of_folder(model_name, None, given, engine="SGLang"), (), "sglang"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    kinds = layer_kinds(config, engine="kvpool's SGLang backend")
    windowed = sorted({k for k in kinds if k != "full"})
    if windowed:
        # NOTE: not verified against SGLang's hybrid sliding-window pools; refuse rather than guess.
        raise UnsupportedModel(f"kvpool's SGLang backend: {model_name} has {windowed} layers; the backend serves "
                               "full-attention MHA models only. Serve it without --hicache-storage-backend kvpool")
    return weights_of_folder(model_name, None, given, engine="SGLang"), kinds, engine_scope(config, "sglang")


def total_kv_heads(model_name: str) -> int | None:
    """The model's KV heads over all tensor-parallel ranks (its config's), None without a local config."""
    folder = local_checkpoint(model_name)
    if folder is None:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    return int(heads) if heads else None


PARAM_SECRET = "kvpool_secret"  # the request secret in extra_info.extra_info
PARAM_TENANT = "tenant"  # a tenant name there: the old way, ignored


def call_context(extra_info) -> tuple[object, object, tuple[str, ...], Optional[str]]:
    """(request secret, tenant name given, salt parts, parent page key) of a call carrying SGLang's
    ``extra_info``; the secret is routed by :class:`kvpool.connectors.tenancy.Tenancy`."""
    info = getattr(extra_info, "extra_info", None) or {}
    if not isinstance(info, dict):
        raise BadRequest(f"extra_info.extra_info must be a dict, got {type(info).__name__}")
    salt = tuple(f"{name}:{info[name]}" for name in ("extra_key", "cache_salt") if info.get(name) is not None)
    prefix = getattr(extra_info, "prefix_keys", None)
    return info.get(PARAM_SECRET), info.get(PARAM_TENANT), salt, (prefix[-1] if prefix else None)


class PageKeys:
    """The ChunkKeys of one rank's SGLang page keys, with the namespace root of each (tenant, salt)
    computed once."""

    def __init__(self, shard: tuple[str, ...]) -> None:
        self.shard = shard  # this rank's part of the model that is in its keys, e.g. ("pp=0/1", "cp=0/1")
        self._roots: dict[tuple, bytes] = {}
        self._lock = threading.Lock()

    def root(self, pool, tenant: str, salt: tuple[str, ...]) -> bytes:
        """The namespace root of ``tenant`` with ``salt`` in ``pool``."""
        root = self._roots.get((tenant, salt))
        if root is None:
            if not isinstance(tenant, str):
                raise BadRequest(f"tenant must be a string, got {type(tenant).__name__}")
            ns = pool.namespace(tenant, extra_keys=(KEY_SCHEME, *self.shard, *salt))
            root = bytes(ns.root())
            with self._lock:
                self._roots[(tenant, salt)] = root
        return root

    def chunk_keys(self, pool, keys: Sequence[str], tenant: str, salt: Sequence[str]) -> list[ChunkKey]:
        """The ChunkKeys of SGLang page keys in ``tenant``'s namespace of ``pool``, with ``salt``."""
        if isinstance(keys, (str, bytes)):
            raise BadRequest("keys must be a list of page-key strings, not one string")
        root = self.root(pool, tenant, tuple(salt))
        digest = xxhash.xxh3_128_digest
        out = []
        for k in keys:
            if not isinstance(k, str) or not k or len(k) > _MAX_KEY_CHARS:
                raise BadRequest(f"an SGLang page key is a non-empty string (a hex SHA-256) of at most "
                                 f"{_MAX_KEY_CHARS} chars, got {type(k).__name__} {str(k)[:40]!r}")
            out.append(ChunkKey(digest(root + b"\x00" + k.encode())))
        return out
