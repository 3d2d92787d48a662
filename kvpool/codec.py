"""One codec for chunks: a KV tensor of a spec to the bytes a pool stores, and back.

Both pools (in-process and the Ray cluster) check and encode chunks here, and decode what a store
returns here: a payload of another size than the spec's chunk is not a chunk of this spec (it was
written through the bare store, or under another layout), so it decodes to ``None``, a miss,
never a half-filled tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvpool.errors import BadRequest, LayoutMismatch
from kvpool.spec import KVSpec

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def torch_dtype(spec: KVSpec) -> torch.dtype:
    return _TORCH_DTYPES[spec.dtype]


class ChunkCodec:
    """Checks, encodes and decodes the raw chunks of one spec."""

    __slots__ = ("spec", "dtype", "shape", "nbytes")

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self.dtype = torch_dtype(spec)
        self.shape = spec.chunk_shape
        self.nbytes = spec.chunk_nbytes

    def check_page(self, page_bytes: int, fix: str) -> None:
        """Raises LayoutMismatch when a raw chunk of this spec does not fit a pool page of
        ``page_bytes`` (``fix`` says how to start the pool instead)."""
        if self.spec.storage_format == "raw" and self.nbytes > page_bytes:
            raise LayoutMismatch(f"a chunk of {self.spec.model_id} takes {self.nbytes} B but the pool's pages hold "
                                 f"{page_bytes} B: {fix}")

    def check(self, kv: object) -> None:
        """Raises LayoutMismatch unless ``kv`` is one whole raw chunk of this spec."""
        if not isinstance(kv, torch.Tensor):
            raise LayoutMismatch(f"a KV chunk must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != self.dtype:
            raise LayoutMismatch(f"KV chunk dtype {kv.dtype} does not match the spec's {self.dtype}: convert it first")
        if tuple(kv.shape) != self.shape:
            want = self.shape
            if kv.dim() == 5 == len(want) and kv.shape[2] < want[2] and tuple(kv.shape[:2]) + tuple(kv.shape[3:]) == (
                want[:2] + want[3:]
            ):
                raise LayoutMismatch(
                    f"partial chunk of {kv.shape[2]} tokens: only whole chunks of {want[2]} tokens are stored"
                )
            raise LayoutMismatch(f"KV chunk shape {tuple(kv.shape)} does not match the spec's chunk shape {want} "
                                 "([layers, 2, chunk_tokens, kv_heads, head_dim]; [layers, chunk_tokens, kv_heads, "
                                 "head_dim + v_head_dim] when V's width differs)")

    def encode_run(self, keys: list, chunks: object, start: object) -> list[np.ndarray]:
        """The bytes of the chunks of ``keys[start:]``, every argument and chunk checked before any
        is encoded (a pool's save writes nothing on bad input)."""
        if not isinstance(start, int) or isinstance(start, bool):
            raise BadRequest(f"start must be the int index of the first chunk's key, got {start!r}")
        if isinstance(chunks, torch.Tensor) or not isinstance(chunks, Sequence):
            raise LayoutMismatch(f"chunks must be a list of KV tensors, got {type(chunks).__name__}: wrap one in [chunk]")
        if start < 0 or start + len(chunks) > len(keys):
            raise LayoutMismatch(f"{len(chunks)} chunks from position {start} but only {len(keys)} keys: only whole "
                                 "chunks are keyed")
        for c in chunks:
            self.check(c)
        return [self.encode(c) for c in chunks]

    def encode(self, kv: torch.Tensor) -> np.ndarray:
        """The chunk's bytes (a flat uint8 array; no copy when the tensor is contiguous on the CPU)."""
        self.check(kv)
        return kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()

    def decode(self, data: object) -> torch.Tensor | None:
        """A chunk over ``data``'s bytes, or None when they are not one chunk of this spec. The
        caller owns it: read-only bytes (Ray's shared object store) are copied, others are not."""
        arr = np.asarray(data)
        if arr.dtype != np.uint8 or arr.ndim != 1 or arr.shape[0] != self.nbytes:
            return None
        if not arr.flags.writeable:
            arr = arr.copy()
        return torch.from_numpy(arr).view(self.dtype).view(self.shape)

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)
