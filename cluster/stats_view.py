"""How `kvpool stats` prints what it gathered (from a Ray pool or a single-node pool alike)."""

from __future__ import annotations

import time

from kvpool.cluster.node_caps import staging_refused


def format_stats(st: dict) -> str:
    lines = [f"membership version {st['version']}, {len(st['shards'])} shards",
             f"{'shard':<20}{'tier':<6}{'chunks':>8}{'MiB':>10}{'pages':>12}{'hit rate':>10}{'evictions':>11}"]
    for sid, s in sorted(st["shards"].items()):
        if "error" in s:
            lines.append(f"{sid:<20}unreachable: {s['error']}")
            continue
        m = s["metrics"]
        hits, misses = sum(m["hits_chunks"].values()), sum(m["misses_chunks"].values())
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "-"
        for tier, t in s["tiers"].items():
            ev = m["evictions"].get(f"tier={tier}", 0)
            lines.append(f"{sid:<20}{tier:<6}{t['chunks']:>8}{t['bytes'] / 2**20:>10.1f}"
                         f"{t['pages_used']:>6}/{t['pages_total']:<5}{rate:>10}{ev:>11.0f}")
        tenants = ", ".join(f"{k} {v['bytes'] / 2**20:.1f} MiB" for k, v in s["tenants"].items() if v["bytes"])
        if tenants:
            lines.append(f"{'':<20}tenants: {tenants}")
        if refused := staging_refused(s.get("staging")):
            lines.append(f"{'':<20}{refused}")
    if st.get("engines"):
        lines += ["(hit rate: reads through the shard; its node's engines read their hits from shared memory, "
                  "counted below)", "", "engines (measured by their connectors: load or recompute):"]
        for name, e in sorted(st["engines"].items()):
            adv = e.get("load_advantage")
            lines.append(f"  {name}: loads {e['load_gbps'] or 0:.2f} GB/s, prefill {e['prefill_ms_per_token'] or 0:.3f} "
                         f"ms/token, loading a token {adv:.0f}x cheaper than computing it" if adv else
                         f"  {name}: not measured yet")
            failed = (f", {e['load_failures']} failed loads ({e.get('failed_tokens', 0)} tokens recomputed, not hits)"
                      if e.get("load_failures") else "")
            tokens = f" ({e['loaded_tokens']} tokens from the pool)" if "loaded_tokens" in e else ""
            lines.append(f"    {e['loads']} loads{tokens}, {e['recomputes']} recomputes{failed}")
            if e.get("degraded"):
                lines.append(f"    DEGRADED: its pool does not answer; recomputing every prompt "
                             f"({e.get('degraded_s', 0):.0f} s degraded so far)")
            if e.get("reported_at") and e.get("every_s"):
                ago = time.time() - e["reported_at"]
                if ago > 2 * e["every_s"]:
                    lines.append(f"    silent for {ago:.0f} s (reports every {e['every_s']:g} s): its process may "
                                 "be gone")
    if st.get("health_lines"):
        lines += ["", "health (over each shard's life so far):", *("  " + h for h in st["health_lines"])]
        if not st["healthy"]:
            lines.append("UNHEALTHY: a figure is out of its healthy range or a shard is unreachable")
    return "\n".join(lines)
