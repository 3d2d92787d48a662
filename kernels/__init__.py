"""Triton kernels with PyTorch references: paged copies, KV quantization, eviction scoring.

Installed as ``kvpool.kernels``: pure functions over tensors, no pool state. Every public function
takes ``impl="auto" | "triton" | "torch"``: Triton on a GPU, the PyTorch reference on a CPU (the
Triton kernels also run on a CPU under ``TRITON_INTERPRET=1``, which is how the tests compare them).

- ``paged``: ``gather``/``scatter`` between an engine's paged cache (``layouts.vllm_layout``,
  ``layouts.sglang_layout``) and the pool's chunk layout ``[layers, 2, tokens, kv_heads,
  head_dim]``; ``scrub``/``scrub_blocks`` zero pages for tenants that want no residue.
- ``quant``: ``quantize``/``dequantize`` in ``fp8``, ``int8``, ``int4-kivi``, ``int2-kivi``.
  Lossy, and opt-in: a pool stores raw KV unless its spec names a storage format.
- ``scoring``: ``score``/``select``/``compress`` for ``streaming_llm``, ``h2o``, ``snapkv``,
  ``pyramidkv``, ``adakv``, ``quest``. Token eviction is lossy, and opt-in.
"""

from kvpool.kernels.layouts import PagedLayout, sglang_layout, vllm_layout
from kvpool.kernels.paged import gather, scatter, scrub, scrub_blocks
from kvpool.kernels.quant import FORMATS, QuantizedKV, compression_ratio, dequantize, quantize
from kvpool.kernels.scoring import METHODS, compress, score, select

__all__ = [
    "FORMATS", "METHODS", "PagedLayout", "QuantizedKV", "compress", "compression_ratio", "dequantize", "gather",
    "quantize", "scatter", "score", "scrub", "scrub_blocks", "select", "sglang_layout", "vllm_layout",
]
