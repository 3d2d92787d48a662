"""Host-side checks of the paged copies' arguments, all made before anything is written.

A slot or page out of range, a duplicate slot in a scatter, a dtype, shape or device mismatch is a
``BadRequest`` naming the fix, and the cache is left untouched: the copies (Triton or PyTorch)
never see an argument these checks have not passed.
"""

from __future__ import annotations

import torch

from kvpool.errors import BadRequest

from .layouts import Geometry, PagedLayout


def chunk_shape(geo: Geometry, tokens: int) -> tuple[int, ...]:
    """The shape ``[L, 2, T, H, D]`` of a chunk of ``tokens`` tokens of this cache."""
    return (geo.num_layers, 2, tokens, geo.kv_heads, geo.head_dim)


def check_chunk(chunk: torch.Tensor, geo: Geometry, tokens: int, what: str) -> None:
    want = chunk_shape(geo, tokens)
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


def check_slots(slots: torch.Tensor, geo: Geometry, layout: PagedLayout, unique: bool) -> torch.Tensor:
    """``slots`` as a contiguous int64 tensor on the cache's device, every one in range (and, when
    ``unique``, none repeated)."""
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


def check_ids(ids: torch.Tensor, limit: int, device: torch.device, where: str, noun: str,
              extent: str) -> torch.Tensor:
    """Page or block ids as a contiguous int64 tensor on ``device``, every one in ``0 .. limit-1``."""
    ids = _as_index(ids, device, f"{where}: {noun} ids")
    _check_range(ids, limit, where, noun, extent)
    return ids
