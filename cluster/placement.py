"""Where a node's new chunks go: locality first, load bounded.

An engine's chunks stay on its own node's shard while that shard has free DRAM pages. When it
would have to evict to take them, they go to the shard with the most free pages (measured every
``LOADS_EVERY_S`` in the background) if that one has room for them and at least ``SPILL_MARGIN``
of its DRAM more free than this one; otherwise they stay here and this shard's policy evicts.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvpool.node")
LOADS_EVERY_S = 2.0
SPILL_MARGIN = 0.10


class Placement:
    def __init__(self, shard, pool) -> None:
        self.shard = shard
        self._pool = pool  # the shard's PoolClient, made on first use
        self._others: dict[str, tuple[int, int]] = {}
        self._at = float("-inf")
        self._busy = threading.Lock()

    def spill(self, pages: int) -> str | None:
        """Locality first, load bounded: the shard where ``pages`` new chunks go instead of this
        one, or None to keep them here. They stay here while this node has free pages; when it
        would have to evict, they go to the shard with the most free pages (measured every
        ``LOADS_EVERY_S``) if it has room for them and at least ``SPILL_MARGIN`` of its DRAM more
        free than this one."""
        c = self.shard.store._cache
        free, total = c.tier_pages[0] - c.tier_used(0), max(c.tier_pages[0], 1)
        if free >= pages:
            return None
        loads = self.loads()
        if not loads:
            return None
        sid, theirs = max(loads.items(), key=lambda kv: kv[1][0])
        if theirs[0] >= pages and theirs[0] / max(theirs[1], 1) - free / total >= SPILL_MARGIN:
            return sid
        return None

    def loads(self) -> dict[str, tuple[int, int]]:
        """Other shards' (free, total) DRAM pages, refreshed in the background."""
        now = time.monotonic()
        if now - self._at >= LOADS_EVERY_S and self._busy.acquire(blocking=False):
            self._at = now
            threading.Thread(target=self._refresh, daemon=True, name="kvpool-loads").start()
        return self._others

    def _refresh(self) -> None:
        import ray

        try:
            view = self._pool()._view
            refs = {sid: h.free_pages.remote() for sid, h in view.handles.items() if sid != self.shard.shard_id}
            out = {}
            for sid, ref in refs.items():
                try:
                    out[sid] = (int(ray.get(ref, timeout=1.0)), int(view.shards[sid].get("dram_pages", 0)))
                except Exception:  # noqa: BLE001 - a shard that does not answer takes nothing
                    continue
            self._others = out
        except Exception:  # noqa: BLE001 - placement falls back to this node
            log.exception("node: refreshing the shards' loads failed")
        finally:
            self._busy.release()

