"""The engines' latest reports (their connectors' measured figures), kept where `kvpool stats` reads
them: the controller on a Ray pool, the shard process itself on a single-node pool."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvpool.controller")


class Reports:
    """The engines' latest reports. One that has not reported for ``EXPIRE_INTERVALS`` of its own
    report intervals (``every_s`` in its figures; ``LEGACY_TTL_S`` for a connector that reports
    only when it measured something) is dropped: its process is gone. ``{"goodbye": true}`` drops
    it at once (a connector that shut down cleanly)."""

    EXPIRE_INTERVALS = 3
    LEGACY_TTL_S = 600.0
    MAX_ENGINES = 4096

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._by_name: dict[str, dict] = {}
        self._lock = threading.Lock()  # the actor serves calls on several threads
        self.expired = 0
        self.refused = 0

    def add(self, name: str, figures: dict) -> None:
        """``figures["tenant"]``: whose credential sent it (the shards add it); an engine of that
        name reported by another tenant is kept apart, never replaced or said goodbye to."""
        with self._lock:
            old, tenant = self._by_name.get(name), figures.get("tenant")
            if old is not None and tenant is not None and old.get("tenant", tenant) != tenant:
                name = f"{name} [{tenant}]"
            if figures.get("goodbye"):
                self._by_name.pop(name, None)
            elif name in self._by_name or len(self._by_name) < self.MAX_ENGINES:
                self._by_name[name] = {**figures, "reported_at": self._clock()}
            else:
                self.refused += 1  # the shards cap each tenant's; this caps them all

    def live(self) -> dict:
        now = self._clock()
        with self._lock:
            for name, f in list(self._by_name.items()):
                every = f.get("every_s")
                ttl = self.EXPIRE_INTERVALS * float(every) if isinstance(every, (int, float)) and every > 0 \
                    else self.LEGACY_TTL_S
                if now - f["reported_at"] > ttl:
                    del self._by_name[name]
                    self.expired += 1
                    log.info("controller: engine %r stopped reporting %.0f s ago: dropped from the reports", name,
                             now - f["reported_at"])
            return {name: dict(f) for name, f in self._by_name.items()}
