"""Tensors viewed as the integer type of their width, for the paged copies and scrubs.

NOTE: the copies move bits, not numbers: both paths view every tensor as the integer type of
the same width (fp16/bf16 as int16, fp8 as uint8, ...). No cast can round, fp8 caches need no
``index_put`` support, and the interpreter never touches a bf16/fp8 value (its fp8/bf16 casts
are wrong, triton issue 8322); one compiled kernel serves every dtype of a width.
"""

from __future__ import annotations

import torch

from kvpool.errors import BadRequest

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer type of its width (same memory, same strides)."""
    if t.element_size() not in _BITS:
        raise BadRequest(f"dtype {t.dtype} ({t.element_size()} bytes) is not supported; use 1-, 2-, 4- or "
                         "8-byte elements")
    return t.view(_BITS[t.element_size()])
