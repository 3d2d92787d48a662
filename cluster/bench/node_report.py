"""The figures of ``kvpool bench datapath`` (:mod:`kvpool.cluster.bench.node`): rounds merged into
ranges, ratios per round, the targets, the failures that fail the command, and the table.

Ratios are computed per round, from the two figures of that round: latency ratios are
kvpool/peer ms (lower is better), throughput ratios kvpool/peer GB/s medians (higher is better);
``32MiB put kvpool/memcpy`` and ``32MiB get_same kvpool/memcpy`` divide by the memcpy of kvpool's
writer process in the same round (``32MiB copy_checksum/memcpy``: the verified copy's). A target is met when its worst round meets it. ``node_op_s``:
seconds each node-server operation handler ran during the measured rounds, per shard, with the
calls this benchmark made. ``breakdown_ms``: where a call's time goes, per size over all rounds
(warm-up included): each socket call as the engine timed it (``call OP``), the engine's copy into
the slab (``client_copy``), and the shard's handler of it (``shard OP``, from ``node_op_s`` between
the sizes), in ms per call; the reader's ``call lookup`` are its untimed waits for the index.
"""

from __future__ import annotations

from kvpool.bench import peers as P

SMALL = "256KiB"
OPS = ("put", "get_same", "get_cross")
RTT_CALLS = 200  # per worker and round: the node socket's round trip (``hello``)

TARGETS = (  # (name, ratio, "<=" or ">=", bound)
    ("256 KiB p50 same-node get at most Mooncake's", "256KiB p50 get_same kvpool/mooncake", "<=", 1.0),
    ("256 KiB p50 put within 2x of Mooncake's", "256KiB p50 put kvpool/mooncake", "<=", 2.0),
    ("256 KiB p50 cold cross-node get (its lookup included) within 2x of Mooncake's cross-process get",
     "256KiB p50 get_cross kvpool/mooncake", "<=", 2.0),
    ("32 MiB same-node get >= 0.8x memcpy", "32MiB get_same kvpool/memcpy", ">=", 0.8),
    ("32 MiB put >= 0.8x memcpy", "32MiB put kvpool/memcpy", ">=", 0.8),
    ("32 MiB cross-node get >= 1.0x Mooncake's cross-process get", "32MiB get_cross kvpool/mooncake", ">=", 1.0),
)


def _merge_rounds(rounds: list[dict]) -> dict:
    return {name: {op: P.range_over_rounds([r[name][op] for r in rounds]) for op in rounds[0][name]}
            for name in rounds[0]}


def _merge_peer_runs(runs: list[dict]) -> dict:
    """One ``peers.run(rounds=1)`` result per round -> the shape of ``peers.run(rounds=N)``."""
    first = runs[0]
    merged: dict = {"config": {**first["config"], "rounds": len(runs)}}
    for who in first:
        if who == "config":
            continue
        skipped = [r[who]["skipped"] for r in runs if "skipped" in r[who]]
        if skipped:
            merged[who] = {"skipped": skipped[0]}
            continue
        sizes = [n for n in first[who] if isinstance(first[who][n], dict) and n not in ("setup",)]
        merged[who] = {n: {op: {m: [min(r[who][n][op][m][0] for r in runs), max(r[who][n][op][m][1] for r in runs)]
                                for m in first[who][n][op]} for op in first[who][n]} for n in sizes}
        merged[who]["wrong_bytes"] = sum(r[who].get("wrong_bytes", 0) for r in runs)
        if "setup" in first[who]:
            merged[who]["setup"] = first[who]["setup"]
    return merged


def _round_ratios(kv: dict, mem: dict, peer_rounds: dict[str, dict], large: str) -> dict:
    """Ratios of one round: ``kv`` and ``mem`` summaries of kvpool's round, ``peer_rounds[peer]`` the
    peer's round (its figures as ``[x, x]``)."""
    out = {}
    for peer, pr in peer_rounds.items():
        for op in OPS:
            for q in ("p50", "p99"):
                out[f"{SMALL} {q} {op} kvpool/{peer}"] = kv[SMALL][op][f"{q}_ms"] / pr[SMALL][op][f"{q}_ms"][0]
            if large in pr:
                out[f"{large} {op} kvpool/{peer}"] = kv[large][op]["gbps_median"] / pr[large][op]["gbps_median"][0]
    for op in ("put", "get_same"):
        out[f"{large} {op} kvpool/memcpy"] = kv[large][op]["gbps_median"] / mem[large]["copy"]["gbps_median"]
    if "copy_checksum" in mem[large]:
        out[f"{large} copy_checksum/memcpy"] = (mem[large]["copy_checksum"]["gbps_median"]
                                                / mem[large]["copy"]["gbps_median"])
    return out


def _targets(ratios: dict, large: str) -> list[dict]:
    rows = []
    for name, ratio, sense, bound in TARGETS:
        ratio = ratio.replace("32MiB", large)
        rng = ratios.get(ratio)
        if rng is None:
            rows.append({"name": name, "ratio": ratio, "bound": f"{sense} {bound:g}", "range": None, "worst": None,
                         "met": None})
            continue
        worst = rng[1] if sense == "<=" else rng[0]
        met = worst <= bound if sense == "<=" else worst >= bound
        rows.append({"name": name, "ratio": ratio, "bound": f"{sense} {bound:g}", "range": rng, "worst": worst,
                     "met": met})
    return rows


def failures(r: dict) -> list[str]:
    """Why a result is a failed run (empty for a good one)."""
    kv = r["kvpool"]
    why = [f"kvpool: {kv[k]} {k.replace('_', ' ')}" for k in ("wrong_bytes", "missing", "put_failed") if kv[k]]
    if kv["workers_imported_ray"]:
        why.append("a worker process imported ray")
    if r["memcpy"]["wrong_bytes"]:
        why.append(f"memcpy: {r['memcpy']['wrong_bytes']} wrong bytes")
    peers = r.get("peers", {})
    if "skipped" not in peers and P.wrong_bytes(peers):
        why.append(f"peers: {P.wrong_bytes(peers)} wrong bytes")
    return why


def _rng(v, fmt: str) -> str:
    return "-" if v is None else P._rng(v, fmt)


def format_table(r: dict) -> str:
    cfg = r["config"]
    names = list(cfg["sizes"])
    small, large = names
    lines = [f"kvpool node path (2 nodes, worker processes without Ray) and peers, same run: {cfg['rounds']} "
             f"round(s), ranges over rounds; {small}: {cfg['ops'][small]} ops, {large}: {cfg['ops'][large]} ops",
             f"{'':<10}{'op':<18}{small + ' p50 ms':>16}{small + ' p99 ms':>16}{large + ' GB/s med':>17}"
             f"{large + ' GB/s min':>17}"]

    def rows(who: str, v: dict, ops) -> None:
        for op in ops:
            if op not in v.get(small, {}):
                continue
            a, b = v[small][op], v.get(large, {}).get(op)
            lines.append(f"{who:<10}{op:<18}{_rng(a['p50_ms'], '.3f'):>16}{_rng(a['p99_ms'], '.3f'):>16}"
                         f"{_rng(b and b['gbps_median'], '.2f'):>17}{_rng(b and b['gbps_min'], '.2f'):>17}")

    rows("memcpy", r["memcpy"], ["copy", "copy_checksum"])
    rows("kvpool", r["kvpool"], [*OPS, "get_same_no_outs", "get_cross_no_outs"])
    peers = r["peers"]
    if "skipped" in peers:
        lines.append(f"{'peers':<10}skipped: {peers['skipped']}")
    else:
        for p in P.PEERS:
            if "skipped" in peers.get(p, {"skipped": "not run"}):
                lines.append(f"{p:<10}skipped: {peers.get(p, {}).get('skipped', 'not run')}")
            else:
                rows(p, peers[p], OPS)
    lines.append("ratios (per round, range over rounds):")
    width = max([len(k) for k in r["ratios"]] + [10])
    for k, v in r["ratios"].items():
        lines.append(f"  {k:<{width}} {_rng(v, '.2f')}")
    lines.append("targets (met: by the worst round):")
    for t in r["targets"]:
        state = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"  {t['name']:<72} {t['bound']:<6} {_rng(t['range'], '.2f'):>11}  {state}")
    kv = r["kvpool"]
    lines.append(f"kvpool: wrong bytes {kv['wrong_bytes']}, missing {kv['missing']}, put failed {kv['put_failed']}, "
                 f"put forwarded {kv['put_forwarded']}, workers imported ray: {kv['workers_imported_ray']}")
    for role, v in kv.get("node_rtt", {}).items():
        lines.append(f"  node socket round trip ('hello', {RTT_CALLS} calls a round) to the {role}: "
                     f"p50 {_rng(v['p50_ms'], '.3f')} ms, p99 {_rng(v['p99_ms'], '.3f')} ms")
    lines.append("where the time goes (ms per call, over all rounds, warm-up included; 'call OP': the engine's "
                 "socket call, 'shard OP': the shard's handler):")
    for name, roles in kv.get("breakdown_ms", {}).items():
        for role, parts in roles.items():
            lines.append(f"  {name} {role}: " + ", ".join(
                f"{k} {v['ms_per_call']:.3f}" + (f" (x{v['calls']})" if k.startswith("call") else "")
                for k, v in parts.items() if "ms_per_call" in v))
    return "\n".join(lines)
