"""`kvpool sim`: policies x capacities on a trace or a generated workload, as rows, a table and a plot."""

from __future__ import annotations

import inspect
import os

from kvpool.errors import BadRequest
from kvpool.policies import DEFAULT_POLICY, TIERED_MEMORY, policy_class, policy_names
from kvpool.sim.parallel import run_all
from kvpool.sim.replay import belady, infinite, replay
from kvpool.sim.trace import BLOCK_TOKENS, SimRequest, load_mooncake, merge_blocks
from kvpool.sim.workloads import generate

DEFAULT_TRACE = os.path.join("..", "shared", "data", "mooncake", "conversation_trace.jsonl")


def parse_capacities(text: str) -> list[int]:
    try:
        caps = [int(x.replace("_", "").lower().replace("k", "000")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadRequest(f"--capacity {text!r}: give block counts like 1000,4000,16k") from None
    if not caps or any(c <= 0 for c in caps):
        raise BadRequest(f"--capacity {text!r}: every capacity must be a positive number of blocks")
    return caps


def parse_policies(text: str) -> list[str]:
    names = policy_names()
    if text == "all":
        return names
    out = []
    for p in text.split(","):
        p = p.strip()
        if p == "default":
            p = DEFAULT_POLICY
        if p not in names:
            raise BadRequest(f"unknown policy {p!r}; choose from {names}, 'default' or 'all'")
        out.append(p)
    return out


def load(trace: str | None, workload: str | None, requests: int | None, seed: int,
         merge: int = 1) -> tuple[str, list[SimRequest]]:
    if trace and workload:
        raise BadRequest("give --trace or --workload, not both")
    if workload:
        source, reqs = f"workload:{workload}", generate(workload, n_requests=requests or 10000, seed=seed)
    else:
        path = trace or DEFAULT_TRACE
        source, reqs = os.path.basename(path), load_mooncake(path, limit=requests)
    if merge != 1:
        source += f" ({merge * BLOCK_TOKENS}-token chunks)"
    return source, merge_blocks(reqs, merge)


def parse_params(items: list[str] | None) -> dict[str, float]:
    """``--param NAME=VALUE`` pairs (numbers), for the policies whose constructor takes NAME."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            out[name.strip().replace("-", "_")] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise BadRequest(f"--param {item!r}: give NAME=NUMBER, e.g. --param margin=0")
    return out


def _params_for(policy: str, params: dict[str, float]) -> dict[str, float]:
    if not params or policy == TIERED_MEMORY:
        return {}
    accepted = inspect.signature(policy_class(policy).__init__).parameters
    return {k: v for k, v in params.items() if k in accepted}


def _one(reqs: list[SimRequest], task: tuple) -> dict:
    kind, policy, cap, params = task
    if kind == "belady":
        return belady(reqs, cap)
    return replay(reqs, policy, cap, **dict(params))


def simulate(reqs: list[SimRequest], source: str, policies: list[str], capacities: list[int],
             progress: bool = True, with_belady: bool = True, workers: int | None = None,
             params: dict[str, float] | None = None) -> list[dict]:
    """Every (policy, capacity) pair, plus infinite and Belady, in parallel over the machine's
    cores (each pair is independent). ``params`` go to each policy that takes them."""
    params = params or {}
    unknown = set(params) - {k for p in policies for k in _params_for(p, params)}
    if unknown:
        raise BadRequest(f"--param {sorted(unknown)}: no policy of this run takes it")
    tasks = [("policy", p, c, tuple(sorted(_params_for(p, params).items()))) for c in capacities for p in policies]
    if with_belady:
        tasks += [("belady", "belady", c, ()) for c in capacities]
    results = run_all(reqs, tasks, _one, "kvpool sim", lambda t: f"{t[1]} @ {t[2]}", progress, workers)
    inf = infinite(reqs)
    rows: list[dict] = []
    for cap in capacities:
        for pol in policies:
            given = tuple(sorted(_params_for(pol, params).items()))
            row = results[("policy", pol, cap, given)]
            if given:
                row["params"] = dict(given)
            row["source"] = source
            row["default"] = pol == DEFAULT_POLICY
            rows.append(row)
        rows.append({**inf, "capacity": cap, "source": source})
        if with_belady:
            rows.append({**results[("belady", "belady", cap, ())], "source": source})
    return rows


def format_table(rows: list[dict]) -> str:
    caps = sorted({r["capacity"] for r in rows})
    names = []
    for r in rows:
        if r["policy"] not in names:
            names.append(r["policy"])
    by = {(r["policy"], r["capacity"]): r for r in rows}
    head = f"{'policy':<16}" + "".join(f"{f'{c} blocks':>22}" for c in caps)
    lines = [f"source: {rows[0].get('source', '?')}; hit rate (ratio to lru)", head]
    for n in names:
        cells = []
        for c in caps:
            r = by.get((n, c))
            if r is None:
                cells.append(f"{'-':>22}")
                continue
            lru = by.get(("lru", c))
            ratio = f" (x{r['hit_rate'] / lru['hit_rate']:.2f})" if lru and lru["hit_rate"] > 0 else ""
            cells.append(f"{r['hit_rate']:>13.2%}{ratio:>9}")
        label = n + (" *" if any(by.get((n, c), {}).get("default") for c in caps) else "")
        lines.append(f"{label:<16}" + "".join(cells))
    lines.append("* the pool's default policy")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    names = []
    for r in rows:
        if r["policy"] not in names:
            names.append(r["policy"])
    gray = plt.cm.tab10.colors[7]  # kept for the reference lines
    colors = iter([c for c in plt.cm.tab10.colors if c != gray] + list(plt.cm.Dark2.colors))
    for n in names:
        pts = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == n)
        style = {"infinite": dict(ls=":", color="black"), "belady": dict(ls="--", color="dimgray")}.get(n)
        style = style or dict(color=next(colors))
        width = 3 if any(r.get("default") for r in rows if r["policy"] == n) else 1.5
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=width, label=n, **style)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit rate (leading run)")
    ax.set_title(f"hit rate vs capacity: {rows[0].get('source', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
