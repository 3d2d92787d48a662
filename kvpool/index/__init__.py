"""The global index: where chunks are, tenant quotas and usage, shard membership, events.

``open_index(None)`` gives the embedded index (one machine, no server); ``open_index(url)`` a
RedisIndex. Both keep one contract (kvpool.index.base.Index).
"""

from __future__ import annotations

from kvpool.index.base import MAX_LOOKUP, Event, Index, IndexEntry, PrefixHit, ReconcileResult, TenantInfo
from kvpool.index.embedded import EmbeddedIndex


def open_index(url: str | None = None, **options) -> Index:
    if not url:
        return EmbeddedIndex()
    from kvpool.index.redis_index import RedisIndex

    return RedisIndex(url, **options)


__all__ = [
    "MAX_LOOKUP", "EmbeddedIndex", "Event", "Index", "IndexEntry", "PrefixHit", "ReconcileResult", "TenantInfo",
    "open_index",
]
