"""The KV spec: what a chunk's bytes mean, and the fingerprint that keeps layouts apart.

Two engines whose KV layouts differ (model, revision, shape, dtype, block size, chunk size or
storage format) get different fingerprints, so their keys never meet and neither can read the
other's bytes.
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

# Storage formats; anything but "raw" is lossy and opt-in (see kvpool.kernels, quantization).
STORAGE_FORMATS = ("raw", "fp8", "int8", "int4-kivi", "int2-kivi")

# Where background eviction starts, by storage format: smaller pages fragment less, so a pool of
# them can run fuller before a put risks waiting for room.
DEFAULT_HIGH_WATERMARK = {"raw": 0.90, "fp8": 0.95, "int8": 0.95, "int4-kivi": 0.97, "int2-kivi": 0.97}

# Bumped whenever the chunk layout or the key derivation changes meaning.
FORMAT_VERSION = 2  # 2: block_size left out of the fingerprint


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Layout of the KV cache one engine stores: a chunk is ``[layers, 2, chunk_tokens, kv_heads,
    head_dim]`` of ``dtype`` (K then V), in ``storage_format``."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16
    chunk_tokens: int = 256
    storage_format: str = "raw"
    model_revision: str = "main"

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
        if self.chunk_tokens % self.block_size:
            raise BadRequest(
                f"KVSpec.chunk_tokens ({self.chunk_tokens}) must be a multiple of the engine's "
                f"block_size ({self.block_size}) so chunks hold whole blocks"
            )

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one raw chunk: ``(layers, 2, chunk_tokens, kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

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
        fields = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "block_size"]
        return xxhash.xxh3_128_digest(msgpack.packb([FORMAT_VERSION, *fields]))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
