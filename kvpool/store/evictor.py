"""Watermarks and the background evictor thread: when a tier is fuller than its high watermark,
chunks move down or leave until it is at its low one."""

from __future__ import annotations

from kvpool.errors import PoolFull


class EvictorMixin:
    # ------------------------------------------------------------------ watermarks

    def occupancy(self, tier: int = 0) -> float:
        return self._cache.tier_used(tier) / max(self._cache.tier_pages[tier], 1)

    def evict_to_low_watermark(self) -> int:
        """Makes room in every tier above its high watermark until it is at its low one; returns
        how many chunks moved down or left. What the background evictor runs."""
        high, low = self.config.watermarks
        done = 0
        with self._lock:
            for t in range(len(self._slabs)):
                if self.occupancy(t) <= high:
                    continue
                while self.occupancy(t) > low:
                    try:
                        self._cache._make_room(t)
                    except PoolFull:
                        break
                    done += 1
        return done

    def _maybe_wake_evictor(self) -> None:
        if self._evictor is not None and self.occupancy(0) > self.config.watermarks[0]:
            self._wake.notify()

    def _evict_loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait(timeout=1.0)
                if self._closing:
                    return
            self.evict_to_low_watermark()
