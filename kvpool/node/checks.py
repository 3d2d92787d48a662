"""What a NodeClient checks before a write, and which refusals are the caller's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.errors import BadRequest
from kvpool.keys import KEY_BYTES

# What reaches the caller: its own bad input, a refused credential, its tenant's 429 (a reservation
# that expired between reserve and commit, 410, is a failed write, not the caller's)
RAISED = (400, 401, 403, 404, 413, 429)


def check_put(keys: Sequence[object], arrays: Sequence[np.ndarray], shared: object) -> list[bytes]:
    if not isinstance(shared, bool):
        raise BadRequest(f"shared must be True or False, got {shared!r}")
    if len(keys) != len(arrays):
        raise BadRequest(f"{len(keys)} keys but {len(arrays)} payloads: one payload per key")
    raw = []
    for k in keys:
        if not isinstance(k, (bytes, bytearray, memoryview)) or len(bytes(k)) != KEY_BYTES:
            raise BadRequest(f"a chunk key is {KEY_BYTES} bytes: use ChunkKey")
        raw.append(bytes(k))
    return raw
