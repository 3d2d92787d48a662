"""KIVI-style asymmetric INT4 / INT2 KV quantization: Triton kernels beside PyTorch references.

Works on a KV tensor viewed as ``[S, 2, T, H, D]`` (``S`` = flattened leading dims, e.g. layers;
index 0 of dim 1 is K, 1 is V). With ``bits`` in (4, 2), ``QMAX = 2**bits - 1``, ``G = group``,
``R = residual``:

- Token split. The first ``Tq = floor(max(T - R, 0) / G) * G`` tokens are quantized, the last
  ``T - Tq`` stay in a full-precision residual (the caller's dtype): at least the ``R`` most recent
  tokens, plus the tail that does not fill a whole key group (so between ``R`` and ``R + G - 1``
  tokens, or all ``T`` when ``T < R + G``). K and V split at the same token.
- Keys, per channel: each group of ``G`` consecutive quantized tokens and each (head, channel)
  gets ``min`` and ``scale`` over those ``G`` tokens: ``[S, Tq/G, H, D]`` each.
- Values, per token: each (token, head) and each group of ``GV = min(G, D)`` consecutive channels
  gets ``min`` and ``scale``: ``[S, Tq, H, D/GV]`` each (``D`` must be a multiple of ``GV``).
- ``scale = (max - min) / QMAX`` (0 -> 1: a constant group decodes exactly to its min),
  ``code = round((x - min) / scale)`` (half to even, as torch.round), clamped to ``[0, QMAX]``;
  decode ``code * scale + min``, in float32.
- Packing: codes ``[S, 2, Tq, H, D / PB]`` uint8, ``PB = 8 / bits`` codes per byte along the
  channel axis, channel ``d`` in byte ``d // PB`` at bit ``(d % PB) * bits`` (low bits first).

NOTE: min and scale are stored as float32 (8 bytes per group). That caps compression (int2 with
G=32 spends as many bits on metadata as on codes) but keeps the error bound ``scale / 2`` exact;
16-bit metadata would need a min that stays representable and a scale rounded up.
"""

from __future__ import annotations

import torch

from kvpool.kernels._backend import HAVE_TRITON
from kvpool.kernels.quant_fp8 import kernel_out_dtype

_TILE = 4096


def codes_per_byte(bits: int) -> int:
    return 8 // bits


def quantized_tokens(T: int, group: int, residual: int) -> int:
    """``Tq``: how many leading tokens are quantized (see the module docstring)."""
    return (max(T - residual, 0) // group) * group


def value_group(group: int, D: int) -> int:
    return min(group, D)


def kivi_shapes(S: int, T: int, H: int, D: int, bits: int, group: int, residual: int) -> dict[str, tuple[int, ...]]:
    """Shapes of every stored tensor, by name (all over the flattened leading dim ``S``)."""
    tq = quantized_tokens(T, group, residual)
    gv = value_group(group, D)
    return {
        "codes": (S, 2, tq, H, D // codes_per_byte(bits)),
        "scales": (S, tq // group, H, D),
        "mins": (S, tq // group, H, D),
        "value_scales": (S, tq, H, D // gv),
        "value_mins": (S, tq, H, D // gv),
        "residual": (S, 2, T - tq, H, D),
    }


def _scale_of(mn: torch.Tensor, mx: torch.Tensor, qmax: int) -> torch.Tensor:
    scale = (mx - mn) / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _codes_of(x: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    return torch.round((x - mn) / scale).clamp(0, qmax).to(torch.uint8)


def pack_ref(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``q`` (uint8 < 2**bits) along the last dim, ``8 / bits`` per byte, low first."""
    pb = codes_per_byte(bits)
    shifts = torch.arange(pb, device=q.device, dtype=torch.int32) * bits
    grouped = q.to(torch.int32).view(*q.shape[:-1], q.shape[-1] // pb, pb)
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_ref(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_ref`: uint8 codes, last dim ``8 / bits`` times longer."""
    pb = codes_per_byte(bits)
    shifts = torch.arange(pb, device=packed.device, dtype=torch.int32) * bits
    q = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return q.view(*packed.shape[:-1], packed.shape[-1] * pb).to(torch.uint8)


# --------------------------------------------------------------------------- PyTorch reference


def kivi_quantize_ref(x5: torch.Tensor, bits: int, group: int, residual: int) -> dict[str, torch.Tensor]:
    """Reference quantization of ``x5`` ``[S, 2, T, H, D]``: the tensors of :func:`kivi_shapes`."""
    S, _, T, H, D = x5.shape
    qmax = (1 << bits) - 1
    tq = quantized_tokens(T, group, residual)
    gv = value_group(group, D)
    xf = x5[:, :, :tq].float()
    k = xf[:, 0].reshape(S, tq // group, group, H, D)
    kmin, kmax = k.amin(2), k.amax(2)
    kscale = _scale_of(kmin, kmax, qmax)
    kq = _codes_of(k, kmin[:, :, None], kscale[:, :, None], qmax).view(S, tq, H, D)
    v = xf[:, 1].reshape(S, tq, H, D // gv, gv)
    vmin, vmax = v.amin(-1), v.amax(-1)
    vscale = _scale_of(vmin, vmax, qmax)
    vq = _codes_of(v, vmin[..., None], vscale[..., None], qmax).view(S, tq, H, D)
    return {
        "codes": pack_ref(torch.stack([kq, vq], 1), bits),
        "scales": kscale,
        "mins": kmin,
        "value_scales": vscale,
        "value_mins": vmin,
        "residual": x5[:, :, tq:].clone(),
    }


def kivi_dequantize_ref(t: dict[str, torch.Tensor], bits: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Reference dequantization of the tensors of :func:`kivi_quantize_ref` to ``[S, 2, T, H, D]``."""
    q = unpack_ref(t["codes"], bits).float()
    S, _, tq, H, D = q.shape
    gv = value_group(group, D)
    k = q[:, 0].view(S, tq // group, group, H, D) * t["scales"][:, :, None] + t["mins"][:, :, None]
    v = q[:, 1].view(S, tq, H, D // gv, gv) * t["value_scales"][..., None] + t["value_mins"][..., None]
    kv = torch.stack([k.view(S, tq, H, D), v.view(S, tq, H, D)], 1)
    return torch.cat([kv.to(dtype), t["residual"].to(dtype)], 2)


# --------------------------------------------------------------------------- Triton kernels

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from kvpool.kernels.quant_fp8 import _rne_int

    @triton.jit
    def _pack(q, BITS: tl.constexpr, PB: tl.constexpr):
        """Sum codes ``q`` [A, B, PB] (int32) into bytes [A, B] along the last axis, low bits first."""
        shift = tl.arange(0, PB) * BITS
        return tl.sum(q << shift[None, None, :], axis=2)

    @triton.jit
    def _kivi_key_quant_kernel(x_ptr, codes_ptr, scale_ptr, min_ptr, T, Tq, HD, G,
                               QMAX: tl.constexpr, BITS: tl.constexpr, PB: tl.constexpr,
                               BLOCK_G: tl.constexpr, BLOCK_CB: tl.constexpr):
        """One program: one group of G tokens of one slab, BLOCK_CB * PB of its H*D columns."""
        n_groups = Tq // G
        s = tl.program_id(0) // n_groups
        g = tl.program_id(0) % n_groups
        hdp = HD // PB
        t = tl.arange(0, BLOCK_G)
        cb = tl.program_id(1) * BLOCK_CB + tl.arange(0, BLOCK_CB)
        k = tl.arange(0, PB)
        col = cb[:, None] * PB + k[None, :]  # [BLOCK_CB, PB]
        cmask = (cb < hdp)[:, None] & (k < PB)[None, :]
        mask = (t < G)[:, None, None] & cmask[None, :, :]
        tok = (g * G + t).to(tl.int64)
        x = tl.load(x_ptr + s.to(tl.int64) * 2 * T * HD + tok[:, None, None] * HD + col[None, :, :],
                    mask=mask, other=0.0).to(tl.float32)
        mn = tl.where(cmask, tl.min(tl.where(mask, x, float("inf")), axis=0), 0.0)
        mx = tl.where(cmask, tl.max(tl.where(mask, x, float("-inf")), axis=0), 0.0)
        scale = tl.math.div_rn(mx - mn, QMAX)
        scale = tl.where(scale > 0, scale, 1.0)
        meta = (s * n_groups + g).to(tl.int64) * HD + col
        tl.store(scale_ptr + meta, scale, mask=cmask)
        tl.store(min_ptr + meta, mn, mask=cmask)
        q = _rne_int(tl.math.div_rn(x - mn[None, :, :], scale[None, :, :]))
        q = tl.minimum(tl.maximum(q, 0), (1 << BITS) - 1)
        packed = _pack(q, BITS, PB)  # [BLOCK_G, BLOCK_CB]
        out = codes_ptr + s.to(tl.int64) * 2 * Tq * hdp + tok[:, None] * hdp + cb[None, :]
        tl.store(out, packed.to(tl.uint8), mask=(t < G)[:, None] & (cb < hdp)[None, :])

    @triton.jit
    def _kivi_value_quant_kernel(x_ptr, codes_ptr, scale_ptr, min_ptr, T, Tq, HD, GV, n_seg,
                                 QMAX: tl.constexpr, BITS: tl.constexpr, PB: tl.constexpr,
                                 BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr):
        """One program: BLOCK_S segments (GV contiguous channels of one token-head) of one slab.
        D is a multiple of GV, so segment ``i`` of a slab starts at element ``i * GV``."""
        s = tl.program_id(1).to(tl.int64)
        gvp = GV // PB
        seg = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        j = tl.arange(0, BLOCK_J)
        k = tl.arange(0, PB)
        ch = j[:, None] * PB + k[None, :]  # [BLOCK_J, PB]
        smask = seg < n_seg
        inner = (j < gvp)[:, None] & (k < PB)[None, :]
        mask = smask[:, None, None] & inner[None, :, :]
        seg64 = seg.to(tl.int64)
        x = tl.load(x_ptr + s * 2 * T * HD + T * HD + seg64[:, None, None] * GV + ch[None, :, :],
                    mask=mask, other=0.0).to(tl.float32)
        mn = tl.min(tl.min(tl.where(mask, x, float("inf")), axis=2), axis=1)
        mx = tl.max(tl.max(tl.where(mask, x, float("-inf")), axis=2), axis=1)
        mn = tl.where(smask, mn, 0.0)
        mx = tl.where(smask, mx, 0.0)
        scale = tl.math.div_rn(mx - mn, QMAX)
        scale = tl.where(scale > 0, scale, 1.0)
        tl.store(scale_ptr + s * n_seg + seg64, scale, mask=smask)
        tl.store(min_ptr + s * n_seg + seg64, mn, mask=smask)
        q = _rne_int(tl.math.div_rn(x - mn[:, None, None], scale[:, None, None]))
        q = tl.minimum(tl.maximum(q, 0), (1 << BITS) - 1)
        packed = _pack(q, BITS, PB)  # [BLOCK_S, BLOCK_J]
        hdp = HD // PB
        out = codes_ptr + s * 2 * Tq * hdp + Tq * hdp + seg64[:, None] * gvp + j[None, :]
        tl.store(out, packed.to(tl.uint8), mask=smask[:, None] & (j < gvp)[None, :])

    @triton.jit
    def _kivi_dequant_kernel(codes_ptr, scale_ptr, min_ptr, out_ptr, T, Tq, HD, G, GV,
                             IS_VALUE: tl.constexpr, BITS: tl.constexpr, PB: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        """One program: BLOCK_N code bytes of one slab's K (or V) part, decoded into ``out``."""
        s = tl.program_id(1).to(tl.int64)
        hdp = HD // PB
        n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        k = tl.arange(0, PB)
        nmask = n < Tq * hdp
        mask = nmask[:, None] & (k < PB)[None, :]
        byte = tl.load(codes_ptr + s * 2 * Tq * hdp + IS_VALUE * Tq * hdp + n, mask=nmask, other=0)
        q = (byte.to(tl.int32)[:, None] >> (k * BITS)[None, :]) & ((1 << BITS) - 1)
        e = n[:, None] * PB + k[None, :]  # element index in the [Tq, H*D] part
        if IS_VALUE:
            meta = s * (Tq * HD // GV) + e // GV
        else:
            meta = s * (Tq // G) * HD + (e // HD // G) * HD + e % HD
        scale = tl.load(scale_ptr + meta, mask=mask, other=1.0)
        mn = tl.load(min_ptr + meta, mask=mask, other=0.0)
        tl.store(out_ptr + s * 2 * T * HD + IS_VALUE * T * HD + e, q.to(tl.float32) * scale + mn, mask=mask)


def kivi_quantize_triton(x5: torch.Tensor, bits: int, group: int, residual: int) -> dict[str, torch.Tensor]:
    """Triton quantization of a contiguous ``x5`` ``[S, 2, T, H, D]`` (see :func:`kivi_quantize_ref`)."""
    S, _, T, H, D = x5.shape
    pb = codes_per_byte(bits)
    shapes = kivi_shapes(S, T, H, D, bits, group, residual)
    t = {name: torch.empty(shape, dtype=torch.float32, device=x5.device) for name, shape in shapes.items()}
    t["codes"] = torch.empty(shapes["codes"], dtype=torch.uint8, device=x5.device)
    tq = shapes["codes"][2]
    t["residual"] = x5[:, :, tq:].clone()
    if tq == 0:
        return t
    HD = H * D
    qmax = float((1 << bits) - 1)
    block_g = triton.next_power_of_2(group)
    block_cb = max(1, min(triton.next_power_of_2(HD // pb), _TILE // (block_g * pb)))
    grid = (S * (tq // group), triton.cdiv(HD // pb, block_cb))
    _kivi_key_quant_kernel[grid](x5, t["codes"], t["scales"], t["mins"], T, tq, HD, group, QMAX=qmax, BITS=bits,
                                 PB=pb, BLOCK_G=block_g, BLOCK_CB=block_cb, enable_fp_fusion=False)
    gv = value_group(group, D)
    n_seg = tq * HD // gv
    block_j = triton.next_power_of_2(gv // pb)
    block_s = max(1, min(triton.next_power_of_2(n_seg), _TILE // (block_j * pb)))
    grid = (triton.cdiv(n_seg, block_s), S)
    _kivi_value_quant_kernel[grid](x5, t["codes"], t["value_scales"], t["value_mins"], T, tq, HD, gv, n_seg,
                                   QMAX=qmax, BITS=bits, PB=pb, BLOCK_S=block_s, BLOCK_J=block_j,
                                   enable_fp_fusion=False)
    return t


def kivi_dequantize_triton(t: dict[str, torch.Tensor], bits: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Triton dequantization of contiguous tensors of :func:`kivi_shapes` to ``[S, 2, T, H, D]``."""
    S, _, tq, H, dp = t["codes"].shape
    pb = codes_per_byte(bits)
    D = dp * pb
    T = tq + t["residual"].shape[2]
    out = torch.empty((S, 2, T, H, D), dtype=kernel_out_dtype(t["codes"].device, dtype), device=t["codes"].device)
    out[:, :, tq:] = t["residual"]
    if tq:
        n = tq * H * dp
        block_n = min(triton.next_power_of_2(n), _TILE // pb)
        grid = (triton.cdiv(n, block_n), S)
        for is_value, scale, mn in ((0, t["scales"], t["mins"]), (1, t["value_scales"], t["value_mins"])):
            _kivi_dequant_kernel[grid](t["codes"], scale, mn, out, T, tq, H * D, group, value_group(group, D),
                                       IS_VALUE=is_value, BITS=bits, PB=pb, BLOCK_N=block_n,
                                       enable_fp_fusion=False)
    return out.to(dtype)
