"""One codec for chunks: a KV tensor of a spec to the bytes a pool stores, and back.

Both pools (in-process and the Ray cluster) check and encode chunks here, and decode what a store
returns here: a payload of another size than the spec's stored chunk is not a chunk of this spec
(it was written through the bare store, or under another layout), so it decodes to ``None``, a
miss, never a half-filled tensor.

Storage formats (``KVSpec.storage_format``): ``"raw"`` stores the chunk's own bytes. Every other
format is LOSSY and OPT-IN: the chunk is quantized on save (``kvpool.kernels.quant``: Triton on a
GPU, the PyTorch reference on a CPU) and dequantized on load, so a load returns a chunk close to,
not equal to, the one saved (``docs/formats.md`` measures how close and how small). The format is
part of the spec's fingerprint, hence of every key: a reader of another format never sees these
bytes. A quantized payload that does not decode (corrupt, another format or layout) is a miss.

A tenant may set a format of its own (``Tenant.storage_format``), which overrides the connector's
for its chunks: :class:`Formats` gives both pools the codec and the key maker of each format.

The pool's parameters of each format (:data:`POOL_PARAMS`): fp8 and int8 scale each token's head
vector (``token_head``); the KIVI formats quantize every token of the chunk (``residual=0``: a
stored chunk is whole, and the engine's unchunked tail is never stored, so KIVI's full-precision
window of recent tokens has nothing to protect here), keys per channel over groups of
``group`` tokens, values per token over groups of ``min(group, head_dim)`` channels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvpool.errors import BadRequest, LayoutMismatch
from kvpool.keying import KeyMaker
from kvpool.spec import KVSpec

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


# The pool's parameters of each lossy format (see the module docstring): KIVI groups chosen on
# SmolLM2's KV (docs/formats.md): int4 with groups of 64 tokens costs 17% fewer bytes than 32 for
# a KL of 0.004-0.007 instead of 0.003-0.004; int2 keeps 32, as groups of 64 raise its KL from
# 0.14-0.18 to 0.20-0.29.
POOL_PARAMS: dict[str, dict[str, object]] = {
    "fp8": {"granularity": "token_head"},
    "int8": {"granularity": "token_head"},
    "int4-kivi": {"group": 64, "residual": 0},
    "int2-kivi": {"group": 32, "residual": 0},
}
_CODES_PER_BYTE = {"int4-kivi": 2, "int2-kivi": 4}


def torch_dtype(spec: KVSpec) -> torch.dtype:
    return _TORCH_DTYPES[spec.dtype]


def pool_params(spec: KVSpec) -> dict[str, object]:
    """The quantization parameters of ``spec``'s chunks: :data:`POOL_PARAMS`, with a KIVI group
    halved until it fits the chunk (a group longer than the chunk would leave every token
    unquantized) and its value group (``min(group, head_dim)``) divides ``head_dim``."""
    fmt = spec.storage_format
    params = dict(POOL_PARAMS[fmt])
    if fmt in _CODES_PER_BYTE:
        group, d, pb = int(params["group"]), spec.head_dim, _CODES_PER_BYTE[fmt]
        while group > pb and (group > spec.chunk_tokens or d % min(group, d) or min(group, d) % pb):
            group //= 2
        if d % min(group, d) or min(group, d) % pb:
            raise BadRequest(f"{fmt} packs {pb} codes per byte along head_dim, which is {d}: store this model "
                             "'raw', 'fp8' or 'int8'")
        params["group"] = group
    return params


def stored_nbytes(spec: KVSpec) -> int:
    """Bytes one chunk of ``spec`` takes in the pool: the raw chunk's, or its quantized payload's."""
    if spec.storage_format == "raw":
        return spec.chunk_nbytes
    from kvpool.kernels.quant import payload_nbytes  # NOTE: lazily: a raw pool never loads the kernels

    return payload_nbytes(spec.storage_format, spec.chunk_shape, torch_dtype(spec), **pool_params(spec))


def page_bytes(spec: KVSpec, formats: Sequence[str] = ()) -> int:
    """Bytes a pool page needs for a chunk of ``spec`` in its format and in each of ``formats``
    (tenants' own; ``""`` is the spec's)."""
    return max(stored_nbytes(spec if not f else dataclasses.replace(spec, storage_format=f))
               for f in ("", *formats))


class ChunkCodec:
    """Checks, encodes and decodes the chunks of one spec: ``nbytes`` is what one chunk takes in
    the pool (``raw_nbytes`` before quantization; the same for ``raw``)."""

    __slots__ = ("spec", "dtype", "shape", "nbytes", "raw_nbytes", "lossy", "params")

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self.dtype = torch_dtype(spec)
        self.shape = spec.chunk_shape
        self.raw_nbytes = spec.chunk_nbytes
        self.lossy = spec.storage_format != "raw"
        self.params = pool_params(spec) if self.lossy else {}
        self.nbytes = stored_nbytes(spec)

    @property
    def bytes_ratio(self) -> float:
        """Stored bytes of a chunk over its raw bytes (1.0 for ``raw``)."""
        return self.nbytes / self.raw_nbytes

    def check_page(self, page_bytes: int, fix: str) -> None:
        """Raises LayoutMismatch when a stored chunk of this spec does not fit a pool page of
        ``page_bytes`` (``fix`` says how to start the pool instead)."""
        if self.nbytes > page_bytes:
            fmt = "" if not self.lossy else f" in {self.spec.storage_format}"
            raise LayoutMismatch(f"a chunk of {self.spec.model_id}{fmt} takes {self.nbytes} B but the pool's pages "
                                 f"hold {page_bytes} B: {fix}")

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
        """The chunk's stored bytes, a flat uint8 array of ``nbytes``: for ``raw`` the chunk's own
        (no copy when the tensor is contiguous on the CPU), else its quantized payload (LOSSY;
        quantized where the tensor is: Triton on a GPU, the reference on a CPU)."""
        self.check(kv)
        if not self.lossy:
            return kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        from kvpool.kernels.quant import quantize

        fmt = self.spec.storage_format
        data = np.frombuffer(quantize(kv.detach(), fmt, impl="auto", **self.params).to_bytes(), dtype=np.uint8)
        if data.shape[0] != self.nbytes:  # payload_nbytes and to_bytes disagree: a bug, not bad input
            raise RuntimeError(f"{fmt} payload of {data.shape[0]} B, expected {self.nbytes} B")
        return data

    def decode(self, data: object, device: str | torch.device = "cpu") -> torch.Tensor | None:
        """A chunk from ``data``'s bytes, or None when they are not one chunk of this spec. The
        caller owns it: for ``raw`` the tensor is over ``data`` (read-only bytes, as Ray's shared
        object store gives, are copied); a lossy format dequantizes into a new tensor on
        ``device`` (there with Triton when it is a GPU), and a payload that does not decode is a
        miss (None), never an exception."""
        arr = np.asarray(data)
        if arr.dtype != np.uint8 or arr.ndim != 1 or arr.shape[0] != self.nbytes:
            return None
        if self.lossy:
            return self._dequantize(arr, device)
        if not arr.flags.writeable:
            arr = arr.copy()
        return torch.from_numpy(arr).view(self.dtype).view(self.shape)

    def _dequantize(self, arr: np.ndarray, device: str | torch.device) -> torch.Tensor | None:
        from kvpool.kernels.quant import QuantizedKV, dequantize

        try:
            q = QuantizedKV.from_bytes(memoryview(arr), device=device)
            if (q.fmt, q.shape, q.dtype) != (self.spec.storage_format, self.shape, self.dtype):
                return None
            kv = dequantize(q, impl="auto")
        except Exception:  # NOTE: any failure on the read path is a miss; the engine recomputes
            return None
        return kv if bool(torch.isfinite(kv).all()) else None

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)

    def payload_buffer(self) -> np.ndarray:
        """A buffer for one stored chunk's bytes (``nbytes``)."""
        return np.empty(self.nbytes, dtype=np.uint8)


class Formats:
    """The codec and the key maker of each storage format one pool serves: its spec's (the
    connector's choice, ``""`` below) and any a tenant sets for itself (``Tenant.storage_format``),
    each made once, on first use. Shared keys are always in the spec's format. ``keyed_as``: the
    spec whose keys the makers make where it is not the chunks' own (a slice of a chunk is keyed by
    the whole chunk's spec: kvpool.slices)."""

    __slots__ = ("spec", "keyed_as", "_salt_of", "_codecs", "_makers")

    def __init__(self, spec: KVSpec, salt_of: Callable[[str], bytes], keyed_as: KVSpec | None = None) -> None:
        self.spec = spec
        self.keyed_as = keyed_as or spec
        self._salt_of = salt_of
        self._codecs: dict[str, ChunkCodec] = {}
        self._makers: dict[str, KeyMaker] = {}

    def spec_of(self, fmt: str, spec: KVSpec | None = None) -> KVSpec:
        """The spec (default: the chunks') in format ``fmt`` (``""``: the spec's own)."""
        spec = spec or self.spec
        if not fmt or fmt == spec.storage_format:
            return spec
        return dataclasses.replace(spec, storage_format=fmt)  # checked again: a float8 cache stays raw

    def codec(self, fmt: str = "") -> ChunkCodec:
        codec = self._codecs.get(fmt)
        if codec is None:
            codec = self._codecs[fmt] = ChunkCodec(self.spec_of(fmt))
        return codec

    def maker(self, fmt: str = "") -> KeyMaker:
        maker = self._makers.get(fmt)
        if maker is None:
            maker = self._makers[fmt] = KeyMaker(self.spec_of(fmt, self.keyed_as), self._salt_of)
        return maker

