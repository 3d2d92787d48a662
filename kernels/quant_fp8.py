"""Symmetric KV quantization: FP8 e4m3 and INT8, each a Triton kernel beside its PyTorch reference.

Works on a KV tensor viewed as ``[S, 2, T, H, D]`` (``S`` = the flattened leading dims, e.g.
layers; ``2`` = K then V): rows are the ``S*2*T*H`` token-head vectors of ``D`` channels.

Scales (float32):
- ``granularity="token_head"``: one per row, shape ``[S, 2, T, H]``;
- ``granularity="layer"``: one per ``[T, H, D]`` slab of K or of V, shape ``[S, 2]``.

``scale = amax / QMAX`` (QMAX = 448 for e4m3, 127 for int8); a scale that comes out 0 (all-zero
input, or an amax so small the division underflows) is replaced by 1 so nothing divides by 0.

Codes:
- fp8: ``(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` stored as its uint8 bit pattern
  (round to nearest even, subnormals, signed zeros, saturation at +-448; never the NaN code 0x7F).
- int8: ``torch.round(x / scale).clamp(-127, 127)`` (round half to even, as torch.round), int8.

Dequantize: ``decode(code) * scale`` in float32, then cast to the caller's dtype.

NOTE: the Triton kernels build the e4m3 bit pattern with integer and fp32 arithmetic rather than
a ``tl`` cast to fp8: Triton's interpreter casts fp8 wrongly (triton issue 8322), and the integer
path is bit-exact against torch everywhere (interpreter and GPU), so CPU tests cover it. Divisions
use ``tl.math.div_rn`` (IEEE round-to-nearest; plain ``/`` is approximate on NVIDIA GPUs) and
launches pass ``enable_fp_fusion=False``, so scales and codes match the reference bit for bit.
"""

from __future__ import annotations

import torch

from kvpool.kernels._backend import HAVE_TRITON

FP8_MAX = 448.0
INT8_MAX = 127.0
GRANULARITIES = ("token_head", "layer")

# Elements one Triton program handles: big enough to amortize a launch (and the interpreter's
# ~1 ms per program), small enough for registers on a GPU.
_TILE = 4096


def qmax_of(fmt: str) -> float:
    return FP8_MAX if fmt == "fp8" else INT8_MAX


def code_dtype(fmt: str) -> torch.dtype:
    return torch.uint8 if fmt == "fp8" else torch.int8


def scale_shape(S: int, T: int, H: int, granularity: str) -> tuple[int, ...]:
    return (S, 2, T, H) if granularity == "token_head" else (S, 2)


def scale_from_amax(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``amax / qmax`` in float32, 0 replaced by 1 (the guard every path shares)."""
    scale = amax.float() / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _broadcast_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales viewed to broadcast against ``[S, 2, T, H, D]``."""
    if scales.dim() == 4:  # token_head: [S, 2, T, H]
        return scales[..., None]
    return scales[:, :, None, None, None]  # layer: [S, 2]


# --------------------------------------------------------------------------- PyTorch reference


def sym_quantize_ref(x5: torch.Tensor, fmt: str, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantization of ``x5`` ``[S, 2, T, H, D]``: ``(codes, scales)``."""
    xf = x5.float()
    amax = xf.abs().amax(-1) if granularity == "token_head" else xf.abs().amax((2, 3, 4))
    scales = scale_from_amax(amax, qmax_of(fmt))
    y = xf / _broadcast_scales(scales)
    if fmt == "fp8":
        codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def sym_dequantize_ref(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Reference dequantization to ``dtype``, shape of ``codes``."""
    values = codes.view(torch.float8_e4m3fn).float() if fmt == "fp8" else codes.float()
    return (values * _broadcast_scales(scales)).to(dtype)


# --------------------------------------------------------------------------- Triton kernels

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rne_int(y):
        """Round fp32 ``y`` (|y| <= 2**22) to the nearest integer, ties to even, as int32: adding
        1.5 * 2**23 leaves a float whose ulp is 1, so the IEEE add itself rounds."""
        return (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000

    @triton.jit
    def _e4m3_code(y):
        """e4m3fn bit pattern (int32 in 0..255) of fp32 ``y`` already clamped to [-448, 448]."""
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # Normal range (|y| >= 2**-6): round the 23-bit mantissa to 3 bits, ties to even; a carry
        # out of the mantissa bumps the exponent, which is the right answer. Rebias 127 -> 7.
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # Subnormals (steps of 2**-9): |y| * 512 is exact; round it with the 2**23 trick. A result
        # of 8 is code 0x08 = 2**-6, the smallest normal, so the two ranges join up.
        t = a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
        sub = t.to(tl.int32, bitcast=True) - 0x4B000000
        return tl.where(a < 0x3C800000, sub, normal) | sign

    @triton.jit
    def _e4m3_value(c):
        """fp32 value of e4m3fn codes ``c`` (int32, 0..255; NaN codes are never written)."""
        e = (c >> 3) & 15
        m = c & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125
        mag = tl.where(e == 0, sub, normal)
        return tl.where((c & 0x80) != 0, -mag, mag)

    @triton.jit
    def _row_absmax_kernel(x_ptr, amax_ptr, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=mask, other=0.0)
        tl.store(amax_ptr + rows, tl.max(tl.abs(x.to(tl.float32)), axis=1), mask=rmask)

    @triton.jit
    def _sym_quant_kernel(x_ptr, codes_ptr, scale_ptr, n_rows, D, rows_per_scale,
                          QMAX: tl.constexpr, IS_FP8: tl.constexpr, ROW_SCALE: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols < D)[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ROW_SCALE:
            # Fused: amax, scale and codes of each row in one pass over the data.
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX)
            scale = tl.where(scale > 0, scale, 1.0)
            tl.store(scale_ptr + rows, scale, mask=rmask)
        else:
            scale = tl.load(scale_ptr + rows // rows_per_scale, mask=rmask, other=1.0)
        y = tl.math.div_rn(x, scale[:, None])
        # NOTE: |y| exceeds QMAX by at most an ulp here (amax / (amax / QMAX) rounded), which rounds
        # back to QMAX anyway; the clamp keeps the encoders total rather than relying on that.
        if IS_FP8:
            code = _e4m3_code(tl.minimum(tl.maximum(y, -QMAX), QMAX))
            tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
        else:
            code = tl.minimum(tl.maximum(_rne_int(y), -127), 127)
            tl.store(codes_ptr + offs, code.to(tl.int8), mask=mask)

    @triton.jit
    def _sym_dequant_kernel(codes_ptr, scale_ptr, out_ptr, n_rows, D, rows_per_scale,
                            IS_FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols < D)[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        if IS_FP8:
            v = _e4m3_value(c)
        else:
            v = c.to(tl.float32)
        scale = tl.load(scale_ptr + rows // rows_per_scale, mask=rmask, other=1.0)
        tl.store(out_ptr + offs, v * scale[:, None], mask=mask)


def _row_blocks(n_rows: int, D: int) -> tuple[int, int, tuple[int]]:
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(triton.next_power_of_2(n_rows), _TILE // block_d))
    return block_r, block_d, (triton.cdiv(n_rows, block_r),)


def kernel_out_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What a dequant kernel writes: the caller's dtype on a GPU (the store casts, round to
    nearest even like torch); float32 under the interpreter, whose bf16 casts are unreliable
    (triton issue 8322), cast by torch afterwards."""
    return dtype if device.type == "cuda" else torch.float32


def sym_quantize_triton(x5: torch.Tensor, fmt: str, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton quantization of a contiguous ``x5`` ``[S, 2, T, H, D]``: ``(codes, scales)``."""
    S, _, T, H, D = x5.shape
    n_rows = S * 2 * T * H
    qmax = qmax_of(fmt)
    codes = torch.empty(x5.shape, dtype=code_dtype(fmt), device=x5.device)
    block_r, block_d, grid = _row_blocks(n_rows, D)
    if granularity == "token_head":
        scales = torch.empty(scale_shape(S, T, H, granularity), dtype=torch.float32, device=x5.device)
        rows_per_scale = 1
    else:
        # NOTE: two passes (row amax, then codes) since one slab's amax spans many programs; the
        # tiny [S*2, T*H] -> [S*2] reduction and the guard run in torch.
        amax = torch.empty(n_rows, dtype=torch.float32, device=x5.device)
        _row_absmax_kernel[grid](x5, amax, n_rows, D, BLOCK_R=block_r, BLOCK_D=block_d)
        scales = scale_from_amax(amax.view(S, 2, T * H).amax(-1), qmax)
        rows_per_scale = T * H
    _sym_quant_kernel[grid](x5, codes, scales, n_rows, D, rows_per_scale, QMAX=qmax, IS_FP8=fmt == "fp8",
                            ROW_SCALE=granularity == "token_head", BLOCK_R=block_r, BLOCK_D=block_d,
                            enable_fp_fusion=False)
    return codes, scales


def sym_dequantize_triton(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Triton dequantization of contiguous ``codes`` ``[S, 2, T, H, D]`` to ``dtype``."""
    S, _, T, H, D = codes.shape
    n_rows = S * 2 * T * H
    out = torch.empty(codes.shape, dtype=kernel_out_dtype(codes.device, dtype), device=codes.device)
    rows_per_scale = 1 if scales.dim() == 4 else T * H
    block_r, block_d, grid = _row_blocks(n_rows, D)
    _sym_dequant_kernel[grid](codes, scales.contiguous(), out, n_rows, D, rows_per_scale, IS_FP8=fmt == "fp8",
                              BLOCK_R=block_r, BLOCK_D=block_d, enable_fp_fusion=False)
    return out.to(dtype)
