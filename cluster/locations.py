"""Where a node's shard last found chunks: a lookup's answer, reused by the load that follows it.

An engine asks "how much of this prompt is cached" (its scheduler's lookup) and then loads it
(its worker's get), two calls that reach the node's shard one after the other. The shard keeps
the lookup's answer (address -> shard) for ``WHERE_S``, so the load goes straight to those shards
without asking the index again. A location that turned out wrong (the chunk moved or was evicted)
is forgotten and the load ends there: a miss, as with a stale index entry.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

WHERE_S = 5.0
WHERE_MAX = 1 << 16


class Locations:
    def __init__(self, ttl_s: float = WHERE_S, limit: int = WHERE_MAX) -> None:
        self.ttl_s, self.limit = ttl_s, limit
        self._where: OrderedDict[bytes, tuple[str, float]] = OrderedDict()  # address -> (shard, until)
        self._lock = threading.Lock()

    def remember(self, addresses, shards) -> None:
        until = time.monotonic() + self.ttl_s
        with self._lock:
            for a, sid in zip(addresses, shards):
                self._where[bytes(a)] = (sid, until)
                self._where.move_to_end(bytes(a))
            while len(self._where) > self.limit:
                self._where.popitem(last=False)

    def recall(self, addresses) -> list[str]:
        """The shards remembered for the leading run of ``addresses``."""
        now, out = time.monotonic(), []
        with self._lock:
            for a in addresses:
                hit = self._where.get(bytes(a))
                if hit is None or hit[1] < now:
                    break
                out.append(hit[0])
        return out

    def forget(self, addresses) -> None:
        with self._lock:
            for a in addresses:
                self._where.pop(bytes(a), None)
