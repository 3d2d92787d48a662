"""Payloads sealed at rest (opt-in per tenant: ``Tenant(encrypt=True)``).

The client seals a chunk before it leaves the engine and opens it after it comes back: AES-256-GCM
with a key only the tenant's credential gives (:func:`kvpool.auth.payload_key`), a random 96-bit
nonce per chunk and the chunk's key as associated data. The pool (shards, slabs, Ray's object
store, disk tiers) holds only ciphertext. A process that reads a shared-memory slab learns nothing.
A sealed chunk moved to another key, or changed by anyone, fails to open, and that is a miss.

A sealed payload is ``nonce (12 B) || ciphertext || tag (16 B)``: a page holds
:data:`SEAL_OVERHEAD` bytes more than the chunk. The cost, measured by ``kvpool bench auth``
(docs/benchmarks.md), is one pass of AES-GCM over the bytes on each save and load.
"""

from __future__ import annotations

import os

import numpy as np

from kvpool.errors import BadRequest

NONCE = 12
TAG = 16
SEAL_OVERHEAD = NONCE + TAG


def _aesgcm():
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:  # pragma: no cover - cryptography comes with the dev extras and with ray[default]
        raise BadRequest("encrypting a tenant's payloads needs the 'cryptography' package: pip install "
                         "'kvpool[dev]' (or cryptography>=42)") from None
    return AESGCM


def needs_seal(tenant, keys_shared: bool) -> bool:
    """Whether a tenant's chunks are sealed: its own when it asks for it; shared ones never (every
    tenant reads them)."""
    return bool(getattr(tenant, "encrypt", False)) and not keys_shared


def sealer_for(credential: str, secured: bool, cache: dict) -> "Sealer":
    """The tenant's sealer (from its credential; cached in ``cache``); a BadRequest on an open pool,
    where no secret keeps the key from anyone."""
    s = cache.get(credential)
    if s is None:
        if not secured:
            raise BadRequest("a tenant with encrypt=True needs a secured pool (a pool secret): on an open pool "
                             "anyone could derive its key")
        from kvpool.auth import payload_key

        s = cache[credential] = Sealer(payload_key(credential))
    return s


class Sealer:
    """Seals and opens one tenant's payloads with its 32-byte key."""

    __slots__ = ("_aead", "_invalid")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != 32:
            raise BadRequest("a payload key is 32 bytes (kvpool.auth.payload_key)")
        self._aead = _aesgcm()(key)
        from cryptography.exceptions import InvalidTag

        self._invalid = InvalidTag

    def seal(self, chunk_key: bytes, payload: np.ndarray) -> np.ndarray:
        """``nonce || AES-GCM(payload) || tag``, bound to ``chunk_key``."""
        out = np.empty(payload.shape[0] + SEAL_OVERHEAD, dtype=np.uint8)
        nonce = os.urandom(NONCE)
        out[:NONCE] = np.frombuffer(nonce, dtype=np.uint8)
        self._aead.encrypt_into(nonce, payload, bytes(chunk_key), out[NONCE:])
        return out

    def open(self, chunk_key: bytes, sealed: object, out: np.ndarray | None = None) -> np.ndarray | None:
        """The payload, or None when ``sealed`` is not this tenant's seal of ``chunk_key`` (moved,
        changed, truncated, or not sealed at all): a miss."""
        arr = np.asarray(sealed)
        if arr.dtype != np.uint8 or arr.ndim != 1 or arr.shape[0] <= SEAL_OVERHEAD:
            return None
        n = arr.shape[0] - SEAL_OVERHEAD
        if out is None:
            out = np.empty(n, dtype=np.uint8)
        elif out.shape[0] != n:
            return None
        try:
            self._aead.decrypt_into(arr[:NONCE].tobytes(), arr[NONCE:], bytes(chunk_key), out)
        except self._invalid:
            return None
        return out
