"""The one surface every pool gives an engine connector: ``LocalPool`` (in-process) and
``NodePool`` (a pool of many nodes, through this node's shard) both implement :class:`Pool`, and
``tests/test_pool_contract.py`` runs every case on both, so connectors never branch on which one
they hold."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from kvpool.keys import ChunkKey
from kvpool.spec import KVSpec


class ChunkView(Protocol):
    """A loaded chunk (``kv``, the spec's chunk shape) held until ``release`` (or ``with``)."""

    kv: torch.Tensor

    def release(self) -> None: ...

    def __enter__(self) -> "ChunkView": ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class Pool(Protocol):
    spec: KVSpec

    def keys(self, tenant: str, tokens: object, *, shared: bool = False, adapter_id: str = "",
             extra_keys: Sequence[str | bytes] = ()) -> list[ChunkKey]:
        """The chunk keys of a prompt's whole chunks in the tenant's (or the shared) namespace."""

    def lookup(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Tokens covered by the leading run of cached chunks (no side effects)."""

    def begin(self, tenant: str, keys: Sequence[ChunkKey], priority: str | None = None) -> object:
        """A request starts: its cached leading run is leased until :meth:`end`."""

    def end(self, request: object) -> None:
        """The request ended: its chunks (loaded and saved) may be evicted again."""

    def load(self, tenant: str, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading run of chunks that are stored and verify; anything else ends it (a miss)."""

    def load_views(self, tenant: str, keys: Sequence[ChunkKey]) -> Iterator[ChunkView]:
        """:meth:`load` as views, each the caller's to release."""

    def save(self, tenant: str, keys: Sequence[ChunkKey], chunks: Sequence[torch.Tensor], *, start: int = 0,
             shared: bool = False, request: object | None = None) -> int:
        """Stores the chunks of ``keys[start:]`` (checked first, all or nothing on bad input); with
        ``request`` they stay leased until it ends. How many were stored."""

    def stats(self) -> dict:
        """Store-shaped stats (tiers, tenants, chunks, policy, metrics)."""
