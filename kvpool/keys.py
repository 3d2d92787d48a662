"""Chunk keys: 128-bit, chained over prefix chunks.

``k_0 = xxh3_128(namespace)`` and ``k_i = xxh3_128(k_{i-1} || tokens_i as little-endian int32)``.
A key therefore names its whole prefix: a lookup is "how many leading keys exist". The namespace
(format version, tenant salt, spec fingerprint, adapter id, extra keys) keeps tenants, layouts
and LoRA adapters apart. Only full chunks are keyed. Never Python's ``hash()``: keys must be the
same in every process and on every machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from kvpool.errors import BadRequest
from kvpool.spec import FORMAT_VERSION, KVSpec

KEY_BYTES = 16
_INT32_MAX = 2**31 - 1


class ChunkKey(bytes):
    """A 16-byte chunk key. A bytes subclass (hashable, cheap) that bare bytes cannot pass for."""

    __slots__ = ()

    def __new__(cls, raw: bytes) -> "ChunkKey":
        if not isinstance(raw, (bytes, bytearray)):
            raise BadRequest(
                f"a chunk key is made of {KEY_BYTES} bytes, got {type(raw).__name__}: use ChunkKey.from_hex for text"
            )
        if len(raw) != KEY_BYTES:
            raise BadRequest(f"a chunk key is {KEY_BYTES} bytes, got {len(raw)}: use ChunkKey.from_hex")
        return super().__new__(cls, raw)

    @classmethod
    def from_hex(cls, text: str) -> "ChunkKey":
        try:
            raw = bytes.fromhex(text)
        except (ValueError, TypeError):
            raise BadRequest(f"malformed chunk key {text!r}: expected {2 * KEY_BYTES} hex digits") from None
        return cls(raw)

    def __repr__(self) -> str:
        return f"ChunkKey({self.hex()[:12]}…)"

    def __str__(self) -> str:
        return self.hex()


class SharedKey(ChunkKey):
    """A key of the shared namespace (``keys(..., shared=True)``): it addresses the chunks an
    operator published to every tenant, never a tenant's own (kvpool.auth: scopes)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"SharedKey({self.hex()[:12]}…)"


def is_shared(keys: Sequence[ChunkKey]) -> bool:
    """Whether ``keys`` (one prompt's) are the shared namespace's; a mix is bad input."""
    if not keys:
        return False
    shared = isinstance(keys[0], SharedKey)
    if any(isinstance(k, SharedKey) != shared for k in keys):
        raise BadRequest("these keys mix the shared namespace and a tenant's: derive one prompt's keys with one "
                         "keys(...) call")
    return shared


def as_key(value: object) -> ChunkKey:
    """Checks that ``value`` is a ChunkKey (the boundary check of every public API)."""
    if isinstance(value, ChunkKey):
        return value
    raise BadRequest(
        f"expected a ChunkKey, got {type(value).__name__}: derive keys with kvpool.keys.chunk_keys "
        "or parse them with ChunkKey.from_hex"
    )


def as_keys(keys: object) -> list[ChunkKey]:
    """A list of ChunkKeys from an iterable of them (the boundary check of every batched API)."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Iterable):
        raise BadRequest(
            f"expected a sequence of ChunkKeys, got {type(keys).__name__}: pass a list (one key: [key])"
        )
    return [as_key(k) for k in keys]


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the tokens that decides whether two chunks are the same KV."""

    tenant_salt: bytes
    spec_fingerprint: bytes
    adapter_id: str = ""
    extra_keys: tuple[str | bytes, ...] = ()
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_salt, bytes) or not isinstance(self.spec_fingerprint, bytes):
            raise BadRequest("a namespace's tenant salt and spec fingerprint are bytes: build it with "
                             "Namespace.for_spec(spec, tenant.salt)")
        if not isinstance(self.adapter_id, str):
            raise BadRequest(f"adapter_id must be a string ('' for none), got {type(self.adapter_id).__name__}")
        if not isinstance(self.extra_keys, tuple) or not all(isinstance(x, (str, bytes)) for x in self.extra_keys):
            raise BadRequest(
                f"extra_keys must be a sequence of str or bytes (e.g. multimodal hashes), got {self.extra_keys!r}"
            )

    @classmethod
    def for_spec(
        cls, spec: KVSpec, tenant_salt: bytes, adapter_id: str = "", extra_keys: Sequence[str | bytes] = ()
    ) -> "Namespace":
        return cls(tenant_salt, spec.fingerprint(), adapter_id, tuple(extra_keys))

    def root(self) -> ChunkKey:
        """``k_0``: the key the chain starts from."""
        packed = msgpack.packb(
            [self.format_version, self.tenant_salt, self.spec_fingerprint, self.adapter_id, list(self.extra_keys)]
        )
        return ChunkKey(xxhash.xxh3_128_digest(packed))


def tokens_le_int32(tokens: object) -> np.ndarray:
    """Tokens as a contiguous little-endian int32 array (zero-copy when they already are).

    Accepts a list of ints, a numpy array or a torch tensor of integer token ids in [0, 2**31).
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "numpy"):  # a torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError):  # ragged nesting and the like
        raise BadRequest("tokens must be a flat sequence of integer token ids (one request's prompt)") from None
    if arr.ndim != 1:
        raise BadRequest(f"tokens must be 1-D, got shape {arr.shape}: pass one request's token ids")
    if arr.size == 0:
        return np.empty(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise BadRequest(f"tokens must be integer ids, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<i4"):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _INT32_MAX:
            raise BadRequest(f"token ids must lie in [0, 2**31), got range [{lo}, {hi}]")
        arr = arr.astype("<i4")
    elif int(arr.min()) < 0:
        raise BadRequest(f"token ids must be non-negative, got {int(arr.min())}")
    return np.ascontiguousarray(arr)


def chunk_keys(
    tokens: object, namespace: Namespace, chunk_tokens: int, start: ChunkKey | None = None,
    kind: type[ChunkKey] = ChunkKey,
) -> list[ChunkKey]:
    """Keys of every full chunk of ``tokens``; a trailing partial chunk gets no key.

    ``start`` continues a chain: pass the last key of the tokens already hashed and only the
    tokens after them. ``kind`` is the keys' class (SharedKey for the shared namespace).
    """
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise BadRequest(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    arr = tokens_le_int32(tokens)
    n = arr.size // chunk_tokens
    step = chunk_tokens * 4
    data = arr[: n * chunk_tokens].tobytes()  # one copy; bytes slices then beat memoryview slices
    prev = bytes(as_key(start)) if start is not None else bytes(namespace.root())
    digest = xxhash.xxh3_128_digest
    make = bytes.__new__  # NOTE: skips ChunkKey's length check; a 128-bit digest is 16 bytes
    keys: list[ChunkKey] = []
    append = keys.append
    for a in range(0, n * step, step):
        prev = digest(prev + data[a : a + step])
        append(make(kind, prev))
    return keys
