"""KV-cache quantization: ``quantize`` / ``dequantize`` and the ``QuantizedKV`` container.

Quantization is LOSSY and OPT-IN: a chunk stored in any format but ``"raw"`` (a
``KVSpec.storage_format``) comes back close to, not equal to, what was put. Formats (the names of
``kvpool.spec.STORAGE_FORMATS`` other than ``"raw"``):

- ``"fp8"``: e4m3fn codes (uint8 bit patterns), symmetric scale = amax / 448;
- ``"int8"``: int8 codes in [-127, 127], symmetric scale = amax / 127;
  both with ``granularity="token_head"`` (default; one scale per token and head) or ``"layer"``
  (one scale per layer for K and one for V) -- see ``kvpool.kernels.quant_fp8``;
- ``"int4-kivi"`` / ``"int2-kivi"``: KIVI asymmetric codes, keys per channel over groups of
  ``group`` tokens, values per token over groups of ``min(group, head_dim)`` channels, packed
  2 / 4 per byte, the last ``residual`` (+ partial group) tokens kept in full precision
  (defaults ``group=32, residual=32``) -- see ``kvpool.kernels.quant_kivi``.

Input: a float32 / float16 / bfloat16 tensor ``[..., 2, tokens, kv_heads, head_dim]`` (the pool's
chunk ``[layers, 2, chunk_tokens, kv_heads, head_dim]`` is the usual case); the leading dims are
flattened into one "layer" axis for scales and restored on the way out. ``dequantize`` returns
the original shape and dtype. Each format has a Triton kernel and a PyTorch reference (``impl``).

A ``QuantizedKV`` serializes to one payload (``to_bytes``/``from_bytes``): a small msgpack header
(format, shape, dtype, parameters, the layout of each tensor) followed by the tensors' raw bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import msgpack
import torch

from kvpool.errors import BadRequest
from kvpool.kernels import quant_fp8, quant_kivi
from kvpool.kernels._backend import resolve_impl
from kvpool.spec import STORAGE_FORMATS

FORMATS = ("fp8", "int8", "int4-kivi", "int2-kivi")
assert FORMATS == tuple(f for f in STORAGE_FORMATS if f != "raw"), "quant formats drifted from STORAGE_FORMATS"

KIVI_BITS = {"int4-kivi": 4, "int2-kivi": 2}
DEFAULT_PARAMS: dict[str, dict[str, object]] = {
    "fp8": {"granularity": "token_head"},
    "int8": {"granularity": "token_head"},
    "int4-kivi": {"group": 32, "residual": 32},
    "int2-kivi": {"group": 32, "residual": 32},
}
INPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STORED_DTYPES = {**INPUT_DTYPES, "uint8": torch.uint8, "int8": torch.int8}
_DTYPE_NAMES = {v: k for k, v in _STORED_DTYPES.items()}
# Stored tensors, in payload order; a format leaves out those it does not use.
TENSOR_NAMES = ("codes", "scales", "mins", "value_scales", "value_mins", "residual")

_MAGIC = b"KVQ1"
_PREFIX = struct.Struct("<4sI")  # magic, header length


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """A quantized KV tensor: everything ``dequantize`` needs, and nothing else.

    ``L`` below is the product of the leading dims of ``shape`` (``shape[:-4]``), ``T, H, D`` its
    tokens, heads and head_dim, ``Tq`` the KIVI quantized tokens and ``PB`` codes per byte.

    ============= ========================= ============================================
    field         fp8 / int8                int4-kivi / int2-kivi
    ============= ========================= ============================================
    codes         ``[L,2,T,H,D]`` uint8/int8 ``[L,2,Tq,H,D/PB]`` uint8, packed
    scales        ``[L,2,T,H]`` or ``[L,2]`` key scales ``[L,Tq/G,H,D]`` float32
    mins          None                      key mins, as scales
    value_scales  None                      ``[L,Tq,H,D/GV]`` float32
    value_mins    None                      as value_scales
    residual      None                      ``[L,2,T-Tq,H,D]`` in ``dtype``
    ============= ========================= ============================================
    """

    fmt: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    params: tuple[tuple[str, object], ...]  # sorted (name, value) pairs, defaults filled in
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    value_mins: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    @property
    def options(self) -> dict[str, object]:
        return dict(self.params)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, in payload order."""
        return {n: getattr(self, n) for n in TENSOR_NAMES if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (``len(to_bytes())`` adds a header of ~100-200 bytes)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def input_nbytes(self) -> int:
        """Bytes of the tensor this was quantized from."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def to_bytes(self) -> bytes:
        """One payload: magic, header length, msgpack header, then each tensor's raw bytes."""
        tensors = self.tensors()
        header = _header(self.fmt, self.shape, self.dtype, self.params,
                         [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
        parts = [_PREFIX.pack(_MAGIC, len(header)), header]
        for t in tensors.values():
            parts.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, device: str | torch.device = "cpu") -> QuantizedKV:
        """Inverse of :meth:`to_bytes`; a payload that is not one (or is cut short) is a BadRequest."""
        data = memoryview(data).cast("B")
        if len(data) < _PREFIX.size:
            raise BadRequest("not a QuantizedKV payload: shorter than its prefix")
        magic, hlen = _PREFIX.unpack_from(data)
        if magic != _MAGIC:
            raise BadRequest(f"not a QuantizedKV payload: magic {bytes(magic)!r}, expected {_MAGIC!r}")
        try:
            h = msgpack.unpackb(bytes(data[_PREFIX.size:_PREFIX.size + hlen]))
            fmt, shape, dtype_name = h["fmt"], tuple(h["shape"]), h["dtype"]
            params, listed = dict(h["params"]), [(n, d, tuple(s)) for n, d, s in h["tensors"]]
        except Exception as e:
            raise BadRequest(f"QuantizedKV payload has a corrupt header ({e})") from None
        if dtype_name not in INPUT_DTYPES:
            raise BadRequest(f"QuantizedKV payload has dtype {dtype_name!r}, not one of {tuple(INPUT_DTYPES)}")
        dtype = INPUT_DTYPES[dtype_name]
        _check_shape(shape)
        params = _canonical_params(fmt, params, shape)
        expected = [(n, _DTYPE_NAMES[d], s) for n, (d, s) in layout(fmt, shape, dtype, params).items()]
        if listed != expected:
            raise BadRequest(f"QuantizedKV payload lists tensors {listed}, its format implies {expected}")
        offset = _PREFIX.size + hlen
        tensors = {}
        for name, dname, tshape in listed:
            tdtype = _STORED_DTYPES[dname]
            size = math.prod(tshape) * torch.empty((), dtype=tdtype).element_size()
            if offset + size > len(data):
                raise BadRequest(f"QuantizedKV payload is cut short: {len(data)} bytes, {name} ends at {offset + size}")
            # NOTE: one copy out of the payload (frombuffer then shares the bytearray's memory).
            raw = torch.frombuffer(bytearray(data[offset:offset + size]), dtype=torch.uint8) if size else \
                torch.empty(0, dtype=torch.uint8)
            tensors[name] = raw.view(tdtype).reshape(tshape).to(device)
            offset += size
        if offset != len(data):
            raise BadRequest(f"QuantizedKV payload has {len(data) - offset} trailing bytes")
        return cls(fmt, shape, dtype, tuple(sorted(params.items())), **tensors)


def _header(fmt: str, shape: tuple[int, ...], dtype: torch.dtype, params: tuple[tuple[str, object], ...],
            tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    return msgpack.packb({
        "fmt": fmt,
        "shape": list(shape),
        "dtype": _DTYPE_NAMES[dtype],
        "params": [list(p) for p in params],
        "tensors": [[n, _DTYPE_NAMES[d], list(s)] for n, d, s in tensors],
    })


def payload_nbytes(fmt: str, shape: tuple[int, ...], dtype: torch.dtype, **params) -> int:
    """``len(quantize(x, fmt, **params).to_bytes())`` for any ``x`` of ``shape`` and ``dtype``,
    without quantizing anything: a pool sizes its pages with it."""
    _check_shape(tuple(shape))
    p = _canonical_params(fmt, params, tuple(shape))
    tensors = [(n, d, s) for n, (d, s) in layout(fmt, tuple(shape), dtype, p).items()]
    header = _header(fmt, tuple(shape), dtype, tuple(sorted(p.items())), tensors)
    body = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, d, s in tensors)
    return _PREFIX.size + len(header) + body


def layout(fmt: str, shape: tuple[int, ...], dtype: torch.dtype,
           params: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of every tensor a ``QuantizedKV`` of this format stores."""
    lead, (T, H, D) = shape[:-4], shape[-3:]
    L = math.prod(lead)
    if fmt in KIVI_BITS:
        flat = quant_kivi.kivi_shapes(L, T, H, D, KIVI_BITS[fmt], params["group"], params["residual"])
        return {n: (dtype if n == "residual" else torch.uint8 if n == "codes" else torch.float32, lead + s[1:])
                for n, s in flat.items()}
    scale = quant_fp8.scale_shape(L, T, H, params["granularity"])
    return {"codes": (quant_fp8.code_dtype(fmt), tuple(shape)), "scales": (torch.float32, lead + scale[1:])}


def _check_shape(shape: tuple[int, ...]) -> None:
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise BadRequest(f"KV shape {tuple(shape)} must be a tuple of ints")
    if len(shape) < 4 or shape[-4] != 2:
        raise BadRequest(
            f"KV tensor of shape {tuple(shape)} is not [..., 2, tokens, kv_heads, head_dim] (K then V); "
            "a pool chunk is [layers, 2, chunk_tokens, kv_heads, head_dim]"
        )
    if any(d <= 0 for d in shape):
        raise BadRequest(f"KV tensor of shape {tuple(shape)} is empty; quantize a tensor with every dim > 0")


def _int_param(fmt: str, name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise BadRequest(f"{fmt} {name} must be an int >= {low}, got {value!r}")
    return value


def _canonical_params(fmt: str, params: dict, shape: tuple[int, ...]) -> dict[str, object]:
    """``params`` with defaults filled in, checked against ``fmt`` and ``shape``."""
    if fmt not in FORMATS:
        raise BadRequest(f"unknown quantization format {fmt!r}: choose one of {FORMATS} ('raw' means no quantization)")
    allowed = DEFAULT_PARAMS[fmt]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise BadRequest(f"{fmt} takes parameters {sorted(allowed)}, not {unknown}")
    p = {**allowed, **params}
    if fmt in KIVI_BITS:
        group = _int_param(fmt, "group", p["group"], 1)
        _int_param(fmt, "residual", p["residual"], 0)
        pb = quant_kivi.codes_per_byte(KIVI_BITS[fmt])
        D = shape[-1]
        gv = quant_kivi.value_group(group, D)
        if D % gv or gv % pb:
            raise BadRequest(
                f"{fmt} groups values by min(group, head_dim) = {gv} channels, which must divide head_dim "
                f"({D}) and be a multiple of {pb} (codes per byte); pick a group such as 32 or 16"
            )
    elif p["granularity"] not in quant_fp8.GRANULARITIES:
        raise BadRequest(f"{fmt} granularity {p['granularity']!r} is not one of {quant_fp8.GRANULARITIES}")
    return p


def quantize(x: torch.Tensor, fmt: str, *, impl: str = "auto", **params) -> QuantizedKV:
    """Quantize KV tensor ``x`` ``[..., 2, tokens, kv_heads, head_dim]`` into format ``fmt``.

    ``params``: ``granularity`` ("token_head" | "layer") for fp8/int8; ``group`` and
    ``residual`` (ints, default 32 each) for the KIVI formats. Lossy: see the module docstring.
    """
    if fmt not in FORMATS:
        raise BadRequest(f"unknown quantization format {fmt!r}: choose one of {FORMATS} ('raw' means no quantization)")
    if not isinstance(x, torch.Tensor):
        raise BadRequest(f"quantize takes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES.values():
        raise BadRequest(f"quantize takes float32, float16 or bfloat16 KV, got {x.dtype}; convert it first")
    shape = tuple(x.shape)
    _check_shape(shape)
    p = _canonical_params(fmt, params, shape)
    which = resolve_impl(impl, x)
    # NOTE: one extra pass (and a device sync) to refuse NaN/inf, which would silently poison a
    # whole scale group rather than one value.
    if not bool(torch.isfinite(x).all()):
        raise BadRequest("KV tensor holds NaN or inf values; quantization needs finite inputs")
    lead, (T, H, D) = shape[:-4], shape[-3:]
    x5 = x.contiguous().view(math.prod(lead), 2, T, H, D)
    if fmt in KIVI_BITS:
        fn = quant_kivi.kivi_quantize_triton if which == "triton" else quant_kivi.kivi_quantize_ref
        flat = fn(x5, KIVI_BITS[fmt], p["group"], p["residual"])
    else:
        fn = quant_fp8.sym_quantize_triton if which == "triton" else quant_fp8.sym_quantize_ref
        codes, scales = fn(x5, fmt, p["granularity"])
        flat = {"codes": codes, "scales": scales}
    tensors = {n: t.reshape(lead + t.shape[1:]) for n, t in flat.items()}
    return QuantizedKV(fmt, shape, x.dtype, tuple(sorted(p.items())), **tensors)


def dequantize(q: QuantizedKV, *, impl: str = "auto") -> torch.Tensor:
    """The tensor ``q`` was quantized from, approximately: its shape and dtype, on ``q``'s device."""
    if not isinstance(q, QuantizedKV):
        raise BadRequest(f"dequantize takes a QuantizedKV, got {type(q).__name__}")
    want = {n: (d, tuple(s)) for n, (d, s) in layout(q.fmt, q.shape, q.dtype, q.options).items()}
    have = {n: (t.dtype, tuple(t.shape)) for n, t in q.tensors().items()}
    if have != want:  # a hand-built container: refuse it before a kernel reads out of bounds
        raise BadRequest(f"QuantizedKV holds tensors {have}, its format implies {want}")
    which = resolve_impl(impl, *q.tensors().values())
    nlead = len(q.shape) - 4
    L = math.prod(q.shape[:nlead])
    flat = {n: t.contiguous().reshape((L,) + t.shape[nlead:]) for n, t in q.tensors().items()}
    p = q.options
    if q.fmt in KIVI_BITS:
        fn = quant_kivi.kivi_dequantize_triton if which == "triton" else quant_kivi.kivi_dequantize_ref
        out = fn(flat, KIVI_BITS[q.fmt], p["group"], q.dtype)
    else:
        fn = quant_fp8.sym_dequantize_triton if which == "triton" else quant_fp8.sym_dequantize_ref
        out = fn(flat["codes"], flat["scales"], q.fmt, q.dtype)
    return out.reshape(q.shape)


def compression_ratio(q: QuantizedKV) -> float:
    """Input bytes over stored bytes (header excluded)."""
    return q.input_nbytes / q.nbytes


__all__ = ["FORMATS", "QuantizedKV", "compression_ratio", "dequantize", "layout", "payload_nbytes", "quantize"]
