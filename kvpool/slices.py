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

Every connector opens its pool as a :class:`SlicedPool` (``kvpool.connectors.pools.open_pool``),
so one form is stored whatever the engine and its parallel layout: a transformers process, vLLM at
TP=1 and vLLM at TP=2 read each other's chunks.

Cost against per-rank slices (what Mooncake Store and LMCache keep): the same bytes moved per rank,
``H`` index entries per chunk and stage instead of ``tp``, and, for a rank that holds more than one
head, a verification and a copy call per head (the vLLM worker scatters each slice straight into
its head: 1.17-1.23x of a per-rank load; ``load`` merges them into one chunk of the rank's heads,
1.5-1.6x; ``kvpool bench slices``, docs/benchmarks.md).
The store's hit and miss token counts are per slice (a chunk of ``H`` heads counts ``H`` times).
"""

from __future__ import annotations

import dataclasses
import struct
import threading
from collections.abc import Iterator, Sequence
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
        return self.rank_spec(spec, heads=1)

    def rank_spec(self, spec: KVSpec, heads: int | None = None) -> KVSpec:
        """The spec of this rank's part of a chunk: its stage's layers, its heads."""
        a, b = self.layers
        kinds = spec.layer_kinds[a:b] if spec.layer_kinds else ()
        return dataclasses.replace(spec, num_layers=b - a, num_kv_heads=heads or len(self.heads), layer_kinds=kinds)

    def split(self, chunk) -> list:
        """This rank's part of a chunk (its stage's layers, its heads on the head axis, the one
        before last) as one contiguous slice per head, in :meth:`keys` order."""
        n = len(self.heads)
        if chunk.shape[-2] != n or chunk.shape[0] != self.layers[1] - self.layers[0]:
            raise BadRequest(f"a rank's chunk of shape {tuple(chunk.shape)} is not its {self.layers[1] - self.layers[0]}"
                             f" layers and {n} heads")
        return [chunk[..., i: i + 1, :].contiguous() for i in range(n)]


class SlicedPool:
    """A pool (``LocalPool`` or ``NodePool``) that stores a rank's chunks as :class:`Slicing`'s slices:
    the same surface (keys, lookup, begin, save, load, load_views, end), in whole chunks of this
    rank (``[stage layers, 2, tokens, its heads, head_dim]``). ``part`` is opened with
    ``slicing.slice_spec(spec)`` and ``keyed_as=spec``, so its keys are the whole chunks' keys."""

    def __init__(self, part, spec: KVSpec, slicing: Slicing) -> None:
        assert part.spec == slicing.slice_spec(spec), "open the part pool with slicing.slice_spec(spec)"
        self.part, self.spec, self.slicing = part, spec, slicing
        self._n = len(slicing.heads)
        self._local = threading.local()  # the two merge buffers of load_views, per thread

    def __getattr__(self, name: str):
        if name in _PASSED:  # the pool's own surface that does not read or write chunks
            return getattr(self.part, name)
        raise AttributeError(f"{type(self).__name__} has no {name!r} (a pool call on chunks goes through its slices)")

    @property
    def takes_attention(self) -> bool:
        """Whether ``save`` takes per-chunk attention mass (the local pool's does)."""
        import inspect

        return "attention" in inspect.signature(self.part.save).parameters

    def addresses(self, tenant: str, keys: Sequence[ChunkKey]) -> list[list[ChunkKey]]:
        """Where the store keeps this rank's slices of each of ``keys`` (tools and tests that look
        inside the store), chunk by chunk."""
        where, n = self.part.addresses(tenant, self.slicing.keys(list(keys))), self._n
        return [where[i: i + n] for i in range(0, len(where), n)]

    def keys(self, tenant: str, tokens: object, **kw) -> list[ChunkKey]:
        return self.part.keys(tenant, tokens, **kw)

    def lookup(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Tokens of the leading chunks whose every slice (every rank's, every stage's) the pool holds."""
        keys = list(keys)
        if not keys:
            return 0
        held = self.part.lookup(tenant, self.slicing.all_keys(keys)) // self.spec.chunk_tokens
        return held // self.slicing.per_chunk * self.spec.chunk_tokens

    def locate(self, tenant: str, keys: Sequence[ChunkKey]) -> tuple[list[frozenset[str]], str | None]:
        """(the shards holding the slices of each leading chunk whose every slice the pool holds,
        the index's error when it could not answer): where a router finds a prompt's prefix."""
        keys, per = list(keys), self.slicing.per_chunk
        if not keys:
            return [], None
        hit = self.part.locate(tenant, self.slicing.all_keys(keys))
        return [frozenset(hit.shards[j * per: (j + 1) * per]) for j in range(hit.count // per)], hit.error

    def lookup_mine(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Tokens of the leading chunks whose slices *this rank* holds (what its own save left in
        the pool; an engine that agrees across ranks takes the least of its ranks')."""
        keys = list(keys)
        if not keys:
            return 0
        held = self.part.lookup(tenant, self.slicing.keys(keys)) // self.spec.chunk_tokens
        return held // self._n * self.spec.chunk_tokens

    def begin(self, tenant: str, keys: Sequence[ChunkKey], priority: str | None = None):
        return self.part.begin(tenant, self.slicing.all_keys(list(keys)), priority)

    def end(self, request) -> None:
        self.part.end(request)

    def pin(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Pins this rank's slices of the leading chunks; how many chunks."""
        return self.part.pin(tenant, self.slicing.keys(list(keys))) // self._n

    def save(self, tenant: str, keys: Sequence[ChunkKey], chunks: Sequence, *, start: int = 0, **kw) -> int:
        """Stores this rank's slices of ``chunks`` (``keys[start:]``); how many chunks' worth of
        slices were written, rounded up (a slice the pool already held is not written again: the
        one that replaces a lost slice counts its chunk). A replica of another rank's heads stores
        nothing (0)."""
        keys = list(keys)
        if not isinstance(start, int) or start < 0 or start + len(chunks) > len(keys):
            raise BadRequest(f"{len(chunks)} chunks from position {start!r} but {len(keys)} keys: pass the keys of "
                             "every chunk up to the last saved, and start= the first saved one's index")
        if not self.slicing.writes:
            return 0
        n = self._n
        pieces = [s for c in chunks for s in self.slicing.split(c)]
        if kw.get("attention") is not None:
            kw["attention"] = [a for a in kw["attention"] for _ in range(n)]
        stored = self.part.save(tenant, self.slicing.keys(keys), pieces, start=start * n, **kw)
        return -(-stored // n)

    def load(self, tenant: str, keys: Sequence[ChunkKey]) -> list:
        """The leading run of this rank's chunks whose slices are stored and verify, each in memory
        of its own (a rank of several heads: each slice copied once, from its verified page into its
        head of the chunk)."""
        if self._n == 1:
            return self.part.load(tenant, self.slicing.keys(list(keys)))
        out = []
        for view in self.load_views(tenant, keys):
            with view:
                out.append(view.kv)
        return out

    def load_views(self, tenant: str, keys: Sequence[ChunkKey]) -> Iterator:
        """:meth:`load` as views (``part.load_views``): a rank of one head gets the part's own views;
        a rank of more gets each chunk merged into memory of its own."""
        return self._views(self._slices(self.part.load_views, tenant, keys), reuse=False)

    def load_views_in_place(self, tenant: str, keys: Sequence[ChunkKey]) -> Iterator:
        """:meth:`load_views` for a caller that copies each chunk out and releases it before asking
        for the next (the vLLM worker), over ``part.load_views_in_place`` where it has one (a slice
        whose release raises, having changed while read, fails the load of its chunk). A rank of
        more than one head gets each chunk merged into one of two buffers this thread reuses (no
        fresh pages per load), valid until it asks for the view after next."""
        return self._views(self.load_slices_in_place(tenant, keys), reuse=True)

    def load_slices_in_place(self, tenant: str, keys: Sequence[ChunkKey]) -> Iterator[tuple[int, int, object]]:
        """(chunk, head of this rank, view) of each of this rank's slices of the leading chunks, in
        order, for a caller that copies each slice straight into its own head (the vLLM worker: no
        merged chunk in between) and releases it before asking for the next (a release that raises
        fails the load from that chunk on). The run stops at the first slice missing or failing its
        checksum: a chunk not all of whose heads came is not loaded."""
        return self._slices(getattr(self.part, "load_views_in_place", self.part.load_views), tenant, keys)

    def _slices(self, read, tenant: str, keys: Sequence[ChunkKey]) -> Iterator[tuple[int, int, object]]:
        views = read(tenant, self.slicing.keys(list(keys)))
        try:
            for i, view in enumerate(views):
                yield (*divmod(i, self._n), view)
        finally:
            views.close()

    def _views(self, slices: Iterator, reuse: bool) -> Iterator:
        """Each chunk whose every slice came, its slices merged into one tensor of the rank's heads
        (a rank of one head: the slice's own view)."""
        from kvpool.pool import OwnedChunk

        last, out = self._n - 1, None
        try:
            for j, h, view in slices:
                if not last:
                    yield view
                    continue
                if h == 0:
                    out = self._buffer(view.kv, j % 2 if reuse else None)
                with view:  # released (verified, for a view in place) once copied
                    out[..., h: h + 1, :].copy_(view.kv)
                if h == last:
                    yield OwnedChunk(out)
        finally:
            slices.close()

    def _buffer(self, kv, which: int | None):
        import torch

        shape = (*kv.shape[:-2], self._n, kv.shape[-1])
        if which is None:
            return torch.empty(shape, dtype=kv.dtype, device=kv.device)
        bufs = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].shape != shape or bufs[0].dtype != kv.dtype:
            bufs = self._local.bufs = [torch.empty(shape, dtype=kv.dtype, device=kv.device) for _ in range(2)]
        return bufs[which]


# What a SlicedPool passes to its part pool as is: nothing of it reads or writes a chunk.
_PASSED = frozenset({"namespace", "client", "report", "stats", "store", "tenants", "secured", "auth",
                     "codec"})  # the slices' codec
