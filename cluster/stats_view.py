"""How `kvpool stats` prints what it gathered (from a Ray pool or a single-node pool alike)."""

from __future__ import annotations

from kvpool.cluster.node_caps import staging_refused
from kvpool.cluster.pool_stats import engine_view, tenant_totals
from kvpool.cluster.reports import Reports


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
    engines = {name: engine_view(e) for name, e in sorted((st.get("engines") or {}).items())}
    if engines:
        lines += ["", "engines (their connectors' own counts, a vLLM engine's as its /metrics counts them; same-node "
                  "hits are read from shared memory, without a call the shard could count):"]
        for name, e in engines.items():
            lines += [f"  {name}" + (f" [reports as {e['tenant']}]" if e.get("tenant") else ""), *_engine(name, e)]
        if tenants := st.get("tenants") or tenant_totals(engines):
            lines += ["", "tenants (over the engines listed: prompt tokens, and those the engines took from the pool):",
                      *(f"  {_tenant(t, f)}" for t, f in tenants.items())]
    if st.get("health_lines"):
        lines += ["", "health (over each shard's life so far):", *("  " + h for h in st["health_lines"])]
        if not st["healthy"]:
            lines.append("UNHEALTHY: a figure is out of its healthy range or a shard is unreachable")
    return "\n".join(lines)


def _engine(name: str, e: dict) -> list[str]:
    """An engine's lines: what it served from the pool and computed, its tenants', its break-even
    measure, then whether it is degraded or silent."""
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
    if "pool_tokens" in e:
        out.append(f"    as vLLM counts them: {_share(e['pool_tokens'], e.get('prompt_tokens', 0))} (at admission, "
                   "a load that then failed included)")
    out += [f"      {_tenant(t, f)}" for t, f in (e.get("tenants") or {}).items()]
    adv = e.get("load_advantage")
    out.append(f"    loads {e.get('load_gbps') or 0:.2f} GB/s, prefill {e.get('prefill_ms_per_token') or 0:.3f} ms/token: "
               f"loading a token {adv:.0f}x cheaper than computing it" if adv else
               "    load and prefill speed: not measured yet (after its first load and its first computed prefill)")
    if e.get("degraded"):
        out.append(f"    DEGRADED: its pool does not answer; recomputing every prompt ({e.get('degraded_s', 0):.0f} s "
                   "degraded so far)")
    if e.get("silent"):
        forget = name[: -len(f" [{e['tenant']}]")] if e.get("tenant") and name.endswith(f" [{e['tenant']}]") else name
        out.append(f"    SILENT for {e.get('silent_s', 0):.0f} s (reports every {e.get('every_s', 0):g} s): its process "
                   f"may be gone; listed until `kvpool stats --forget '{forget}'` or {Reports.FORGET_AFTER_S / 3600:g} h "
                   "of silence")
    return out


def _share(pool: int, prompt: int) -> str:
    return f"{pool} of {prompt} prompt tokens from the pool" + (f" ({pool / prompt:.1%})" if prompt else "")


def _tenant(tenant: str, f: dict) -> str:
    """A tenant's figures: its prompt tokens and those taken from the pool."""
    return f"{tenant}: " + (_share(f.get("pool_tokens", 0), f["prompt_tokens"]) if f.get("prompt_tokens") else
                            "no requests")
