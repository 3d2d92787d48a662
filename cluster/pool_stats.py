"""What `kvpool stats` shows, gathered by a shard of the pool (asked on its node's socket, so the
command needs no Ray and answers in well under a second): every shard's stats, the engines'
reports (one per engine: its latest, never a sum of reports) with each engine's per-tenant
figures beneath it, the tenants' totals over the engines, and the health verdicts."""

from __future__ import annotations

from kvpool.health import figures_from_stats

TENANT_FIGURE = "tenant "  # a report's per-tenant figure: "tenant ID FIGURE" (an id has no space)


def engine_view(figures: dict) -> dict:
    """An engine's report with its flat per-tenant figures gathered under ``tenants``:
    ``{id: {figure: value}}``."""
    out, tenants = {}, {}
    for k, v in figures.items():
        parts = k.split(" ", 2)
        if k.startswith(TENANT_FIGURE) and len(parts) == 3 and isinstance(v, (int, float)) and not isinstance(v, bool):
            tenants.setdefault(parts[1], {})[parts[2]] = v
        else:
            out[k] = v
    if tenants:
        out["tenants"] = {t: tenants[t] for t in sorted(tenants)}
    return out


def tenant_totals(engines: dict[str, dict]) -> dict[str, dict]:
    """Per tenant, each figure summed over the engines listed (each engine's latest report once)."""
    sums: dict[str, dict] = {}
    for e in engines.values():
        for t, figs in (e.get("tenants") or {}).items():
            mine = sums.setdefault(t, {})
            for k, v in figs.items():
                mine[k] = mine.get(k, 0) + v
    return {t: sums[t] for t in sorted(sums)}


def summarize(version: int, shards: dict[str, dict], engines: dict[str, dict], mode: str) -> dict:
    """``shards``: each shard's stats (or ``{"error": ...}`` for one that did not answer);
    ``engines``: their latest reports (kvpool.cluster.reports.Reports.live); ``mode``: "ray" or
    "single-node" (one process, no Ray)."""
    views = {name: engine_view(f) for name, f in sorted(engines.items())}
    out = {"version": version, "mode": mode, "shards": shards, "engines": views, "tenants": tenant_totals(views)}
    live = [s for s in shards.values() if "error" not in s]
    health = figures_from_stats(live)
    out["health"] = [{"figure": v.figure, "value": v.value, "low": v.low, "high": v.high, "ok": v.ok}
                     for v in health["verdicts"]]
    out["health_lines"] = [str(v) for v in health["verdicts"]]
    out["healthy"] = all(v.ok for v in health["verdicts"]) and len(live) == len(shards)
    return out
