"""Inspection: where chunks are, what the index should hold, bookkeeping sizes and stats."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import BadRequest
from kvpool.keys import ChunkKey, as_key
from kvpool.slab import Slab


class InspectionMixin:
    # ------------------------------------------------------------------ inspection

    def locate(self, key: ChunkKey) -> tuple[str, int] | None:
        """(tier name, page) of a resident chunk, for operators and tests; no tenant check."""
        node = self._cache.index.get(as_key(key))
        if node is None or not self._ready[node]:
            return None
        return self.tier_names[self._cache.node_tier[node]], self._cache.node_page[node]

    def take_gone(self) -> list[ChunkKey]:
        """Chunks that were findable and are not any more (evicted, removed, corrupt) since the
        last call: what the shard removes from the index."""
        with self._lock:
            gone, self._gone = self._gone, []
            return gone

    def index_entries(self, shard: str, keys: Sequence[ChunkKey] | None = None) -> list:
        """What this store holds (of ``keys``, or all), as index entries of ``shard``: what it
        publishes, and what it republishes when the index is rebuilt (reconcile)."""
        from kvpool.index.base import IndexEntry

        with self._lock:
            c = self._cache
            pairs = c.index.items() if keys is None else ((k, c.index.get(k)) for k in keys)
            return [
                IndexEntry(key, shard, self.tier_names[c.node_tier[n]], int(self._nbytes[n]),
                           self.tenants.by_index(int(self._tenant[n])).id, int(self._checksum[n]))
                for key, n in pairs if n is not None and self._ready[n]
            ]

    def attach_table(self, table) -> None:
        """Lists this store's ready DRAM chunks in ``table`` from now on (kvpool.node.table), those
        held already included."""
        with self._lock:
            self.table = table
            for node in self._cache.index.values():
                self._show(node)

    def slab(self, tier: str) -> Slab:
        for s in self._slabs:
            if s.tier == tier:
                return s
        raise BadRequest(f"no tier named {tier!r}; tiers: {self.tier_names}")

    def __len__(self) -> int:
        return len(self._cache.index)

    def metadata_bytes(self) -> int:
        """Bookkeeping bytes: per-node arrays, the cache's lists and the index."""
        cache = self._cache
        n = cache.capacity
        arrays = sum(a.nbytes for a in (self._nbytes, self._checksum, self._tenant, self._shared, self._ready, self._doomed))
        lists = 8 * n * 24  # node tables, residency and policy links: ~24 list slots per node
        keys = (49 + 28 + 3 * 8 * 3 // 2) * len(cache.index)  # key object, index entry, dict slack
        return arrays + lists + keys

    def stats(self) -> dict:
        with self._lock:
            cache = self._cache
            tiers = {}
            for t, s in enumerate(self._slabs):
                nodes = [n for n, k in enumerate(cache.node_key) if k is not None and cache.node_tier[n] == t]
                used = int(self._nbytes[nodes].sum()) if nodes else 0
                tiers[s.tier] = {
                    "page_bytes": s.page_bytes,
                    "pages_total": s.num_pages,
                    "pages_used": cache.tier_used(t),
                    "chunks": len(nodes),
                    "bytes": used,
                    "leased_pages": sum(1 for n in nodes if cache.res.leases[n]),
                }
                self.metrics.bytes.set(used, s.tier)
                self.metrics.chunks.set(len(nodes), s.tier)
            self.metrics.lease_waits.set_total(cache.res.lease_skips)
            tenants = {}
            for ten in self.tenants:
                used = self.tenants.usage(ten.id)
                tenants[ten.id] = {"bytes": used, "quota_bytes": ten.quota_bytes, "priority": ten.priority}
                self.metrics.tenant_bytes.set(used, ten.id)
            return {
                "tiers": tiers, "tenants": tenants, "chunks": len(cache.index), "policy": self.config.policy,
                "policy_stats": cache.policies[0].stats(), "metrics": self.metrics.snapshot(),
            }
