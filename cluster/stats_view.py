"""How `kvpool stats` prints what it gathered (from a Ray pool or a single-node pool alike)."""

from __future__ import annotations

import time

from kvpool.cluster.node_caps import staging_refused


def format_stats(st: dict) -> str:
    lines = [f"membership version {st['version']}, {len(st['shards'])} shards",
             f"{'shard':<20}{'tier':<6}{'chunks':>8}{'MiB':>10}{'pages':>12}{'read hits':>10}{'evictions':>11}"]
    for sid, s in sorted(st["shards"].items()):
        if "error" in s:
            lines.append(f"{sid:<20}unreachable: {s['error']}")
            continue
        m = s["metrics"]
        hits, misses = sum(m["hits_chunks"].values()), sum(m["misses_chunks"].values())
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "none yet"
        for tier, t in s["tiers"].items():
            ev = m["evictions"].get(f"tier={tier}", 0)
            lines.append(f"{sid:<20}{tier:<6}{t['chunks']:>8}{t['bytes'] / 2**20:>10.1f}"
                         f"{t['pages_used']:>6}/{t['pages_total']:<5}{rate:>10}{ev:>11.0f}")
        tenants = ", ".join(f"{k} {v['bytes'] / 2**20:.1f} MiB" for k, v in s["tenants"].items() if v["bytes"])
        if tenants:
            lines.append(f"{'':<20}tenants: {tenants}")
        if refused := staging_refused(s.get("staging")):
            lines.append(f"{'':<20}{refused}")
    lines.append("(read hits: chunks found of those asked for through the shard's socket and peer port)")
    if st.get("engines"):
        lines += ["", "engines (their connectors' own counts; same-node hits are read from shared memory, without a "
                  "call the shard could count):"]
        for name, e in sorted(st["engines"].items()):
            lines += [f"  {name}" + (f" [reports as {e['tenant']}]" if e.get("tenant") else ""), *_engine(e)]
        if tenants := _tenants(st["engines"]):
            lines += ["", "tenants (prompt tokens the engines served from the pool):", *tenants]
    if st.get("health_lines"):
        lines += ["", "health (over each shard's life so far):", *("  " + h for h in st["health_lines"])]
        if not st["healthy"]:
            lines.append("UNHEALTHY: a figure is out of its healthy range or a shard is unreachable")
    return "\n".join(lines)


def _engine(e: dict) -> list[str]:
    """An engine's lines: what it served from the pool and computed, then its break-even measure."""
    out = []
    loads, loaded = e.get("loads", 0), e.get("loaded_tokens", 0)
    line = f"    {loads} loads ({loaded} tokens from the pool)"
    if "requests" in e:
        prompt = e.get("prompt_tokens", 0)
        rate = f"{loaded / prompt:.1%}" if prompt else "-"
        computed = max(0, e["requests"] - loads)
        line += (f" in {e['requests']} requests of {prompt} prompt tokens: token hit rate {rate}; "
                 f"{computed} computed ({e.get('recomputed_by_breakeven', e.get('recomputes', 0))} of them declined "
                 "by the break-even)")
    else:
        line += f", {e.get('recomputes', 0)} declined by the break-even"
    if e.get("load_failures"):
        line += f"; {e['load_failures']} failed loads ({e.get('failed_tokens', 0)} tokens recomputed, not hits)"
    out.append(line)
    adv = e.get("load_advantage")
    out.append(f"    loads {e['load_gbps'] or 0:.2f} GB/s, prefill {e['prefill_ms_per_token'] or 0:.3f} ms/token: loading "
               f"a token {adv:.0f}x cheaper than computing it" if adv else
               "    load and prefill speed: not measured yet (after its first load and its first computed prefill)")
    if e.get("degraded"):
        out.append(f"    DEGRADED: its pool does not answer; recomputing every prompt ({e.get('degraded_s', 0):.0f} s "
                   "degraded so far)")
    if e.get("reported_at") and e.get("every_s"):
        ago = time.time() - e["reported_at"]
        if ago > 2 * e["every_s"]:
            out.append(f"    silent for {ago:.0f} s (reports every {e['every_s']:g} s): its process may be gone")
    return out


def _tenants(engines: dict) -> list[str]:
    """Per tenant, over every engine's report: prompt tokens and those served from the pool."""
    sums: dict[str, list[int]] = {}
    for e in engines.values():
        for k, v in e.items():
            if k.startswith("tenant ") and isinstance(v, (int, float)):
                _, tenant, what = k.split(" ", 2)
                s = sums.setdefault(tenant, [0, 0])
                s[0 if what == "prompt_tokens" else 1] += int(v)
    return [f"  {t}: {pool} of {prompt} tokens from the pool ({pool / prompt:.1%})" if prompt else f"  {t}: no requests"
            for t, (prompt, pool) in sorted(sums.items())]
