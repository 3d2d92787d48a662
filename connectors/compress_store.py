"""Compressed prefixes in the pool: how the transformers connector keys, stores and loads them.

A prompt compressed on save (:mod:`kvpool.connectors.compress`, LOSSY, opt-in through the connector
config ``{"compress": {"method": "snapkv", "budget": 512, ...}}``) no longer lines up with chunk
boundaries: its ``budget`` kept entries stand for the ``P`` tokens of the prompt's whole chunks. So
it is stored, and loaded, whole:

- Keys: derived from the key of the prompt's chunk ``P / chunk_tokens - 1`` (which identifies the
  whole ``P``-token prefix, the tenant's namespace and the spec) and a tag naming the method, the
  budget and every parameter that changes the bytes: ``key_i = blake2b-128(k_P || tag || i)``. A
  compressed prefix therefore never answers a raw lookup, nor one of another method or budget.
- Chunks: one or more header chunks (magic, version, original length ``P``, entries per layer, and
  every entry's int32 original position ``[layers, heads, entries]``), then the kept K and V in the
  canonical chunk layout ``[layers, 2, chunk_tokens, heads, dim]``, re-chunked and zero-padded.
- A later prompt that extends the ``P`` tokens (the next turn, another question after the same
  document at the same chunk boundary) finds it by probing its chunk boundaries, longest first.

Only raw storage of full-attention, K/V-layout models: a lossy storage format would quantize the
header, a sliding layer's window or a latent layout are not what the scores assume.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.auth import claimed_tenant
from kvpool.connectors.compress import UNIFORM, CompressedKV
from kvpool.errors import BadRequest
from kvpool.kernels.scoring import PARAMS

log = logging.getLogger("kvpool.connectors.hf")
MAGIC, VERSION = 0x6B76706F6F6C4358, 1  # "kvpoolCX"
_HEAD = 6  # int64 fields: magic, version, length, entries, layers, heads


@dataclass(frozen=True)
class CompressConfig:
    """A validated ``compress`` config: method, budget (kept tokens per layer), window and the
    method's own parameters (sorted name-value pairs)."""

    method: str
    budget: int
    window: int | None = None
    params: tuple = ()

    def tag(self) -> bytes:
        parts = [f"kvpool-compress/v{VERSION}", self.method, f"budget={self.budget}", f"window={self.window}"]
        parts += [f"{k}={v!r}" for k, v in self.params]
        return "/".join(parts).encode()

    def kwargs(self) -> dict:
        return {"method": self.method, "budget": self.budget, "window": self.window, **dict(self.params)}


def check_compress(config, spec) -> CompressConfig | None:
    """The ``compress`` connector setting, validated against the model's spec (None: off)."""
    if config is None:
        return None
    if not isinstance(config, dict) or "method" not in config or "budget" not in config:
        raise BadRequest('compress is a dict like {"method": "snapkv", "budget": 512} (LOSSY: opt-in token eviction)')
    cfg = dict(config)
    method, budget, window = cfg.pop("method"), cfg.pop("budget"), cfg.pop("window", None)
    if method in ("pyramidkv", "adakv"):
        raise BadRequest(f"compress method {method!r} keeps a different number of tokens per "
                         f"{'layer' if method == 'pyramidkv' else 'head'}, which a transformers DynamicCache cannot "
                         f"hold so that the model attends to exactly them: use one of {', '.join(UNIFORM)}")
    if method not in UNIFORM:
        raise BadRequest(f"unknown compress method {method!r}: use one of {', '.join(UNIFORM)}")
    for name, value in (("budget", budget), ("window", window)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"compress {name}={value!r} must be an integer >= 1")
    if window is not None and method != "snapkv":
        raise BadRequest(f"compress method {method!r} has no observation window: drop window")
    if window is not None and window > budget:
        raise BadRequest(f"compress window={window} exceeds budget={budget}: the window is kept within the budget")
    unknown = sorted(set(cfg) - set(PARAMS[method]) - {"window"})
    if unknown:
        raise BadRequest(f"compress method {method} takes no {', '.join(unknown)}: its parameters are "
                         f"method, budget, {', '.join(PARAMS[method])}")
    if spec.storage_format != "raw":
        raise BadRequest(f"compress with storage_format {spec.storage_format!r} is not supported: compressed "
                         "prefixes are stored raw; use storage_format 'raw' or drop compress")
    if spec.v_head_dim or any(kind != "full" for kind in spec.layer_kinds):
        raise BadRequest("compress serves models whose layers are all full attention with K/V caches; "
                         f"this one's layers are {sorted(set(spec.layer_kinds))}: drop compress")
    if method == "snapkv" and window is None:
        window = min(64, budget)
    return CompressConfig(method, budget, window, tuple(sorted(cfg.items())))


def derived_keys(boundary_key, tag: bytes, count: int) -> list:
    """The keys of a compressed prefix whose last whole chunk has key ``boundary_key``."""
    kind = type(boundary_key)  # a SharedKey stays shared
    return [kind(hashlib.blake2b(bytes(boundary_key) + tag + i.to_bytes(4, "little"), digest_size=16).digest())
            for i in range(count)]


def max_chunks(spec, cfg: CompressConfig) -> int:
    """Chunks of a compressed prefix of at most ``budget`` entries: header(s), then the K/V."""
    return _header_chunks(spec, cfg.budget) + -(-cfg.budget // spec.chunk_tokens)


def _header_chunks(spec, entries: int) -> int:
    nbytes = 8 * _HEAD + 4 * spec.num_layers * spec.num_kv_heads * entries
    return -(-nbytes // spec.chunk_nbytes)


def _shape(spec, tokens: int) -> tuple[int, ...]:
    return (spec.num_layers, 2, tokens, spec.num_kv_heads, spec.head_dim)


def encode(ckv: CompressedKV, spec) -> list[torch.Tensor]:
    """The chunks of a uniform compressed prefix, header first."""
    if ckv.ragged:
        raise BadRequest(f"{ckv.method} keeps ragged counts: not storable (see check_compress)")
    entries, c = ckv.entries, spec.chunk_tokens
    pos = torch.stack([p[0] for p in ckv.positions]).to(torch.int32).cpu().numpy()  # [layers, heads, entries]
    head = np.array([MAGIC, VERSION, ckv.length, entries, spec.num_layers, spec.num_kv_heads], dtype=np.int64)
    raw = head.tobytes() + pos.tobytes()
    hc = _header_chunks(spec, entries)
    header = torch.zeros((hc, *_shape(spec, c)), dtype=ckv.keys[0].dtype)
    header.view(-1).view(torch.uint8)[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    data = torch.zeros(_shape(spec, -(-entries // c) * c), dtype=ckv.keys[0].dtype)
    for layer, (k, v) in enumerate(zip(ckv.keys, ckv.values)):
        data[layer, 0, :entries] = k[0].transpose(0, 1).cpu()
        data[layer, 1, :entries] = v[0].transpose(0, 1).cpu()
    chunks = [header[i].contiguous() for i in range(hc)]
    return chunks + [data[:, :, i : i + c].contiguous() for i in range(0, data.shape[2], c)]


def decode(chunks: list[torch.Tensor], spec, device) -> tuple[object, int, int] | None:
    """``(DynamicCache, original length, entries)`` of a stored compressed prefix, or None when the
    chunks are not a whole one (a partial run, another layout): a miss."""
    from transformers import DynamicCache

    if not chunks:
        return None
    first = chunks[0].reshape(-1).view(torch.uint8)[: 8 * _HEAD].numpy().view(np.int64)
    magic, version, length, entries, layers, heads = (int(x) for x in first)
    if (magic, version, layers, heads) != (MAGIC, VERSION, spec.num_layers, spec.num_kv_heads) or entries < 1:
        return None
    hc = _header_chunks(spec, entries)
    if len(chunks) < hc + -(-entries // spec.chunk_tokens):
        return None
    kv = torch.cat(chunks[hc:], dim=2)[:, :, :entries]  # [layers, 2, entries, heads, dim]
    cache = DynamicCache()
    for layer in range(spec.num_layers):
        k = kv[layer, 0].transpose(0, 1).unsqueeze(0).to(device)
        v = kv[layer, 1].transpose(0, 1).unsqueeze(0).to(device)
        cache.update(k, v, layer)
    return cache, length, entries


def cut_cache(cache, tokens: int):
    """A DynamicCache of the first ``tokens`` tokens of ``cache`` (views, no copy)."""
    from transformers import DynamicCache

    cut = DynamicCache()
    for layer, entry in enumerate(cache.layers):
        cut.update(entry.keys[:, :, :tokens], entry.values[:, :, :tokens], layer)
    return cut


def takes_attention(pool) -> bool:
    """Whether the pool's save takes per-chunk attention mass (the local pool does; a cluster pool not yet)."""
    return pool.takes_attention


def save_attention(model, cache, ids, chunk_tokens: int) -> list[float] | None:
    """Each whole chunk's attention mass for the ``importance`` policy, or None (logged) when the
    model's attention cannot be observed: a policy hint never fails a request."""
    from kvpool.connectors.compress import chunk_attention

    try:
        return chunk_attention(model, cache, ids, chunk_tokens)
    except Exception as e:  # noqa: BLE001
        log.warning("transformers connector: no attention mass for the importance policy (%s: %s)",
                    type(e).__name__, e)
        return None


def load_compressed(conn, tenant: str, keys: list, n: int, after: int):
    """:func:`load_longest` for a transformers connector ``conn``: any failure is a miss, counted."""
    try:
        return load_longest(conn.pool, conn.spec, conn.compress, tenant, keys, n, after,
                            next(conn.model.parameters()).device)
    except Exception as e:  # noqa: BLE001 - the pool must never fail a request: recompute instead
        log.warning("transformers connector: compressed load for tenant %s failed (%s: %s); recomputing",
                    claimed_tenant(tenant), type(e).__name__, e)  # never the credential
        conn.load_failed += 1
        return None


def load_longest(pool, spec, cfg: CompressConfig, tenant: str, keys: list, n: int, after: int, device):
    """``(cache, length, entries)`` of the longest stored compressed prefix ending at a chunk
    boundary in ``(after, n)`` (at least one token is left to compute), or None. Probes one key per
    boundary, longest first; the pool's errors propagate (the connector makes them a miss)."""
    c, tag, count = spec.chunk_tokens, cfg.tag(), max_chunks(spec, cfg)
    for i in range(min(len(keys), (n - 1) // c), after // c, -1):
        if i * c <= cfg.budget:
            break  # prefixes this short are stored raw (nothing to evict)
        dk = derived_keys(keys[i - 1], tag, count)
        if not pool.lookup(tenant, dk[:1]):
            continue
        got = decode(pool.load(tenant, dk), spec, device)
        if got is not None and got[1] == i * c:
            return got
    return None


def save_compressed(model, pool, spec, cfg: CompressConfig, tenant: str, keys: list, cache, ids, whole: int, *,
                    shared: bool = False) -> int:
    """Compresses the prompt's first ``whole`` chunks (in ``cache``, exact) and stores them whole;
    returns the chunks stored."""
    from kvpool.connectors.compress import compress_cache

    tokens = whole * spec.chunk_tokens
    ckv = compress_cache(model, cut_cache(cache, tokens), input_ids=ids[:, :tokens], **cfg.kwargs())
    chunks = encode(ckv, spec)
    return pool.save(tenant, derived_keys(keys[whole - 1], cfg.tag(), len(chunks)), chunks, shared=shared)
