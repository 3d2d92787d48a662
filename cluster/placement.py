"""Where a node's new chunks go: locality first, load bounded.

An engine's chunks stay on its own node's shard while that shard has free DRAM pages. When it
would have to evict to take them, they go to the shard with the most free pages (measured every
``LOADS_EVERY_S`` in the background, cluster.members) if that one has room for them and at least ``SPILL_MARGIN``
of its DRAM more free than this one; otherwise they stay here and this shard's policy evicts.
"""

from __future__ import annotations

SPILL_MARGIN = 0.10


class Placement:
    def __init__(self, service) -> None:
        self.service = service  # cluster.service.ShardService: its store, and the other members' loads

    def spill(self, pages: int) -> str | None:
        """Locality first, load bounded: the shard where ``pages`` new chunks go instead of this
        one, or None to keep them here. They stay here while this node has free pages; when it
        would have to evict, they go to the shard with the most free pages (cluster.members:
        measured in the background) if it has room for them and at least ``SPILL_MARGIN`` of its
        DRAM more free than this one."""
        c = self.service.store._cache
        free, total = c.tier_pages[0] - c.tier_used(0), max(c.tier_pages[0], 1)
        if free >= pages:
            return None
        loads = self.service.members.loads()
        if not loads:
            return None
        sid, theirs = max(loads.items(), key=lambda kv: kv[1][0])
        if theirs[0] >= pages and theirs[0] / max(theirs[1], 1) - free / total >= SPILL_MARGIN:
            return sid
        return None
