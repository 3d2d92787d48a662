"""Turning what callers hand us (torch tensors, numpy arrays, bytes) into flat uint8 arrays."""

from __future__ import annotations

import numpy as np

from kvpool.errors import BadRequest


def as_byte_array(payload: object, *, writable: bool = False) -> np.ndarray:
    """A zero-copy flat uint8 view of a contiguous CPU buffer, or a BadRequest naming the fix."""
    if hasattr(payload, "untyped_storage"):  # a torch tensor; checked without importing torch
        if payload.device.type != "cpu":
            raise BadRequest(f"payload is on {payload.device}; copy it to the CPU first (.cpu())")
        if not payload.is_contiguous():
            raise BadRequest("payload tensor is not contiguous: call .contiguous() on it first")
        import torch

        arr = payload.detach().reshape(-1).view(torch.uint8).numpy()
    elif isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise BadRequest("payload array is not C-contiguous: use np.ascontiguousarray first")
        if payload.dtype.hasobject:
            raise BadRequest(f"payload array holds Python objects (dtype {payload.dtype}): pass numeric data")
        arr = payload.reshape(-1).view(np.uint8)
    elif isinstance(payload, (bytes, bytearray, memoryview)):
        try:
            arr = np.frombuffer(payload, dtype=np.uint8)
        except (BufferError, ValueError):
            raise BadRequest("payload memoryview is not C-contiguous: copy it (bytes(view)) first") from None
    else:
        raise BadRequest(
            f"payload must be a torch tensor, numpy array or bytes-like object, got {type(payload).__name__}"
        )
    if writable and not arr.flags.writeable:
        raise BadRequest("output buffer is read-only: pass a writable tensor or array")
    return arr
