"""Copies between an engine's paged KV cache and the pool's contiguous chunk layout, and scrubs.

``gather`` copies the KV of ``T`` tokens, given by their slots (``block * block_size + offset``),
out of a paged cache into a chunk ``[layers, 2, T, kv_heads, head_dim]`` (K then V);
``scatter`` is its inverse and writes the cache in place. ``scrub`` zeroes whole pages of a flat
buffer (a pool slab) and ``scrub_blocks`` whole blocks of a paged cache, for tenants that require
no residue after eviction.

One Triton kernel serves every cache format of :mod:`kvpool.kernels.layouts`: the layout turns
the cache into per-layer K and V views ``[NB, BS, H, D]``, and the kernel gets the K views'
strides, the V views' strides (they may differ: vLLM's CPU cache stores K transposed inside a
block) and every (layer, K/V) view's element offset from layer 0's K, so it never knows which
engine it is copying for. Each kernel has a PyTorch reference (``*_ref``) indexing the same views.

Everything is checked on the host before anything is written: a slot or page out of range, a
duplicate slot in a scatter, a dtype, shape or device mismatch is a ``BadRequest`` and leaves the
cache untouched.

NOTE: the copies move bits, not numbers: both paths view every tensor as the integer type of
the same width (fp16/bf16 as int16, fp8 as uint8, ...). No cast can round, fp8 caches need no
``index_put`` support, and the interpreter never touches a bf16/fp8 value (its fp8/bf16 casts
are wrong, triton issue 8322); one compiled kernel serves every dtype of a width.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.errors import BadRequest

from ._backend import HAVE_TRITON, resolve_impl
from .layouts import Cache, Geometry, LayerViews, PagedLayout, sglang_layout, vllm_layout

__all__ = [
    "PagedLayout",
    "gather",
    "gather_ref",
    "scatter",
    "scatter_ref",
    "scrub",
    "scrub_blocks",
    "scrub_blocks_ref",
    "scrub_ref",
    "sglang_layout",
    "vllm_layout",
]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Kernel modes (a constexpr: one specialisation each).
_GATHER, _SCATTER, _ZERO = 0, 1, 2

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


# ---------------------------------------------------------------------------------------------
# Public surface


def gather(cache: Cache, slots: torch.Tensor, layout: PagedLayout, *, out: Optional[torch.Tensor] = None,
           impl: str = "auto") -> torch.Tensor:
    """The KV of the tokens at ``slots`` as a chunk ``[L, 2, T, H, D]`` of the cache's dtype.

    ``slots`` is a 1-D integer tensor (T entries, any device: it is moved to the cache's);
    ``out``, when given, is written and returned (any strides, the chunk's shape and dtype)."""
    views, geo = layout.views(cache)
    slots = _check_slots(slots, geo, layout, unique=False)
    if out is None:
        out = torch.empty(_chunk_shape(geo, slots.numel()), dtype=geo.dtype, device=geo.device)
    else:
        _check_chunk(out, geo, slots.numel(), "out")
    if resolve_impl(impl, views[0].k, slots, out) == "triton":
        _copy_triton(views, geo, slots, out, _GATHER)
    else:
        _gather_torch(views, slots, geo, out)
    return out


def gather_ref(cache: Cache, slots: torch.Tensor, layout: PagedLayout, *,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference of :func:`gather` (the same checks, indexing the layout's views)."""
    return gather(cache, slots, layout, out=out, impl="torch")


def scatter(chunk: torch.Tensor, cache: Cache, slots: torch.Tensor, layout: PagedLayout, *,
            impl: str = "auto") -> None:
    """Write ``chunk`` ``[L, 2, T, H, D]`` into the cache at ``slots``, in place (the inverse of
    :func:`gather`). Duplicate slots are refused: which token would win is undefined."""
    views, geo = layout.views(cache)
    slots = _check_slots(slots, geo, layout, unique=True)
    _check_chunk(chunk, geo, slots.numel(), "chunk")
    if resolve_impl(impl, views[0].k, slots, chunk) == "triton":
        _copy_triton(views, geo, slots, chunk, _SCATTER)
    else:
        _scatter_torch(views, slots, geo, chunk)


def scatter_ref(chunk: torch.Tensor, cache: Cache, slots: torch.Tensor, layout: PagedLayout) -> None:
    """PyTorch reference of :func:`scatter`."""
    scatter(chunk, cache, slots, layout, impl="torch")


def scrub(buf: torch.Tensor, page_ids: torch.Tensor, page_numel: int, *, impl: str = "auto") -> None:
    """Zero ``buf.view(-1)[p * page_numel:(p + 1) * page_numel]`` for every page id ``p``.

    ``buf`` is contiguous, of any dtype (a uint8 slab, a typed cache); a page must lie wholly
    inside it. Repeated ids are harmless."""
    if not isinstance(buf, torch.Tensor) or not buf.is_contiguous():
        raise BadRequest("scrub: buf must be a contiguous tensor; scrub the contiguous allocation it views")
    if isinstance(page_numel, bool) or not isinstance(page_numel, int) or page_numel <= 0:
        raise BadRequest(f"scrub: page_numel must be a positive int, got {page_numel!r}")
    num_pages = buf.numel() // page_numel
    pages = _check_ids(page_ids, num_pages, buf.device, "scrub", "page",
                       f"{num_pages} whole pages of {page_numel} elements")
    if pages.numel() == 0:
        return
    flat = _bits(buf).view(-1)
    if resolve_impl(impl, buf, pages) == "triton":
        block = min(_SCRUB_BLOCK, triton.next_power_of_2(page_numel))
        _scrub_kernel[(pages.numel(), triton.cdiv(page_numel, block))](flat, pages, page_numel, BLOCK=block)
    else:
        flat[: num_pages * page_numel].view(num_pages, page_numel)[pages] = 0


def scrub_ref(buf: torch.Tensor, page_ids: torch.Tensor, page_numel: int) -> None:
    """PyTorch reference of :func:`scrub`."""
    scrub(buf, page_ids, page_numel, impl="torch")


def scrub_blocks(cache: Cache, block_ids: torch.Tensor, layout: PagedLayout, *, impl: str = "auto") -> None:
    """Zero every layer's K and V of the given blocks of a paged cache (all their token offsets,
    heads and dims). For SGLang's ``layer_first``/``page_first`` a block is one slot."""
    views, geo = layout.views(cache)
    blocks = _check_ids(block_ids, geo.num_blocks, geo.device, layout.name, "block", f"{geo.num_blocks} blocks")
    if blocks.numel() == 0:
        return
    if resolve_impl(impl, views[0].k, blocks) == "triton":
        # NOTE: zeroing a block is a write of zeros to its BS slots; repeated blocks are harmless.
        offsets = torch.arange(geo.block_size, dtype=torch.int64, device=geo.device)
        slots = (blocks[:, None] * geo.block_size + offsets[None, :]).reshape(-1)
        _copy_triton(views, geo, slots, None, _ZERO)
    else:
        for k, v in views:
            _bits(k)[blocks] = 0
            _bits(v)[blocks] = 0


def scrub_blocks_ref(cache: Cache, block_ids: torch.Tensor, layout: PagedLayout) -> None:
    """PyTorch reference of :func:`scrub_blocks`."""
    scrub_blocks(cache, block_ids, layout, impl="torch")


# ---------------------------------------------------------------------------------------------
# Checks (host side, before any write)


def _chunk_shape(geo: Geometry, tokens: int) -> tuple[int, ...]:
    return (geo.num_layers, 2, tokens, geo.kv_heads, geo.head_dim)


def _check_chunk(chunk: torch.Tensor, geo: Geometry, tokens: int, what: str) -> None:
    want = _chunk_shape(geo, tokens)
    if not isinstance(chunk, torch.Tensor):
        raise BadRequest(f"{what} must be a tensor [layers, 2, tokens, kv_heads, head_dim], got {type(chunk).__name__}")
    if tuple(chunk.shape) != want:
        raise BadRequest(f"{what} has shape {tuple(chunk.shape)}; this cache and {tokens} slots need {want} "
                         "[layers, 2, tokens, kv_heads, head_dim]")
    if chunk.dtype != geo.dtype:
        raise BadRequest(f"{what} is {chunk.dtype} but the cache is {geo.dtype}; convert one to the other first")
    if chunk.device != geo.device:
        raise BadRequest(f"{what} is on {chunk.device} but the cache is on {geo.device}; move it there")


def _as_index(ids: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise BadRequest(f"{what} must be a 1-D integer tensor (int32/int64), got {got}")
    return ids.to(device=device, dtype=torch.int64).contiguous()


def _check_range(ids: torch.Tensor, limit: int, where: str, noun: str, extent: str) -> None:
    """Every id in ``0 .. limit-1``; one host sync (min and max), no write before it."""
    if ids.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise BadRequest(f"{where}: {noun} {bad} is out of range ({extent}); valid {noun}s are 0..{limit - 1}")


def _check_slots(slots: torch.Tensor, geo: Geometry, layout: PagedLayout, unique: bool) -> torch.Tensor:
    slots = _as_index(slots, geo.device, f"{layout.name}: slots")
    _check_range(slots, geo.capacity, layout.name, "slot",
                 f"{geo.capacity} slots ({geo.num_blocks} blocks x {geo.block_size})")
    if unique and slots.numel() > 1:
        s = slots.sort().values
        dup = s[1:][s[1:] == s[:-1]]
        if dup.numel():
            raise BadRequest(f"{layout.name}: slot {int(dup[0])} appears more than once in a scatter; "
                             "each slot takes one token, drop the duplicates")
    return slots


def _check_ids(ids: torch.Tensor, limit: int, device: torch.device, where: str, noun: str,
               extent: str) -> torch.Tensor:
    ids = _as_index(ids, device, f"{where}: {noun} ids")
    _check_range(ids, limit, where, noun, extent)
    return ids


# ---------------------------------------------------------------------------------------------
# Implementations


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer type of its width (same memory, same strides)."""
    if t.element_size() not in _BITS:
        raise BadRequest(f"dtype {t.dtype} ({t.element_size()} bytes) is not supported; use 1-, 2-, 4- or "
                         "8-byte elements")
    return t.view(_BITS[t.element_size()])


def _gather_torch(views: list[LayerViews], slots: torch.Tensor, geo: Geometry, out: torch.Tensor) -> None:
    blk, off = slots // geo.block_size, slots % geo.block_size
    out_bits = _bits(out)
    for layer, (k, v) in enumerate(views):
        out_bits[layer, 0] = _bits(k)[blk, off]  # [T, H, D]
        out_bits[layer, 1] = _bits(v)[blk, off]


def _scatter_torch(views: list[LayerViews], slots: torch.Tensor, geo: Geometry, chunk: torch.Tensor) -> None:
    chunk_bits = _bits(chunk)
    stacked = _stacked_layers(views)
    if _is_run(slots):
        # NOTE: consecutive slots (vLLM hands a request ascending block ids from its free queue)
        # are at most three slices of whole or partial blocks: strided copies, no per-element
        # index math. Measured (geometry below, 60 MiB, ascending blocks, medians of 21): 6.95 ms
        # against 8.16 ms through the stacked index_put; in vLLM's warm 4K load (medians of 15)
        # 15.3 ms against 16.7 ms (per layer, separate caches: 15.4 against 17.6 ms). Scattered
        # blocks take the index_put.
        pairs = [stacked] if stacked is not None else [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in views]
        for i, (k, v) in enumerate(pairs):
            src = chunk_bits if stacked is not None else chunk_bits[i : i + 1]
            _copy_run(_bits(k), _bits(v), src, int(slots[0]), geo.block_size)
        return
    blk, off = slots // geo.block_size, slots % geo.block_size
    if stacked is not None:
        # NOTE: one index_put for every layer's K and one for V, where the per-layer loop makes
        # 2 * L: measured (vLLM's CPU cache, 8 layers x 4 heads x 64 dims, fp32, 256-token
        # chunks, 2 threads, medians of 21 in one run) 9.3 ms per 60 MiB against 12.6 ms; in
        # vLLM's warm 4K load 16.7 ms against 18.7 ms. (Indexing whole blocks, index_put or
        # index_copy_ on the block axis, was slower than per-slot indexing: 10.2/9.3 ms.)
        big_k, big_v = stacked
        big_k[:, blk, off] = chunk_bits[:, 0]
        big_v[:, blk, off] = chunk_bits[:, 1]
        return
    for layer, (k, v) in enumerate(views):
        _bits(k)[blk, off] = chunk_bits[layer, 0]
        _bits(v)[blk, off] = chunk_bits[layer, 1]


def _is_run(slots: torch.Tensor) -> bool:
    """Whether ``slots`` are ``s, s+1, ..., s+T-1`` in this order (T >= 1)."""
    n = slots.numel()
    if n == 0 or int(slots[-1]) - int(slots[0]) != n - 1:
        return False
    return n == 1 or bool((slots[1:] - slots[:-1] == 1).all())


def _copy_run(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, first: int, block_size: int) -> None:
    """Writes ``src`` ``[L, 2, T, H, D]`` to the consecutive slots from ``first`` of the stacked
    ``[L, NB, BS, H, D]`` views ``k`` and ``v``: a partial first block, whole blocks, a partial
    last block, each one slice copy."""
    t, total = 0, src.shape[2]
    while t < total:
        blk, off = divmod(first + t, block_size)
        if off == 0 and total - t >= block_size:
            n = (total - t) // block_size
            part = src[:, :, t : t + n * block_size].unflatten(2, (n, block_size))
            k[:, blk : blk + n].copy_(part[:, 0])
            v[:, blk : blk + n].copy_(part[:, 1])
            t += n * block_size
        else:
            m = min(block_size - off, total - t)
            k[:, blk, off : off + m].copy_(src[:, 0, t : t + m])
            v[:, blk, off : off + m].copy_(src[:, 1, t : t + m])
            t += m


def _stacked_layers(views: list[LayerViews]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K (and V) as one ``[L, NB, BS, H, D]`` integer view, when the layers lie in
    one storage a constant positive stride apart and no two layers' elements overlap (vLLM puts
    every layer in one allocation that way); None otherwise (separate allocations, interleaved
    layers), and the caller copies layer by layer.

    NOTE: disjoint address ranges (the step at least one layer's whole K+V span) make the
    stacked write element for element the per-layer loop's, whatever the slots; interleaved
    layouts (SGLang's page_first) are left to the loop rather than proved alias-free."""
    if len(views) < 2:
        return None
    k0, v0 = views[0]
    storage = k0.untyped_storage().data_ptr()
    step = views[1].k.storage_offset() - k0.storage_offset()
    if step <= 0:
        return None
    for i, (k, v) in enumerate(views):
        if (k.untyped_storage().data_ptr() != storage or v.untyped_storage().data_ptr() != storage
                or k.storage_offset() != k0.storage_offset() + i * step
                or v.storage_offset() != v0.storage_offset() + i * step):
            return None
    if any(s < 0 for t in (k0, v0) for s in t.stride()):
        return None

    def last(t: torch.Tensor) -> int:  # offset of the view's last element (strides are >= 0)
        return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))

    span = max(last(k0), last(v0)) + 1 - min(k0.storage_offset(), v0.storage_offset())
    if step < span:
        return None
    big = []
    for t in (k0, v0):
        b = _bits(t)
        big.append(b.as_strided((len(views), *b.shape), (step, *b.stride()), b.storage_offset()))
    return big[0], big[1]


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


def _copy_triton(views: list[LayerViews], geo: Geometry, slots: torch.Tensor, chunk: Optional[torch.Tensor],
                 mode: int) -> None:
    tokens = slots.numel()
    if tokens == 0:
        return
    k_bits, v_bits = _bits(views[0].k), _bits(views[0].v)
    chunk_bits = _bits(chunk) if chunk is not None else k_bits  # unused by _ZERO
    chunk_strides = chunk_bits.stride() if chunk is not None else (0,) * 5
    offsets = _view_offsets(views)
    view_off = torch.tensor(offsets, dtype=torch.int64, device=geo.device)
    item, ptr = k_bits.element_size(), k_bits.data_ptr()
    k_vec = _vector_width(item, geo.head_dim, k_bits.stride(), ptr, offsets[0::2])
    v_vec = _vector_width(item, geo.head_dim, v_bits.stride(), ptr, offsets[1::2])
    c_vec = _vector_width(item, geo.head_dim, chunk_strides, chunk_bits.data_ptr(), []) if chunk is not None else 1
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


def _vector_width(item: int, head_dim: int, strides: tuple[int, ...], ptr: int, offsets: list[int]) -> int:
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
