"""Chunks of a parallel engine: what one rank of a tensor- or pipeline-parallel engine stores and
reads, in a form any other parallel layout reads too.

A chunk ``[layers, 2, tokens, kv_heads, head_dim]`` (or ``[layers, tokens, kv_heads, K+V]``) is
stored as **slices**: one per KV head of the model and per pipeline stage's layer range, each
``[stage layers, 2, tokens, 1, head_dim]`` under its own key, derived from the chunk's key, the
head and the layer range (:func:`slice_key`). The chunk's key, and so every slice's, never holds
the tensor-parallel size: a rank of an engine at TP=2 writes the slices of its heads, and a rank at
TP=1, 4 or 8 reads the slices of the heads it holds, bytes verified per slice by the store.

- **Tensor parallel**: the model's ``H`` KV heads are split over the ``tp`` ranks as the engines
  split them: ``H/tp`` consecutive heads per rank when ``tp <= H``; with more ranks than heads
  (``tp % H == 0``) each head is replicated on ``tp/H`` consecutive ranks, and only the first of
  them writes it (stored once, not per rank).
- **Pipeline parallel**: each stage holds a layer range; its slices carry that range. The ranges
  are the engine's (``stages``); a stage never reads another's layers.
- **A hit is every slice**: a chunk is in the pool for a request only when all ``H x stages``
  slices are (:meth:`Slicing.all_keys`, asked once by whoever plans the request for every rank):
  a missing or corrupt slice is a miss of the whole chunk for every rank, and the engine
  recomputes it. What a rank cannot read makes its load fail, which the engine turns into the
  same recompute on every rank.

Cost against per-rank slices (what Mooncake Store and LMCache keep): the same bytes moved per rank
and one copy each way, but ``H`` index entries per chunk and stage instead of ``tp``.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvpool.errors import BadRequest
from kvpool.keys import ChunkKey
from kvpool.spec import KVSpec

SLICE_SCHEME = b"kvpool/slice/v1\0"  # names this derivation: a change of scheme misses, never collides


def slice_key(key: ChunkKey, head: int, layers: tuple[int, int]) -> ChunkKey:
    """The key of one head's slice of ``key``'s chunk over ``layers`` ([first, end)); a shared
    chunk's slices are shared keys."""
    raw = xxhash.xxh3_128_digest(SLICE_SCHEME + bytes(key) + struct.pack(">III", head, *layers))
    return type(key)(raw)


def tp_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[range, bool]:
    """(the model's KV heads rank ``tp_rank`` of ``tp_size`` holds, whether it writes them)."""
    h, tp, r = num_kv_heads, tp_size, tp_rank
    if not 0 <= r < tp:
        raise BadRequest(f"tensor-parallel rank {r} is not in [0, {tp})")
    if tp <= h:
        if h % tp:
            raise BadRequest(f"{h} KV heads do not split evenly over tensor_parallel_size={tp}: pick a TP size "
                             f"that divides {h}")
        per = h // tp
        return range(r * per, (r + 1) * per), True
    if tp % h:
        raise BadRequest(f"tensor_parallel_size={tp} is not a multiple of the model's {h} KV heads: pick one that is")
    replicas = tp // h
    head = r // replicas
    return range(head, head + 1), r % replicas == 0


@dataclass(frozen=True)
class Slicing:
    """One rank's part of every chunk: its KV heads and its pipeline stage's layers."""

    num_layers: int
    num_kv_heads: int
    tp_size: int = 1
    tp_rank: int = 0
    stages: tuple[tuple[int, int], ...] = ()  # each stage's [first, end) layers; () is one stage
    pp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise BadRequest(f"Slicing.{name} must be a positive int, got {v!r}")
        stages = tuple((int(a), int(b)) for a, b in self.stages) or ((0, self.num_layers),)
        if stages[0][0] != 0 or stages[-1][1] != self.num_layers or any(
                a >= b or b != stages[i + 1][0] for i, (a, b) in enumerate(stages[:-1])) or stages[-1][0] >= \
                stages[-1][1]:
            raise BadRequest(f"pipeline stages {list(stages)} do not cover layers 0..{self.num_layers} in order, "
                             "each with at least one layer")
        if not 0 <= self.pp_rank < len(stages):
            raise BadRequest(f"pipeline rank {self.pp_rank} is not in [0, {len(stages)})")
        object.__setattr__(self, "stages", stages)
        tp_heads(self.num_kv_heads, self.tp_size, self.tp_rank)  # checks the split

    @classmethod
    def of(cls, spec: KVSpec, tp_size: int = 1, tp_rank: int = 0, stages: Sequence[tuple[int, int]] = (),
           pp_rank: int = 0) -> "Slicing":
        return cls(spec.num_layers, spec.num_kv_heads, tp_size, tp_rank, tuple(stages), pp_rank)

    @property
    def heads(self) -> range:
        """The model's KV heads this rank holds (in the order of its cache's head axis)."""
        return tp_heads(self.num_kv_heads, self.tp_size, self.tp_rank)[0]

    @property
    def writes(self) -> bool:
        """Whether this rank stores its slices (the first of a replicated head's ranks does)."""
        return tp_heads(self.num_kv_heads, self.tp_size, self.tp_rank)[1]

    @property
    def layers(self) -> tuple[int, int]:
        return self.stages[self.pp_rank]

    @property
    def whole(self) -> bool:
        """One rank holds the whole chunk (no slicing needed)."""
        return self.tp_size == 1 and len(self.stages) == 1

    def keys(self, chunk_keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """This rank's slice keys, chunk by chunk, its heads in order within each."""
        return [slice_key(k, h, self.layers) for k in chunk_keys for h in self.heads]

    def all_keys(self, chunk_keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Every slice of every chunk, chunk by chunk: the leading run of them the pool holds,
        divided by :attr:`per_chunk`, is the number of leading chunks every rank can load."""
        return [slice_key(k, h, st) for k in chunk_keys for st in self.stages for h in range(self.num_kv_heads)]

    @property
    def per_chunk(self) -> int:
        return self.num_kv_heads * len(self.stages)

    def slice_spec(self, spec: KVSpec) -> KVSpec:
        """The spec of this rank's slices: one head, its stage's layers (sizes and codec; their
        keys come from the whole model's chunk keys, :func:`slice_key`)."""
        a, b = self.layers
        kinds = spec.layer_kinds[a:b] if spec.layer_kinds else ()
        return dataclasses.replace(spec, num_layers=b - a, num_kv_heads=1, layer_kinds=kinds)

    def split(self, chunk) -> list:
        """This rank's part of a chunk (its stage's layers, its heads on the head axis, the one
        before last) as one contiguous slice per head, in :meth:`keys` order."""
        n = len(self.heads)
        if chunk.shape[-2] != n or chunk.shape[0] != self.layers[1] - self.layers[0]:
            raise BadRequest(f"a rank's chunk of shape {tuple(chunk.shape)} is not its {self.layers[1] - self.layers[0]}"
                             f" layers and {n} heads")
        return [chunk[..., i: i + 1, :].contiguous() for i in range(n)]

    def merge(self, slices: Sequence) -> object:
        """The inverse of :meth:`split`: this rank's heads of a chunk, from its slices in order."""
        if len(slices) != len(self.heads):
            raise BadRequest(f"{len(slices)} slices for {len(self.heads)} heads")
        import torch

        return torch.cat(list(slices), dim=-2)
