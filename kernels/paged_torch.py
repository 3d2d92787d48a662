"""The PyTorch implementations of the paged copies and scrubs: the references the Triton kernel is
tested against bit for bit, and what runs on a CPU (host pools, vLLM's CPU cache).

They index the same per-layer K and V views ``[NB, BS, H, D]`` of :mod:`kvpool.kernels.layouts`
as the kernel, through :func:`~kvpool.kernels.paged_bits.as_bits` views, and take arguments
:mod:`kvpool.kernels.paged_checks` has already checked. A scatter over a run of consecutive
slots, or into layers stacked one stride apart, takes faster strided paths (measured below).
"""

from __future__ import annotations

from typing import Optional

import torch

from .layouts import Geometry, LayerViews
from .paged_bits import as_bits


def gather(views: list[LayerViews], slots: torch.Tensor, geo: Geometry, out: torch.Tensor) -> None:
    """Writes the KV of the tokens at ``slots`` into the chunk ``out`` ``[L, 2, T, H, D]``."""
    blk, off = slots // geo.block_size, slots % geo.block_size
    out_bits = as_bits(out)
    for layer, (k, v) in enumerate(views):
        out_bits[layer, 0] = as_bits(k)[blk, off]  # [T, H, D]
        out_bits[layer, 1] = as_bits(v)[blk, off]


def scatter(views: list[LayerViews], slots: torch.Tensor, geo: Geometry, chunk: torch.Tensor) -> None:
    """Writes the chunk ``[L, 2, T, H, D]`` into the cache at ``slots`` (unique)."""
    chunk_bits = as_bits(chunk)
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
            _copy_run(as_bits(k), as_bits(v), src, int(slots[0]), geo.block_size)
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
        as_bits(k)[blk, off] = chunk_bits[layer, 0]
        as_bits(v)[blk, off] = chunk_bits[layer, 1]


def scrub_pages(flat: torch.Tensor, pages: torch.Tensor, page_numel: int) -> None:
    """Zeroes the whole pages ``pages`` of the flat integer view ``flat``."""
    num_pages = flat.numel() // page_numel
    flat[: num_pages * page_numel].view(num_pages, page_numel)[pages] = 0


def scrub_blocks(views: list[LayerViews], blocks: torch.Tensor) -> None:
    """Zeroes every layer's K and V of the blocks ``blocks``."""
    for k, v in views:
        as_bits(k)[blocks] = 0
        as_bits(v)[blocks] = 0


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
        b = as_bits(t)
        big.append(b.as_strided((len(views), *b.shape), (step, *b.stride()), b.storage_offset()))
    return big[0], big[1]
