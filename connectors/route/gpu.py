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

The events port is not authenticated (docs/security.md), so an event is checked field by field
before it changes anything (:func:`malformed`): a malformed one is refused whole, never half
applied, and never raises. A view holding more than ``max_blocks`` blocks (more than any real GPU
cache: a publisher that floods it) starts over, counted in ``overflows``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xxhash

ROOT = b"kvpool/route/gpu/v1\0"
MAX_BLOCKS = 1 << 22  # blocks one view follows: a GPU cache holds far fewer (100k blocks of 16 is 1.6M tokens)
_I32 = 1 << 31


def _hash_ok(h: object) -> bool:
    """vLLM's block hashes are bytes or ints (its ``ExternalBlockHash``)."""
    return isinstance(h, (bytes, int)) and not isinstance(h, bool)


def _hashes_ok(x: object) -> bool:
    return isinstance(x, list) and all(_hash_ok(h) for h in x)


def malformed(event: object) -> str | None:
    """Why an event cannot be one of vLLM's as :meth:`GpuView.apply` reads them, or None. An event
    of a kind it does not read is well-formed (ignored)."""
    if not isinstance(event, dict):
        return "an event that is not a map"
    kind = event.get("type")
    if kind == "BlockRemoved":
        return None if _hashes_ok(event.get("block_hashes")) else "BlockRemoved: block_hashes not a list of hashes"
    if kind != "BlockStored":
        return None
    hashes, tokens, size = event.get("block_hashes"), event.get("token_ids"), event.get("block_size")
    parent, extra = event.get("parent_block_hash"), event.get("extra_keys")
    if not _hashes_ok(hashes):
        return "BlockStored: block_hashes not a list of hashes"
    if parent is not None and not _hash_ok(parent):
        return "BlockStored: parent_block_hash not a hash"
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _I32
                                               for t in tokens):
        return "BlockStored: token_ids not a list of token ids"
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size < _I32 or len(tokens) != size * len(hashes):
        return "BlockStored: block_size not the tokens of each block"
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)
                              or not all(k is None or isinstance(k, list) for k in extra)):
        return "BlockStored: extra_keys not one list (or null) a block"
    return None


def _root(tenant: str) -> int:
    return xxhash.xxh3_64_intdigest(ROOT + tenant.encode())


def _link(parent: int, tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + np.asarray(tokens, dtype="<i4").tobytes())


class GpuView:
    """One instance's cached blocks as chain ids; ``tenant_of(salt)`` names the tenant of a salt
    (None or "" for none), or None for a salt that is nobody's."""

    def __init__(self, tenant_of: Callable[[str | None], str | None], max_blocks: int = MAX_BLOCKS) -> None:
        self._tenant_of, self.max_blocks = tenant_of, max_blocks
        self.block_size: int | None = None
        self._ids: dict[object, int] = {}  # vLLM's block hash -> our chain id
        self._held: dict[int, int] = {}  # chain id -> how many of vLLM's blocks have it
        self.skipped = 0  # blocks left out (see the module docstring)
        self.overflows = 0  # times it held more than max_blocks and started over

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._ids.clear()
        self._held.clear()

    def apply(self, event: object) -> bool:
        """One event, as vLLM's publisher encodes it (a map with its ``type``); False, and nothing
        changed, when it is malformed (:func:`malformed`)."""
        if malformed(event) is not None:
            return False
        self._apply(event)
        if len(self._ids) > self.max_blocks:
            self.overflows += 1
            self.clear()
        return True

    def _apply(self, event: dict) -> None:
        """A well-formed event."""
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
                or len(extra) != len(hashes) or not hashes):
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
