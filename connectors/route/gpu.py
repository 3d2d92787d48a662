"""What a vLLM instance's own prefix cache holds, per tenant, from its KV events.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` for its own cache
(``--kv-events-config``, :mod:`kvpool.connectors.route.events` subscribes). A stored block names
its parent block's hash, its tokens and, for a prompt's first block, the request's ``cache_salt``
(vLLM salts its own hashes with it, so tenants never share a block). vLLM's hashes are seeded per
process and cannot be recomputed here, so each block is given an id of our own instead: a chain
over the block's tokens, rooted in the tenant its salt names (:meth:`Tenancy.of_secret`; no salt:
the engine's default tenant; anyone else's salt: nobody's, never counted). A request's leading
blocks are then looked up by the same chain over its tokens under its own tenant, so a decision
never depends on another tenant's blocks, even for the same tokens.

Blocks we cannot model are left out (a miss, never a false hit): LoRA and multimodal blocks
(their extra keys), a CPU-offload medium, KV cache groups but the first, and a block whose parent
we never saw (the router started, or events were lost, after it). A gap in the event sequence
clears the view: it is rebuilt from the events that follow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xxhash

ROOT = b"kvpool/route/gpu/v1\0"


def _root(tenant: str) -> int:
    return xxhash.xxh3_64_intdigest(ROOT + tenant.encode())


def _link(parent: int, tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + np.asarray(tokens, dtype="<i4").tobytes())


class GpuView:
    """One instance's cached blocks as chain ids; ``tenant_of(salt)`` names the tenant of a salt
    (None or "" for none), or None for a salt that is nobody's."""

    def __init__(self, tenant_of: Callable[[str | None], str | None]) -> None:
        self._tenant_of = tenant_of
        self.block_size: int | None = None
        self._ids: dict[object, int] = {}  # vLLM's block hash -> our chain id
        self._held: dict[int, int] = {}  # chain id -> how many of vLLM's blocks have it
        self.skipped = 0  # blocks left out (see the module docstring)

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._ids.clear()
        self._held.clear()

    def apply(self, event: dict) -> None:
        """One event, as vLLM's publisher encodes it (a map with its ``type``)."""
        kind = event.get("type")
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            if event.get("group_idx") not in (None, 0):
                return
            for h in event.get("block_hashes") or ():
                cid = self._ids.pop(h, None)
                if cid is not None:
                    left = self._held[cid] - 1
                    if left:
                        self._held[cid] = left
                    else:
                        del self._held[cid]
        elif kind == "AllBlocksCleared":
            self.clear()

    def _stored(self, e: dict) -> None:
        hashes, tokens, size = e.get("block_hashes") or [], e.get("token_ids") or [], e.get("block_size")
        extra = e.get("extra_keys") or [None] * len(hashes)
        if (e.get("group_idx") not in (None, 0) or e.get("medium") not in (None, "GPU") or e.get("lora_name")
                or e.get("lora_id") or not isinstance(size, int) or size <= 0 or len(tokens) != size * len(hashes)
                or len(extra) != len(hashes)):
            self.skipped += len(hashes)
            return
        self.block_size = size
        parent = e.get("parent_block_hash")
        if parent is None:
            keys = extra[0] or ()
            if len(keys) > 1 or (keys and not isinstance(keys[0], str)):  # not a lone cache_salt: LoRA, images
                self.skipped += len(hashes)
                return
            tenant = self._tenant_of(keys[0] if keys else None)
            cid = None if tenant is None else _root(tenant)
        else:
            cid = self._ids.get(parent)
        for k, h in enumerate(hashes):
            if cid is None or (k and extra[k]):
                self.skipped += len(hashes) - k
                return
            cid = _link(cid, tokens[k * size: (k + 1) * size])
            if h not in self._ids:
                self._ids[h] = cid
                self._held[cid] = self._held.get(cid, 0) + 1

    def leading(self, chain: Sequence[int]) -> int:
        """How many leading blocks of a prompt's :func:`block_chain` this cache holds."""
        n = 0
        for cid in chain:
            if cid not in self._held:
                break
            n += 1
        return n


def block_chain(tenant: str, tokens: Sequence[int], size: int) -> list[int]:
    """The chain ids of a ``tenant``'s prompt's whole blocks of ``size`` tokens (computed once per
    request, looked up in every instance's view)."""
    out, cid = [], _root(tenant)
    arr = np.asarray(tokens, dtype="<i4")
    for lo in range(0, len(arr) - size + 1, size):
        cid = xxhash.xxh3_64_intdigest(cid.to_bytes(8, "little") + arr[lo: lo + size].tobytes())
        out.append(cid)
    return out
