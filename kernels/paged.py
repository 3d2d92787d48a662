"""Copies between an engine's paged KV cache and the pool's contiguous chunk layout, and scrubs.

``gather`` copies the KV of ``T`` tokens, given by their slots (``block * block_size + offset``),
out of a paged cache into a chunk ``[layers, 2, T, kv_heads, head_dim]`` (K then V);
``scatter`` is its inverse and writes the cache in place. ``scrub`` zeroes whole pages of a flat
buffer (a pool slab) and ``scrub_blocks`` whole blocks of a paged cache, for tenants that require
no residue after eviction.

This module is the public entry: each function checks its arguments on the host
(:mod:`kvpool.kernels.paged_checks`; a bad one is a ``BadRequest`` and leaves the cache untouched),
then runs the Triton kernel (:mod:`kvpool.kernels.paged_triton`) or its PyTorch reference
(:mod:`kvpool.kernels.paged_torch`, also the ``*_ref`` functions here), which index the same
per-layer views of the cache's layout. Both move bits, not numbers
(:mod:`kvpool.kernels.paged_bits`).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.errors import BadRequest
from kvpool.kernels import paged_checks, paged_torch, paged_triton

from ._backend import resolve_impl
from .layouts import Cache, Geometry, PagedLayout, sglang_layout, vllm_layout
from .paged_bits import as_bits

__all__ = [
    "Geometry",
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

_vector_width = paged_triton.vector_width  # the tests pin the kernel's alignment claims through this name


def gather(cache: Cache, slots: torch.Tensor, layout: PagedLayout, *, out: Optional[torch.Tensor] = None,
           impl: str = "auto") -> torch.Tensor:
    """The KV of the tokens at ``slots`` as a chunk ``[L, 2, T, H, D]`` of the cache's dtype.

    ``slots`` is a 1-D integer tensor (T entries, any device: it is moved to the cache's);
    ``out``, when given, is written and returned (any strides, the chunk's shape and dtype)."""
    views, geo = layout.views(cache)
    slots = paged_checks.check_slots(slots, geo, layout, unique=False)
    if out is None:
        out = torch.empty(paged_checks.chunk_shape(geo, slots.numel()), dtype=geo.dtype, device=geo.device)
    else:
        paged_checks.check_chunk(out, geo, slots.numel(), "out")
    if resolve_impl(impl, views[0].k, slots, out) == "triton":
        paged_triton.copy(views, geo, slots, out, paged_triton.GATHER)
    else:
        paged_torch.gather(views, slots, geo, out)
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
    slots = paged_checks.check_slots(slots, geo, layout, unique=True)
    paged_checks.check_chunk(chunk, geo, slots.numel(), "chunk")
    if resolve_impl(impl, views[0].k, slots, chunk) == "triton":
        paged_triton.copy(views, geo, slots, chunk, paged_triton.SCATTER)
    else:
        paged_torch.scatter(views, slots, geo, chunk)


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
    pages = paged_checks.check_ids(page_ids, num_pages, buf.device, "scrub", "page",
                                   f"{num_pages} whole pages of {page_numel} elements")
    if pages.numel() == 0:
        return
    flat = as_bits(buf).view(-1)
    if resolve_impl(impl, buf, pages) == "triton":
        paged_triton.scrub_pages(flat, pages, page_numel)
    else:
        paged_torch.scrub_pages(flat, pages, page_numel)


def scrub_ref(buf: torch.Tensor, page_ids: torch.Tensor, page_numel: int) -> None:
    """PyTorch reference of :func:`scrub`."""
    scrub(buf, page_ids, page_numel, impl="torch")


def scrub_blocks(cache: Cache, block_ids: torch.Tensor, layout: PagedLayout, *, impl: str = "auto") -> None:
    """Zero every layer's K and V of the given blocks of a paged cache (all their token offsets,
    heads and dims). For SGLang's ``layer_first``/``page_first`` a block is one slot."""
    views, geo = layout.views(cache)
    blocks = paged_checks.check_ids(block_ids, geo.num_blocks, geo.device, layout.name, "block",
                                    f"{geo.num_blocks} blocks")
    if blocks.numel() == 0:
        return
    if resolve_impl(impl, views[0].k, blocks) == "triton":
        paged_triton.scrub_blocks(views, geo, blocks)
    else:
        paged_torch.scrub_blocks(views, blocks)


def scrub_blocks_ref(cache: Cache, block_ids: torch.Tensor, layout: PagedLayout) -> None:
    """PyTorch reference of :func:`scrub_blocks`."""
    scrub_blocks(cache, block_ids, layout, impl="torch")
