"""The Triton kernel of the paged copies and scrubs, and its launch.

One kernel serves every cache format of :mod:`kvpool.kernels.layouts`: the layout turns the cache
into per-layer K and V views ``[NB, BS, H, D]``, and the kernel gets the K views' strides, the V
views' strides (they may differ: vLLM's CPU cache stores K transposed inside a block) and every
(layer, K/V) view's element offset from layer 0's K, so it never knows which engine it is copying
for. It copies :func:`~kvpool.kernels.paged_bits.as_bits` views, so one compiled kernel serves
every dtype of a width. The launches take arguments :mod:`kvpool.kernels.paged_checks` has
already checked.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import HAVE_TRITON
from .layouts import Geometry, LayerViews
from .paged_bits import as_bits

# Kernel modes (a constexpr: one specialisation each).
GATHER, SCATTER, ZERO = 0, 1, 2

# NOTE: a program copies a [BLOCK_T tokens, BLOCK_D dims] tile per head; ~4K elements keeps
# registers modest on a GPU while making the interpreter's per-program cost (~1 ms) rare.
_TILE_ELEMS = 4096
_MAX_BLOCK_T = 128
_SCRUB_BLOCK = 4096

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_heads(
        cache_ptr, chunk_ptr, paged_row, chunk_row, t_mask, H, s_h, s_d, c_h, c_d,
        MODE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        P_VEC: tl.constexpr, C_VEC: tl.constexpr,
    ):
        """Copy the [BLOCK_T, D] tile of every head between the rows ``paged_row`` (int64 element
        offsets of each token's head 0, dim 0 in the cache) and ``chunk_row`` (the same in the
        chunk); heads step by ``s_h`` / ``c_h``, dims by ``s_d`` / ``c_d``.

        P_VEC / C_VEC: how many elements every row start of the paged / chunk side is a multiple
        of (checked on the host), so a GPU can use 16-byte loads and stores."""
        d = tl.arange(0, BLOCK_D)
        mask = t_mask[:, None] & (d < D)[None, :]
        paged_col = (d.to(tl.int64) * s_d)[None, :]
        chunk_col = (d.to(tl.int64) * c_d)[None, :]
        for _h in range(0, H):  # NOTE: the row starts step by a head's stride, staying int64
            paged = cache_ptr + tl.multiple_of(paged_row, P_VEC)[:, None] + paged_col
            chunk = chunk_ptr + tl.multiple_of(chunk_row, C_VEC)[:, None] + chunk_col
            if MODE == 0:
                tl.store(chunk, tl.load(paged, mask=mask), mask=mask)
            elif MODE == 1:
                tl.store(paged, tl.load(chunk, mask=mask), mask=mask)
            else:
                tl.store(paged, tl.zeros([BLOCK_T, BLOCK_D], dtype=cache_ptr.dtype.element_ty), mask=mask)
            paged_row += s_h
            chunk_row += c_h

    @triton.jit
    def _paged_copy_kernel(
        cache_ptr, view_off_ptr, chunk_ptr, slots_ptr,
        T, H, BS,
        k_blk, k_off, k_h, k_d,  # paged side: strides of a layer's K view [NB, BS, H, D]
        v_blk, v_off, v_h, v_d,  # ... and of its V view (may differ from K's)
        c_l, c_kv, c_t, c_h, c_d,  # chunk side: strides of [L, 2, T, H, D]
        MODE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        K_VEC: tl.constexpr, V_VEC: tl.constexpr, C_VEC: tl.constexpr,
    ):
        """Program (token block, layer, kv): copy BLOCK_T tokens' heads x dims of one K or V.

        ``view_off_ptr[2 * layer + kv]`` is the element offset of that layer's K (kv 0) or V
        (kv 1) view from layer 0's K view, which ``cache_ptr`` points at."""
        layer = tl.program_id(1)
        kv = tl.program_id(2)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = t < T
        slot = tl.load(slots_ptr + t, mask=t_mask, other=0).to(tl.int64)
        blk, off = slot // BS, slot % BS
        # NOTE: int64 addressing throughout: a host pool's kv stride alone can pass 2**31.
        base = tl.load(view_off_ptr + layer * 2 + kv)
        chunk_row = layer.to(tl.int64) * c_l + kv.to(tl.int64) * c_kv + t.to(tl.int64) * c_t
        # NOTE: a branch per kv, not strides selected at run time: each branch keeps its own
        # stride specialisations and vector width (K of vLLM's CPU layout is not unit-stride in
        # its dims, its V is), at the cost of compiling the tile copy twice.
        if kv == 0:
            _copy_heads(cache_ptr, chunk_ptr, base + blk * k_blk + off * k_off, chunk_row, t_mask, H, k_h, k_d,
                        c_h, c_d, MODE, D, BLOCK_T, BLOCK_D, K_VEC, C_VEC)
        else:
            _copy_heads(cache_ptr, chunk_ptr, base + blk * v_blk + off * v_off, chunk_row, t_mask, H, v_h, v_d,
                        c_h, c_d, MODE, D, BLOCK_T, BLOCK_D, V_VEC, C_VEC)

    @triton.jit
    def _scrub_kernel(buf_ptr, pages_ptr, page_numel, BLOCK: tl.constexpr):
        """Program (page, block of it): zero BLOCK elements of one page."""
        page = tl.load(pages_ptr + tl.program_id(0)).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ptrs = buf_ptr + page * page_numel + i
        tl.store(ptrs, tl.zeros([BLOCK], dtype=buf_ptr.dtype.element_ty), mask=i < page_numel)


def copy(views: list[LayerViews], geo: Geometry, slots: torch.Tensor, chunk: Optional[torch.Tensor],
         mode: int) -> None:
    """Launches the copy kernel in ``mode`` (GATHER, SCATTER, or ZERO with no chunk) over ``slots``."""
    tokens = slots.numel()
    if tokens == 0:
        return
    k_bits, v_bits = as_bits(views[0].k), as_bits(views[0].v)
    chunk_bits = as_bits(chunk) if chunk is not None else k_bits  # unused by ZERO
    chunk_strides = chunk_bits.stride() if chunk is not None else (0,) * 5
    offsets = _view_offsets(views)
    view_off = torch.tensor(offsets, dtype=torch.int64, device=geo.device)
    item, ptr = k_bits.element_size(), k_bits.data_ptr()
    k_vec = vector_width(item, geo.head_dim, k_bits.stride(), ptr, offsets[0::2])
    v_vec = vector_width(item, geo.head_dim, v_bits.stride(), ptr, offsets[1::2])
    c_vec = vector_width(item, geo.head_dim, chunk_strides, chunk_bits.data_ptr(), []) if chunk is not None else 1
    block_d = triton.next_power_of_2(geo.head_dim)
    block_t = min(triton.next_power_of_2(tokens), max(1, _TILE_ELEMS // block_d), _MAX_BLOCK_T)
    grid = (triton.cdiv(tokens, block_t), geo.num_layers, 2)
    _paged_copy_kernel[grid](
        k_bits, view_off, chunk_bits, slots,
        tokens, geo.kv_heads, geo.block_size,
        *k_bits.stride(),
        *v_bits.stride(),
        *chunk_strides,
        MODE=mode, D=geo.head_dim, BLOCK_T=block_t, BLOCK_D=block_d, K_VEC=k_vec, V_VEC=v_vec, C_VEC=c_vec,
    )


def scrub_pages(flat: torch.Tensor, pages: torch.Tensor, page_numel: int) -> None:
    """Launches the scrub kernel: zeroes the whole pages ``pages`` (non-empty) of the flat view ``flat``."""
    block = min(_SCRUB_BLOCK, triton.next_power_of_2(page_numel))
    _scrub_kernel[(pages.numel(), triton.cdiv(page_numel, block))](flat, pages, page_numel, BLOCK=block)


def scrub_blocks(views: list[LayerViews], geo: Geometry, blocks: torch.Tensor) -> None:
    """Zeroes every layer's K and V of the blocks ``blocks`` with the copy kernel."""
    # NOTE: zeroing a block is a write of zeros to its BS slots; repeated blocks are harmless.
    offsets = torch.arange(geo.block_size, dtype=torch.int64, device=geo.device)
    slots = (blocks[:, None] * geo.block_size + offsets[None, :]).reshape(-1)
    copy(views, geo, slots, None, ZERO)


def _view_offsets(views: list[LayerViews]) -> list[int]:
    """Every view's start, in elements from layer 0's K view, as ``[K0, V0, K1, V1, ...]``
    (negative when allocated below it).

    NOTE: per-layer caches are separate allocations; addressing them all from layer 0's pointer
    is sound in one flat device address space (and in the interpreter, which runs on CPU memory
    as is) and lets one launch cover every layer, where a pointer table would need an int-to-
    pointer cast."""
    base, item = views[0].k.data_ptr(), views[0].k.element_size()
    offsets = []
    for pair in views:
        for t in pair:
            delta = t.data_ptr() - base
            assert delta % item == 0, "tensors of one dtype are aligned to their element size"
            offsets.append(delta // item)
    return offsets


def vector_width(item: int, head_dim: int, strides: tuple[int, ...], ptr: int, offsets: list[int]) -> int:
    """Largest element count (up to 16 bytes' worth) that every row start of one side is a
    multiple of: the row strides, the layer offsets and the base address all divide by it, the
    dims are unit-stride and head_dim divides by it. 1 when nothing is known."""
    *rows, dim_stride = strides
    if dim_stride != 1:
        return 1
    vec = max(1, 16 // item)
    while vec > 1:
        if head_dim % vec == 0 and ptr % (vec * item) == 0 and all(x % vec == 0 for x in (*rows, *offsets)):
            return vec
        vec //= 2
    return 1
