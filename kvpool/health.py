"""Health figures of a pool and their verdicts against the ranges operators run pools in.

Every figure is computed over a span of time, compared with its healthy range and reported with a
verdict, not merely exported:

| figure | healthy |
|---|---|
| chunk hit rate, warm traffic | > 99% |
| evictions per second, as a fraction of all pages | < 1% |
| active-request occupancy (pages leased by requests in flight) | 30% - 70% |
| requests cancelled for memory, per GPU-hour (per shard-hour) | < 1 |

A figure with nothing to judge is ``None`` (ok): no lookups for the hit rate, no request in flight
for the active occupancy (an idle pool is not unhealthy), no shard for the cancellations.

The figures are computed in one place, ``figures_from_counts``, from one ``Counts`` per store
(shard): its counters over a span of time and its pages at the end of it. ``HealthMonitor`` gives
it one store's counters over a window (between two samples); ``figures_from_stats`` gives it each
shard's counters over its life so far (what ``kvpool stats`` judges). The monitor reports occupancy
by zone (pinned / LRU / window, from the policy) and by tier alongside.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

HEALTHY_RANGES: dict[str, tuple[float | None, float | None]] = {
    "hit_rate": (0.99, None),
    "evictions_per_s_fraction": (None, 0.01),
    "active_occupancy": (0.30, 0.70),
    "cancellations_per_hour": (None, 1.0),
}

# What a figure with no value lacked (its verdict says so instead of a number)
UNMEASURED = {
    "hit_rate": "no chunk read through a shard yet (same-node engines read its shared memory: see their hit rates)",
    "active_occupancy": "no request in flight",
    "cancellations_per_hour": "no shard answered",
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
        verdict = (f"not judged: {UNMEASURED.get(self.figure, 'nothing measured yet')}" if self.value is None else
                   "ok" if self.ok else "OUT OF RANGE")
        return f"{self.figure:<26}{val:>10}  healthy {rng:<18}{verdict}"


def judge(figures: dict[str, float | None]) -> list[Verdict]:
    return [Verdict(name, figures.get(name), lo, hi) for name, (lo, hi) in HEALTHY_RANGES.items()]


@dataclass(frozen=True, slots=True)
class Counts:
    """One store's (a shard's) share of the figures: what its counters counted over ``elapsed_s``
    seconds (chunk hits and misses, evictions, requests cancelled for memory) and, at the end of
    that span, its pages, the pages leased by requests in flight and the number of those requests."""

    elapsed_s: float
    hits: float = 0.0
    misses: float = 0.0
    evictions: float = 0.0
    cancelled: float = 0.0
    pages: int = 0
    leased_pages: int = 0
    active_requests: int = 0


def figures_from_counts(counts: Iterable[Counts], **extra) -> dict:
    """The health figures of the stores whose ``counts`` are given, each over its own span, with
    ``extra`` entries after them and their ``verdicts`` last. Rates are summed over the stores (they
    run side by side); cancellations are per store-hour (per GPU-hour)."""
    counts = list(counts)
    looked = sum(c.hits + c.misses for c in counts)
    pages = max(sum(c.pages for c in counts), 1)
    hours = sum(max(c.elapsed_s, 1e-9) for c in counts) / 3600
    figures = {
        "hit_rate": sum(c.hits for c in counts) / looked if looked else None,
        "evictions_per_s_fraction": sum(c.evictions / max(c.elapsed_s, 1e-9) for c in counts) / pages,
        "active_occupancy": (sum(c.leased_pages for c in counts) / pages
                             if sum(c.active_requests for c in counts) else None),
        "cancellations_per_hour": sum(c.cancelled for c in counts) / hours if counts else None,
        **extra,
    }
    figures["verdicts"] = judge(figures)
    return figures


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
        stats = self.store.stats()
        active = self.store.active_requests()
        window = Counts(
            elapsed_s=dt,
            hits=now["hits"] - prev["hits"],
            misses=now["misses"] - prev["misses"],
            evictions=now["evictions"] - prev["evictions"],
            cancelled=now["cancelled"] - prev["cancelled"],
            pages=sum(t["pages_total"] for t in stats["tiers"].values()),
            leased_pages=len({n for r in active for n in r.nodes}),  # a page two requests share counts once
            active_requests=len(active),
        )
        return figures_from_counts(
            [window],
            window_s=dt,
            occupancy_by_tier={n: t["pages_used"] / max(t["pages_total"], 1) for n, t in stats["tiers"].items()},
            occupancy_by_zone=stats["policy_stats"],
        )


def figures_from_stats(shards: list[dict]) -> dict:
    """The health figures of a pool from its shards' ``stats()`` (each with ``uptime_s`` and
    ``active_requests``), over each shard's life so far: what ``kvpool stats`` judges.

    A figure with nothing to judge is ``None`` (ok): no lookups yet for the hit rate, no request
    in flight for the active occupancy (an idle pool is not unhealthy)."""

    def total(s: dict, name: str) -> float:
        return float(sum(s["metrics"].get(name, {}).values()))

    return figures_from_counts(
        Counts(
            elapsed_s=s.get("uptime_s", 0.0),
            hits=total(s, "hits_chunks"),
            misses=total(s, "misses_chunks"),
            evictions=total(s, "evictions"),
            cancelled=total(s, "cancelled_requests"),
            pages=sum(t["pages_total"] for t in s["tiers"].values()),
            leased_pages=sum(t.get("leased_pages", 0) for t in s["tiers"].values()),
            active_requests=s.get("active_requests", 0),
        )
        for s in shards
    )
