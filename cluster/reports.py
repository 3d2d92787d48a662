"""The engines' latest reports (their connectors' measured figures), kept where `kvpool stats` reads
them: the controller on a Ray pool, the shard process itself on a single-node pool."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvpool.controller")


class Reports:
    """The engines' latest reports, one per engine name. A report carries an engine's counts since
    it started (cumulative), so the latest replaces the one before: nothing is ever summed over
    reports.

    An engine that stops reporting (its process killed) stays listed: ``live()`` marks it
    ``silent`` once it missed ``SILENT_INTERVALS`` of its own report intervals (``every_s`` in its
    figures), with ``silent_s`` since its last report. It is forgotten at its goodbye (a connector
    that shut down cleanly, or an operator's `kvpool stats --forget NAME`), or after
    ``FORGET_AFTER_S`` without a report. A full table makes room by forgetting the engine silent the
    longest; with none silent, a new engine is refused (counted)."""

    SILENT_INTERVALS = 3
    FORGET_AFTER_S = 24 * 3600.0
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
                return
            now = self._clock()
            if name not in self._by_name and len(self._by_name) >= self.MAX_ENGINES and not self._make_room(now):
                self.refused += 1  # the shards cap each tenant's; this caps them all
                return
            self._by_name[name] = {**figures, "reported_at": now}

    def _silent(self, f: dict, now: float) -> bool:
        every = f.get("every_s")
        return (isinstance(every, (int, float)) and not isinstance(every, bool) and every > 0
                and now - f["reported_at"] > self.SILENT_INTERVALS * float(every))

    def _make_room(self, now: float) -> bool:
        silent = [(f["reported_at"], n) for n, f in self._by_name.items() if self._silent(f, now)]
        if not silent:
            return False
        _, name = min(silent)
        del self._by_name[name]
        self.expired += 1
        return True

    def live(self) -> dict:
        """Every engine listed: its latest figures, ``reported_at``, ``silent_s`` (seconds since
        that report) and ``silent``."""
        now = self._clock()
        with self._lock:
            for name, f in list(self._by_name.items()):
                if now - f["reported_at"] > self.FORGET_AFTER_S:
                    del self._by_name[name]
                    self.expired += 1
                    log.info("controller: engine %r silent for %.0f s: forgotten", name, now - f["reported_at"])
            return {name: {**f, "silent_s": round(now - f["reported_at"], 1), "silent": self._silent(f, now)}
                    for name, f in self._by_name.items()}
