"""SGLang's host pool page by page, as kvpool chunks.

Pages and chunks. An SGLang page is ``page_size`` tokens; here one kvpool chunk holds exactly one
page (the spec's ``chunk_tokens`` is the page size; a config asking for another ``chunk_tokens``
is refused), in kvpool's canonical layout ``[layers, 2, page_size, kv_heads, head_dim]``. So every
host layout stores the same bytes for the same page, and a page written through a ``page_first``
pool reads back correctly into a ``layer_first`` one.

NOTE: a page is a chunk, so the page size sets the per-chunk overhead: measured on a 2-core CPU
(8 layers, 8 KV heads, head dim 128, bf16, pool full and evicting), one-token pages (32 KiB) cost
~30 us each (~1 GB/s), 64-token pages (2 MiB) move at 3-4 GB/s. Run SGLang with ``--page-size
64`` or larger for the L3 tier.

SGLang hands pages over two ways: as flat host pages (its generic interface: ``get_data_page`` /
``set_from_flat_data_page`` order), permuted to and from chunks here; or as host-pool slots (the
zero-copy ``interface_v1``), copied straight between the host buffer and chunks. Every copy moves
bits, never values.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.errors import BadRequest
from kvpool.kernels.layouts import sglang_layout
from kvpool.kernels.paged import gather, scatter

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class HostPages:
    """The pages of one SGLang MHA host pool (``layer_first``, ``page_first`` or
    ``page_first_direct``) as chunks ``[L, 2, P, H, D]``."""

    def __init__(self, host, layout: str, num_layers: int, kv_heads: int, head_dim: int, page_size: int) -> None:
        self.host = host
        self.page_size = page_size
        self.layout = sglang_layout(layout)
        self.numel = 2 * num_layers * page_size * kv_heads * head_dim
        # A flat page (SGLang's get_data_page / set_from_flat_data_page) in this layout, and the
        # permutation that turns it into a chunk [L, 2, P, H, D].
        L, H, P = num_layers, kv_heads, page_size
        if layout == "page_first":
            self._flat_shape, self._flat_order = (2, P, L, H, head_dim), (2, 0, 1, 3, 4)
        else:  # layer_first, page_first_direct
            self._flat_shape, self._flat_order = (2, L, P, H, head_dim), (1, 0, 2, 3, 4)
        self.capacity = self.layout.views(host.kv_buffer)[1].capacity

    # ------------------------------------------------------------------ flat pages (generic path)

    def check_flat(self, t, what: str) -> torch.Tensor:
        """``t`` when it is a flat page of this host pool; a BadRequest naming one otherwise."""
        host = self.host
        if not isinstance(t, torch.Tensor):
            raise BadRequest(f"{what} must be a tensor (a flat host page), got {type(t).__name__}")
        if t.numel() != self.numel or t.dtype != host.dtype:
            raise BadRequest(f"{what} is {t.dtype} with {t.numel()} elements; a page of this host pool is "
                             f"{host.dtype} with {self.numel} (host_pool.get_dummy_flat_data_page())")
        return t

    def empty_flat(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.host.dtype)

    def flat_to_chunk(self, flat: torch.Tensor) -> torch.Tensor:
        bits = flat.detach().cpu().view(_BITS[flat.element_size()])  # copies move bits, never values
        return bits.reshape(self._flat_shape).permute(self._flat_order).contiguous().view(flat.dtype)

    def chunk_into_flat(self, chunk: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        bits = _BITS[flat.element_size()]
        src = chunk.view(bits).permute([self._flat_order.index(i) for i in range(5)])  # the inverse
        dst = flat.view(bits)
        if dst.is_contiguous():
            dst.view(self._flat_shape).copy_(src)
        else:
            dst.copy_(src.reshape(-1))
        return flat

    # ------------------------------------------------------------------ host slots (zero-copy path)

    def check_slots(self, num_pages: int, host_indices) -> torch.Tensor:
        """``host_indices`` when they are the host-pool token slots of ``num_pages`` pages."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 \
                or host_indices.dtype.is_floating_point or host_indices.dtype == torch.bool:
            raise BadRequest("host_indices must be a 1-D integer tensor of host-pool token slots")
        want = num_pages * self.page_size
        if host_indices.numel() != want:
            raise BadRequest(f"{num_pages} pages of {self.page_size} tokens need {want} host indices, got "
                             f"{host_indices.numel()}")
        if want:
            lo, hi = (int(x) for x in torch.aminmax(host_indices))
            if lo < 0 or hi >= self.capacity:
                raise BadRequest(f"host index {lo if lo < 0 else hi} is out of range: the host pool has slots "
                                 f"0..{self.capacity - 1}")
        return host_indices

    def page_starts(self, slots: torch.Tensor) -> list[Optional[int]]:
        """Each page's first slot when its slots are one page-aligned run (what SGLang's host
        allocator hands out), else None: such a page is copied slot by slot by kvpool.kernels.paged."""
        P = self.page_size
        s = slots.to(torch.int64).view(-1, P)
        starts = s[:, 0]
        whole = ((s - starts[:, None]) == torch.arange(P)).all(dim=1) & (starts % P == 0)
        return [a if ok else None for a, ok in zip(starts.tolist(), whole.tolist())]

    def page_view(self, start: int) -> torch.Tensor:
        """The host page starting at slot ``start`` as a ``[L, 2, P, H, D]`` view of the host buffer,
        as raw bits (a copy through it never converts a value)."""
        kv, P = self.host.kv_buffer, self.page_size
        kv = kv.view(_BITS[kv.element_size()])
        variant = self.layout.variant
        if variant == "layer_first":  # (2, L, size, H, D)
            return kv[:, :, start:start + P].permute(1, 0, 2, 3, 4)
        if variant == "page_first":  # (2, size, L, H, D)
            return kv[:, start:start + P].permute(2, 0, 1, 3, 4)
        return kv[:, start // P].permute(1, 0, 2, 3, 4)  # page_first_direct: (2, pages, L, P, H, D)

    def write(self, chunks: list[torch.Tensor], slots: torch.Tensor) -> None:
        """Writes ``chunks[i]`` into the host pool at page ``i`` of ``slots``."""
        kv, P = self.host.kv_buffer, self.page_size
        # NOTE: page by page, with no staging copy of the whole batch. A page on an aligned run of
        # slots (always, with SGLang's allocator) is one strided copy of a view (~9 GB/s on a
        # 2-core CPU); the kernels' CPU reference, which host memory gets, indexes slot by slot
        # (gather ~1-2 GB/s, scatter ~3 GB/s there), so it only takes the other pages.
        for i, (chunk, start) in enumerate(zip(chunks, self.page_starts(slots))):
            if start is not None:
                self.page_view(start).copy_(chunk.view(_BITS[chunk.element_size()]))
            else:
                scatter(chunk.to(kv.device), kv, slots[i * P:(i + 1) * P], self.layout)

    def read(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """The host pool's pages at ``slots``, a contiguous chunk each."""
        kv, P = self.host.kv_buffer, self.page_size
        # NOTE: each page copied straight into its own contiguous chunk, which the pool then copies
        # once into its slab (gathering the batch at once and splitting it costs a copy more)
        return [self.page_view(start).contiguous().view(kv.dtype) if start is not None
                else gather(kv, slots[i * P:(i + 1) * P], self.layout)
                for i, start in enumerate(self.page_starts(slots))]
