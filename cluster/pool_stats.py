"""What `kvpool stats` shows, gathered by a shard of the pool (asked on its node's socket, so the
command needs no Ray and answers in well under a second): every shard's stats, the engines'
reports and the health verdicts over them."""

from __future__ import annotations

from kvpool.health import figures_from_stats


def summarize(version: int, shards: dict[str, dict], engines: dict[str, dict], mode: str) -> dict:
    """``shards``: each shard's stats (or ``{"error": ...}`` for one that did not answer);
    ``mode``: "ray" or "single-node" (one process, no Ray)."""
    out = {"version": version, "mode": mode, "shards": shards, "engines": engines}
    live = [s for s in shards.values() if "error" not in s]
    health = figures_from_stats(live)
    out["health"] = [{"figure": v.figure, "value": v.value, "low": v.low, "high": v.high, "ok": v.ok}
                     for v in health["verdicts"]]
    out["health_lines"] = [str(v) for v in health["verdicts"]]
    out["healthy"] = all(v.ok for v in health["verdicts"]) and len(live) == len(shards)
    return out
