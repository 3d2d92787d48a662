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

import dataclasses
from typing import Optional

import torch

from kvpool.errors import BadRequest
from kvpool.kernels import paged_checks, paged_torch, paged_triton

from ._backend import resolve_impl
from .layouts import Cache, Geometry, PagedLayout, sglang_layout, vllm_layout
from .paged_bits import as_bits

__all__ = [
    "BoundCache",
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


class BoundCache:
    """One engine cache and its layout, resolved once: :meth:`gather` and :meth:`scatter` as the
    functions below, without rebuilding the cache's per-layer views on every call.

    NOTE: an engine registers its cache once and copies into it for every chunk: rebuilding the
    views (and the stacked view of vLLM's layers) took ~90 us per call for 8 layers on a quiet
    machine and 1.8 ms on a busy one, 16 times per 4K load of 256-token chunks. :meth:`scatter`
    also takes a run of consecutive slots as a ``range``, checked in Python, no index tensor made."""

    def __init__(self, cache: Cache, layout: PagedLayout) -> None:
        self.layout = layout
        self.views, self.geo = layout.views(cache)  # BadRequest on a cache this layout cannot read
        self._runs: list | None = None  # CPU: (K, V) integer views [L', NB, BS, H, D], the layers each covers

    def heads(self, first: int, end: int) -> "BoundCache":
        """The same cache seen through its heads ``first..end-1`` only: a chunk of ``end - first``
        heads scatters into (gathers from) those heads of every slot, the others untouched (a
        pool slice of one KV head goes straight into its head, no merged chunk in between)."""
        if not 0 <= first < end <= self.geo.kv_heads:
            raise BadRequest(f"heads {first}..{end - 1} are not among the cache's {self.geo.kv_heads}")
        out = object.__new__(BoundCache)
        out.layout, out._runs = self.layout, None
        out.views = [type(lv)(lv.k[:, :, first:end], lv.v[:, :, first:end]) for lv in self.views]
        out.geo = dataclasses.replace(self.geo, kv_heads=end - first)
        return out

    def _run_views(self) -> list:
        if self._runs is None:
            stacked = paged_torch._stacked_layers(self.views)
            if stacked is not None:
                self._runs = [(*stacked, slice(None))]
            else:
                self._runs = [(as_bits(k).unsqueeze(0), as_bits(v).unsqueeze(0), slice(i, i + 1))
                              for i, (k, v) in enumerate(self.views)]
        return self._runs

    def gather(self, slots: torch.Tensor, *, out: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
        """:func:`gather` of this cache."""
        geo = self.geo
        slots = paged_checks.check_slots(slots, geo, self.layout, unique=False)
        if out is None:
            out = torch.empty(paged_checks.chunk_shape(geo, slots.numel()), dtype=geo.dtype, device=geo.device)
        else:
            paged_checks.check_chunk(out, geo, slots.numel(), "out")
        if resolve_impl(impl, self.views[0].k, slots, out) == "triton":
            paged_triton.copy(self.views, geo, slots, out, paged_triton.GATHER)
        else:
            paged_torch.gather(self.views, slots, geo, out)
        return out

    def scatter(self, chunk: torch.Tensor, slots: torch.Tensor | range, *, impl: str = "auto") -> None:
        """:func:`scatter` into this cache; ``slots`` may be a ``range`` of consecutive slots."""
        geo = self.geo
        if isinstance(slots, range):
            if slots.step != 1 or len(slots) == 0:
                slots = torch.tensor(slots, dtype=torch.int64)
            else:
                paged_checks.check_chunk(chunk, geo, len(slots), "chunk")
                if slots.start < 0 or slots.stop > geo.capacity:
                    raise BadRequest(f"{self.layout.name}: slots {slots.start}..{slots.stop - 1} are out of range "
                                     f"({geo.capacity} slots, {geo.num_blocks} blocks x {geo.block_size}); valid "
                                     f"slots are 0..{geo.capacity - 1}")
                if geo.device.type == "cpu" and impl != "triton":
                    bits = as_bits(chunk)
                    for k, v, layers in self._run_views():
                        paged_torch._copy_run(k, v, bits[layers], slots.start, geo.block_size)
                    return
                slots = torch.arange(slots.start, slots.stop, dtype=torch.int64, device=geo.device)
        slots = paged_checks.check_slots(slots, geo, self.layout, unique=True)
        paged_checks.check_chunk(chunk, geo, slots.numel(), "chunk")
        if resolve_impl(impl, self.views[0].k, slots, chunk) == "triton":
            paged_triton.copy(self.views, geo, slots, chunk, paged_triton.SCATTER)
        else:
            paged_torch.scatter(self.views, slots, geo, chunk)


def gather(cache: Cache, slots: torch.Tensor, layout: PagedLayout, *, out: Optional[torch.Tensor] = None,
           impl: str = "auto") -> torch.Tensor:
    """The KV of the tokens at ``slots`` as a chunk ``[L, 2, T, H, D]`` of the cache's dtype.

    ``slots`` is a 1-D integer tensor (T entries, any device: it is moved to the cache's);
    ``out``, when given, is written and returned (any strides, the chunk's shape and dtype).
    Copying many times into one cache: :class:`BoundCache`."""
    return BoundCache(cache, layout).gather(slots, out=out, impl=impl)


def gather_ref(cache: Cache, slots: torch.Tensor, layout: PagedLayout, *,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference of :func:`gather` (the same checks, indexing the layout's views)."""
    return gather(cache, slots, layout, out=out, impl="torch")


def scatter(chunk: torch.Tensor, cache: Cache, slots: torch.Tensor, layout: PagedLayout, *,
            impl: str = "auto") -> None:
    """Write ``chunk`` ``[L, 2, T, H, D]`` into the cache at ``slots``, in place (the inverse of
    :func:`gather`). Duplicate slots are refused: which token would win is undefined."""
    BoundCache(cache, layout).scatter(chunk, slots, impl=impl)


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
