"""Where an online policy loses to Belady: every block Belady serves from the cache and the policy
does not, broken down by what the policy could have known when it let the block go.

``kvpool sim --explain`` replays the trace once through the policy (the pool's code) and once
through Belady, and for each block of each request's leading run counts who hit it. A block only
Belady hit is a *gap* block; it is classified by its prefix depth, by how its chain left the
policy's cache (its parent still resident after it went, or the chain went down to the block
above it; or it was never admitted), by the time since its last use, by its conversation's turn
and how that turn's gap compares with the conversation's previous one, and by its reuse count.
Turns come from the trace itself: a request whose leading run (in an infinite cache) extends the
chain of one earlier request is that conversation's next turn.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict

from kvpool.cache import TieredCache
from kvpool.policies import Access, make_policy
from kvpool.sim.replay import belady_runs, leading
from kvpool.sim.trace import SimRequest

BINS = {
    "depth": ("0 (root)", "1-3", "4-15", "16-63", "64+"),
    "what the policy held": ("declined when stored", "only the shared prefix", "part of the conversation"),
    "time since last use": ("<1 min", "1-2 min", "2-5 min", "5-10 min", ">10 min"),
    "turn": ("0 (new)", "1", "2", "3-4", "5+"),
    "turn gap": ("new conversation", "first return", "shorter than its last", "longer than its last"),
    "reuse count": ("1", "2", "3-4", "5+"),
}


def _policy_runs(trace: list[SimRequest], policy: str, capacity: int) -> tuple[list[int], set]:
    """Leading-run lengths under ``policy``, and the keys it declined at least once."""
    cache = TieredCache([capacity], lambda cap, res, t: make_policy(policy, cap, res))
    pol = cache.policies[0]
    declined: set = set()
    admit = pol.admit

    def admit_seen(position, access, parent, key) -> bool:
        ok = admit(position, access, parent, key)
        if not ok and position < access.full_blocks:
            declined.add(key)
        return ok

    pol.admit = admit_seen
    runs = []
    for rid, req in enumerate(trace):
        run = cache.leading_run(req.blocks)
        runs.append(len(run))
        cache.serve(req.blocks, Access(rid, req.time_s, len(req.blocks), req.full_blocks, len(run), req.tenant), run)
    return runs, declined


def lru_knowing_dead(trace: list[SimRequest], capacity: int) -> float:
    """Hit rate of a block-level LRU told which blocks are never used again: it stores none of
    them and drops a resident one as soon as its last use is over. The value of knowing deadness
    alone (not when a block comes back)."""
    last_use: dict[int, int] = {}
    for ri, r in enumerate(trace):
        for b in r.blocks:
            last_use[b] = ri
    lru: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for ri, r in enumerate(trace):
        hits += leading(r.blocks, lru)
        total += len(r.blocks)
        for b in reversed(r.blocks):  # leaf first: the root ends up most recent
            lru.pop(b, None)
            if last_use[b] > ri:
                lru[b] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits / max(total, 1)


def _bin(x: float, edges: tuple, labels: tuple) -> str:
    for e, lab in zip(edges, labels):
        if x < e:
            return lab
    return labels[-1]


def explain(trace: list[SimRequest], policy: str, capacity: int) -> list[dict]:
    """Rows ``dimension, bin, belady_hits, policy_hits, gap_blocks, share_of_gap``."""
    ho, declined = _policy_runs(trace, policy, capacity)
    hb = belady_runs(trace, capacity)
    last_time: dict[int, float] = {}
    uses: Counter = Counter()
    last_req: dict[int, int] = {}
    turn = [0] * len(trace)
    gap = [0.0] * len(trace)
    has_next = [False] * len(trace)
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # belady, policy, gap
    for i, r in enumerate(trace):
        h = leading(r.blocks, last_req)
        prev_gap = None
        if h >= 2:
            p = last_req[r.blocks[h - 1]]
            has_next[p] = True
            turn[i] = turn[p] + 1
            gap[i] = r.time_s - trace[p].time_s
            prev_gap = gap[p] if turn[p] else None
        t_label = _bin(turn[i], (1, 2, 3, 5), ("0 (new)", "1", "2", "3-4", "5+"))
        if turn[i] == 0:
            g_label = "new conversation"
        elif prev_gap is None:
            g_label = "first return"
        else:
            g_label = "shorter than its last" if gap[i] <= prev_gap else "longer than its last"
        shared = 0  # leading blocks other conversations use too (a system prompt)
        while shared < len(r.blocks) and uses[r.blocks[shared]] > turn[i] + 1:
            shared += 1
        for pos, b in enumerate(r.blocks[: max(ho[i], hb[i])]):
            bel, pol_hit = pos < hb[i], pos < ho[i]
            since = r.time_s - last_time[b]
            if b in declined:
                held = "declined when stored"
            else:
                held = "only the shared prefix" if ho[i] <= shared else "part of the conversation"
            keys = (
                ("depth", _bin(pos, (1, 4, 16, 64), ("0 (root)", "1-3", "4-15", "16-63", "64+"))),
                ("what the policy held", held),
                ("time since last use", _bin(since, (60, 120, 300, 600), ("<1 min", "1-2 min", "2-5 min", "5-10 min",
                                                                         ">10 min"))),
                ("turn", t_label),
                ("turn gap", g_label),
                ("reuse count", _bin(uses[b], (2, 3, 5), ("1", "2", "3-4", "5+"))),
            )
            for k in keys:
                c = counts[k]
                c[0] += bel
                c[1] += pol_hit
                c[2] += bel and not pol_hit
        for b in r.blocks:
            uses[b] += 1
            last_time[b] = r.time_s
            last_req[b] = i
    odds: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # requests, of which came back
    for i, r in enumerate(trace):
        back = int(has_next[i])
        prev = "previous gap " + ("none (first turn)" if turn[i] == 0 else
                                  _bin(gap[i], (60, 300), ("<1 min", "1-5 min", ">5 min")))
        for key in ("turn " + _bin(turn[i], (1, 2, 3, 5), ("0", "1", "2", "3-4", "5+")),
                    "prompt " + _bin(len(r.blocks), (8, 32), ("<8 blocks", "8-31 blocks", "32+ blocks")), prev):
            odds[key][0] += 1
            odds[key][1] += back
    total_gap = sum(counts[("depth", b)][2] for b in BINS["depth"]) or 1
    blocks = sum(len(r.blocks) for r in trace) or 1
    rows = [{"dimension": "hit rate", "bin": name, "hit_rate": v, "policy": policy, "capacity": capacity}
            for name, v in (("Belady", sum(hb) / blocks), (policy, sum(ho) / blocks),
                            ("LRU told which blocks are dead", lru_knowing_dead(trace, capacity)))]
    gaps = sorted(g for g, t in zip(gap, turn) if t)
    if gaps:
        rows.append({"dimension": "turn gaps", "bin": "seconds", "policy": policy, "capacity": capacity,
                     "quantiles": {q: gaps[int(q * (len(gaps) - 1))] for q in (0.25, 0.5, 0.75, 0.9, 0.99)}})
    rows += [{"dimension": "odds of another turn", "bin": k, "requests": n, "odds": b / n, "policy": policy,
              "capacity": capacity} for k, (n, b) in sorted(odds.items())]
    for dim, labels in BINS.items():
        for label in labels:
            bel, pol_hits, g = counts.get((dim, label), (0, 0, 0))
            rows.append({"dimension": dim, "bin": label, "belady_hits": bel, "policy_hits": pol_hits,
                         "gap_blocks": g, "share_of_gap": g / total_gap, "policy": policy, "capacity": capacity})
    return rows


def format_table(rows: list[dict]) -> str:
    r0 = rows[0]
    lines = [f"where {r0['policy']} loses to Belady at {r0['capacity']} blocks (blocks of leading runs)",
             f"{'dimension':<22}{'bin':<26}{'belady hits':>12}{'policy hits':>12}{'gap':>9}{'share':>8}"]
    head = []
    for r in rows:
        if "hit_rate" in r:
            head.append(f"hit rate of {r['bin']}: {r['hit_rate']:.2%}")
            continue
        if "quantiles" in r:
            head.append("turn gaps (s): " + ", ".join(f"p{round(q * 100)} {v:.0f}" for q, v in r["quantiles"].items()))
            continue
        if "odds" in r:
            head.append(f"odds a request has a next turn, {r['bin']}: {r['odds']:.0%} of {r['requests']}")
            continue
        lines.append(f"{r['dimension']:<22}{r['bin']:<26}{r['belady_hits']:>12}{r['policy_hits']:>12}"
                     f"{r['gap_blocks']:>9}{r['share_of_gap']:>8.1%}")
    return "\n".join(lines[:1] + head + lines[1:])


def plot(rows: list[dict], path: str) -> None:
    """One panel per dimension: Belady's and the policy's hits per bin (the gap is the difference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted({r["capacity"] for r in rows})
    rows = [r for r in rows if r["capacity"] == caps[len(caps) // 2]]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, dim in zip(axes.flat, BINS):
        rs = [r for r in rows if r["dimension"] == dim]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["belady_hits"] for r in rs], 0.4, label="Belady", color="dimgray")
        ax.bar([x + 0.2 for x in xs], [r["policy_hits"] for r in rs], 0.4, label=rows[0]["policy"], color="tab:blue")
        ax.set_xticks(list(xs), [r["bin"] for r in rs], rotation=25, ha="right", fontsize=8)
        ax.set_title(dim, fontsize=10)
    axes.flat[0].set_ylabel("blocks served from cache")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"where {rows[0]['policy']} loses to Belady at {rows[0]['capacity']} blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
