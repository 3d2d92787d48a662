"""The cache's hooks: what the store does with the bytes when the cache demotes, promotes or drops
a chunk (copying, verifying, scrubbing, refunding)."""

from __future__ import annotations

import numpy as np

from kvpool.cache import CacheHooks
from kvpool.checksum import copy_with_checksum


class HooksMixin(CacheHooks):
    # ------------------------------------------------------------------ cache hooks (lock held)

    def move(self, node: int, src_tier: int, src_page: int, dst_tier: int, dst_page: int) -> bool:
        if src_tier == 0:
            self._unshow(node)  # before the page it leaves is scrubbed or reused
        nb = int(self._nbytes[node])
        src = self._slabs[src_tier].page(src_page)[:nb]
        dst = self._slabs[dst_tier].page(dst_page)[:nb]
        if dst_tier > src_tier:  # demotion: verified when it is read back
            np.copyto(dst, src)
            self.metrics.demotions.inc(1, self.tier_names[src_tier])
        else:
            if copy_with_checksum(dst, src) != int(self._checksum[node]):
                return False
            self.metrics.promotions.inc(1, self.tier_names[dst_tier])
            if dst_tier == 0:
                self._show(node, dst_page)
        if self._scrubs(node):
            self._slabs[src_tier].page(src_page).fill(0)  # the page it left is free now
        return True

    def _scrubs(self, node: int) -> bool:
        """Whether the page a node frees must be zeroed: its owner's tenant asks for it. A page not
        yet ready belongs to its writer (set at insert) and may hold part of its bytes already."""
        return self.tenants.by_index(int(self._tenant[node])).scrub

    def dropped(self, node: int, tier: int, page: int, reason: str) -> None:
        self._unshow(node)  # before the page is scrubbed or reused
        name = self.tier_names[tier]
        if reason == "evicted":
            self.metrics.evictions.inc(1, name)
        elif reason == "corrupt":
            self.metrics.checksum_failures.inc(1, name)
        if self._scrubs(node):
            self._slabs[tier].page(page).fill(0)  # the whole page: no byte of it says anything
        if self._ready[node]:
            self.tenants.refund(int(self._tenant[node]), int(self._nbytes[node]))
            if self.track_gone:
                self._gone.append(self._cache.node_key[node])
        self._ready[node] = False
        self._doomed[node] = False
        self._nbytes[node] = 0
