"""The KV spec: what a chunk's bytes mean, and the fingerprint that keeps layouts apart.

Two engines whose KV layouts differ (model, revision, weights, what each layer's KV is, shape,
dtype, chunk size or storage format) get different fingerprints, so their keys never meet and
neither can read the other's bytes.

Layer kinds (``KVSpec.layer_kinds``, one per layer; empty means every layer is ``full``):

- ``full``: causal attention over the whole prefix;
- ``sliding:W``: attention over the last ``W`` positions (Mistral, Gemma 2/3, Phi-3);
- ``chunked:W``: attention within aligned blocks of ``W`` positions (Llama 4's local layers);
- ``latent``: one compressed vector and a rope key per token (MLA as vLLM and SGLang cache it);
- ``state``: no KV: (part of) a recurrent layer's state at the chunk's end, flattened into the
  layer's ``[2, chunk_tokens, kv_heads, head_dim]`` (kvpool.connectors.hf_state).

A chunk always holds the KV of its tokens for *every* layer, whatever the layer's kind: the KV
of a token depends only on the tokens before it, so a chunk means the same bytes whether or not
the engine that wrote it still needed that layer's copy. The kind matters for the fingerprint
(the same weights with another window compute other KV downstream) and for what an engine may
skip when it loads. K and V may have different widths (``v_head_dim``): a latent layer as
transformers caches it holds one 512-wide latent and one 64-wide rope key per token (DeepSeek-V3),
and older releases cached MLA per head with K 192 and V 128 wide. Such a chunk is ``[layers,
chunk_tokens, kv_heads, head_dim + v_head_dim]`` (K then V on the last axis).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack
import xxhash

from kvpool.errors import BadRequest

# Bytes per element of each dtype a raw chunk may hold.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# Storage formats; anything but "raw" is LOSSY and OPT-IN: chunks are quantized on save and
# dequantized on load (kvpool.codec, with kvpool.kernels.quant), so a load returns close to, not
# exactly, the KV saved. The format is in the fingerprint: chunks of two formats never meet.
STORAGE_FORMATS = ("raw", "fp8", "int8", "int4-kivi", "int2-kivi")

# Where background eviction starts, by storage format: smaller pages fragment less, so a pool of
# them can run fuller before a put risks waiting for room.
DEFAULT_HIGH_WATERMARK = {"raw": 0.90, "fp8": 0.95, "int8": 0.95, "int4-kivi": 0.97, "int2-kivi": 0.97}

# Bumped whenever the chunk layout or the key derivation changes meaning.
FORMAT_VERSION = 3  # 2: block_size left out of the fingerprint; 3: layer kinds, V width, weights

LAYER_KINDS = ("full", "sliding", "chunked", "latent", "state")  # "sliding" and "chunked" take ":W"


def check_layer_kind(kind: object) -> str:
    """``kind`` if it is a layer kind (``full``, ``sliding:W``, ``chunked:W``, ``latent``, ``state``)."""
    if isinstance(kind, str):
        name, _, size = kind.partition(":")
        if name in ("full", "latent", "state") and not size:
            return kind
        if name in ("sliding", "chunked") and size.isdigit() and int(size) > 0 and size[0] != "0":
            return kind
    raise BadRequest(f"layer kind {kind!r} is not one of 'full', 'sliding:W', 'chunked:W', 'latent', 'state' "
                     "(W a positive int)")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Layout of the KV cache one engine stores: a chunk is ``[layers, 2, chunk_tokens, kv_heads,
    head_dim]`` of ``dtype`` (K then V), in ``storage_format``; ``[layers, chunk_tokens, kv_heads,
    head_dim + v_head_dim]`` when V is narrower or wider than K.

    ``weights`` names the weights themselves (a content fingerprint of the checkpoint, see
    :mod:`kvpool.connectors.weights`): two checkpoints under one name and shape never share.
    ``engine`` is empty for a family whose KV every engine computes alike (checked by the
    cross-engine tests), else the engine's name: its chunks stay its own.
    ``layer_kinds`` and ``v_head_dim`` are normalised (all-``full`` kinds to ``()``, a V width
    equal to K's to 0) so engines that describe the same layout in more or fewer words agree."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16
    chunk_tokens: int = 256
    storage_format: str = "raw"
    model_revision: str = "main"
    weights: str = ""
    layer_kinds: tuple[str, ...] = ()
    v_head_dim: int = 0
    engine: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise BadRequest(
                f"KVSpec.model_id must be the model's name, e.g. 'meta-llama/Llama-3-8B', got {self.model_id!r}"
            )
        if not isinstance(self.model_revision, str) or not self.model_revision:
            raise BadRequest(
                f"KVSpec.model_revision must be a non-empty string (default 'main'), got {self.model_revision!r}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadRequest(f"KVSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise BadRequest(f"KVSpec.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if not isinstance(self.storage_format, str) or self.storage_format not in STORAGE_FORMATS:
            raise BadRequest(
                f"KVSpec.storage_format {self.storage_format!r} is not one of {STORAGE_FORMATS}"
            )
        if not isinstance(self.engine, str):
            raise BadRequest(f"KVSpec.engine must be a string ('' when engines share chunks), got {self.engine!r}")
        if not isinstance(self.weights, str):
            raise BadRequest(f"KVSpec.weights must be the weights' fingerprint as a string, got {self.weights!r}")
        if isinstance(self.layer_kinds, (str, bytes)) or not isinstance(self.layer_kinds, (tuple, list)):
            raise BadRequest(f"KVSpec.layer_kinds is a sequence of one kind per layer, got {self.layer_kinds!r}")
        kinds = tuple(check_layer_kind(k) for k in self.layer_kinds)
        if kinds and len(kinds) != self.num_layers:
            raise BadRequest(f"KVSpec.layer_kinds names {len(kinds)} layers but num_layers is {self.num_layers}")
        object.__setattr__(self, "layer_kinds", () if all(k == "full" for k in kinds) else kinds)
        v = self.v_head_dim
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise BadRequest(f"KVSpec.v_head_dim must be an int >= 0 (0: as wide as K), got {v!r}")
        object.__setattr__(self, "v_head_dim", 0 if v == self.head_dim else v)
        if self.v_head_dim and self.storage_format != "raw":
            raise BadRequest(f"storage format {self.storage_format!r} needs K and V of one width; use 'raw' for "
                             "a model whose V head dim differs from K's")
        if self.storage_format != "raw" and self.dtype.startswith("float8"):
            raise BadRequest(f"storage format {self.storage_format!r} quantizes float32, float16 or bfloat16 KV; "
                             f"a {self.dtype} cache is stored 'raw'")
        if self.chunk_tokens % self.block_size:
            raise BadRequest(
                f"KVSpec.chunk_tokens ({self.chunk_tokens}) must be a multiple of the engine's "
                f"block_size ({self.block_size}) so chunks hold whole blocks"
            )

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """Shape of one raw chunk: ``(layers, 2, chunk_tokens, kv_heads, head_dim)``, or ``(layers,
        chunk_tokens, kv_heads, head_dim + v_head_dim)`` when K and V differ in width."""
        if self.v_head_dim:
            return (self.num_layers, self.chunk_tokens, self.num_kv_heads, self.head_dim + self.v_head_dim)
        return (self.num_layers, 2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    def kind(self, layer: int) -> str:
        """What layer ``layer``'s KV is (see the module docstring)."""
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one raw chunk (before any quantization)."""
        n = DTYPE_BYTES[self.dtype]
        for d in self.chunk_shape:
            n *= d
        return n

    def fingerprint(self) -> bytes:
        """16 stable bytes naming this layout: the same on every machine and Python run.

        NOTE: the engine's ``block_size`` is left out: a chunk's bytes are in the canonical layout
        whatever paging the engine used, so vLLM (blocks of 16 or 32) and transformers (no blocks)
        hit each other's chunks of the same model, dtype and chunk size."""
        fields = [list(v) if isinstance(v, tuple) else v
                  for f in dataclasses.fields(self) if f.name != "block_size" for v in [getattr(self, f.name)]]
        return xxhash.xxh3_128_digest(msgpack.packb([FORMAT_VERSION, *fields]))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_kinds"] = list(self.layer_kinds)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "KVSpec":
        if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
            raise BadRequest(f"a KVSpec is read from a dict of its fields, got {type(data).__name__}")
        fields = dataclasses.fields(cls)
        unknown = set(data) - {f.name for f in fields}
        if unknown:
            raise BadRequest(f"unknown KVSpec fields {sorted(unknown)}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise BadRequest(f"KVSpec fields {missing} are missing: give every field without a default")
        return cls(**data)
