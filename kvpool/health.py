"""Health figures of a pool and their verdicts against the ranges operators run pools in.

Every figure is computed over a window (between two samples), compared with its healthy range
and reported with a verdict, not merely exported:

| figure | healthy |
|---|---|
| chunk hit rate, warm traffic | > 99% |
| evictions per second, as a fraction of all pages | < 1% |
| active-request occupancy (pages leased by requests in flight) | 30% - 70% |
| requests cancelled for memory, per GPU-hour (per shard-hour) | < 1 |

Occupancy by zone (pinned / LRU / window, from the policy) and by tier is reported alongside.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

HEALTHY_RANGES: dict[str, tuple[float | None, float | None]] = {
    "hit_rate": (0.99, None),
    "evictions_per_s_fraction": (None, 0.01),
    "active_occupancy": (0.30, 0.70),
    "cancellations_per_hour": (None, 1.0),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    figure: str
    value: float | None
    low: float | None
    high: float | None

    @property
    def ok(self) -> bool:
        if self.value is None:  # nothing to judge yet (no traffic in the window)
            return True
        return (self.low is None or self.value >= self.low) and (self.high is None or self.value <= self.high)

    def __str__(self) -> str:
        rng = f"{'' if self.low is None else f'>= {self.low:g}'}{' and ' if self.low is not None and self.high is not None else ''}{'' if self.high is None else f'<= {self.high:g}'}"
        val = "n/a" if self.value is None else f"{self.value:.4g}"
        return f"{self.figure:<26}{val:>10}  healthy {rng:<18}{'ok' if self.ok else 'OUT OF RANGE'}"


def judge(figures: dict[str, float | None]) -> list[Verdict]:
    return [Verdict(name, figures.get(name), lo, hi) for name, (lo, hi) in HEALTHY_RANGES.items()]


class HealthMonitor:
    """Samples a store's counters; each ``sample()`` returns the figures since the previous one."""

    def __init__(self, store, clock=time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self._last = self._counters()

    def _counters(self) -> dict:
        m = self.store.metrics
        return {
            "t": self.clock(),
            "hits": m.hits_chunks.total(),
            "misses": m.misses_chunks.total(),
            "evictions": m.evictions.total(),
            "cancelled": m.cancelled_requests.total(),
        }

    def sample(self) -> dict:
        now = self._counters()
        prev, self._last = self._last, now
        dt = max(now["t"] - prev["t"], 1e-9)
        looked = (now["hits"] - prev["hits"]) + (now["misses"] - prev["misses"])
        stats = self.store.stats()
        pages = sum(t["pages_total"] for t in stats["tiers"].values())
        leased = sum(len(r.nodes) for r in self.store.active_requests())
        figures = {
            "hit_rate": (now["hits"] - prev["hits"]) / looked if looked else None,
            "evictions_per_s_fraction": (now["evictions"] - prev["evictions"]) / dt / max(pages, 1),
            "active_occupancy": leased / max(pages, 1),
            "cancellations_per_hour": (now["cancelled"] - prev["cancelled"]) / dt * 3600,
            "window_s": dt,
            "occupancy_by_tier": {n: t["pages_used"] / max(t["pages_total"], 1) for n, t in stats["tiers"].items()},
            "occupancy_by_zone": stats["policy_stats"],
        }
        figures["verdicts"] = judge(figures)
        return figures


def figures_from_stats(shards: list[dict]) -> dict:
    """The health figures of a pool from its shards' ``stats()`` (each with ``uptime_s`` and
    ``active_requests``), over each shard's life so far: what ``kvpool stats`` judges.

    A figure with nothing to judge is ``None`` (ok): no lookups yet for the hit rate, no request
    in flight for the active occupancy (an idle pool is not unhealthy)."""

    def total(s: dict, name: str) -> float:
        return float(sum(s["metrics"].get(name, {}).values()))

    hits = sum(total(s, "hits_chunks") for s in shards)
    misses = sum(total(s, "misses_chunks") for s in shards)
    pages = sum(t["pages_total"] for s in shards for t in s["tiers"].values())
    leased = sum(t.get("leased_pages", 0) for s in shards for t in s["tiers"].values())
    hours = sum(max(s.get("uptime_s", 0.0), 1e-9) for s in shards) / 3600
    active = sum(s.get("active_requests", 0) for s in shards)
    figures = {
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "evictions_per_s_fraction": sum(total(s, "evictions") / max(s.get("uptime_s", 0.0), 1e-9) for s in shards)
        / max(pages, 1),
        "active_occupancy": leased / max(pages, 1) if active else None,
        "cancellations_per_hour": sum(total(s, "cancelled_requests") for s in shards) / hours if shards else None,
    }
    figures["verdicts"] = judge(figures)
    return figures

