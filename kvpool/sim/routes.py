"""``kvpool sim --instances N,...``: the routing policies over simulated clusters of each size, side
by side on the same requests (:mod:`kvpool.sim.cluster`), a table and a plot."""

from __future__ import annotations

from kvpool.errors import BadRequest
from kvpool.routing import POLICIES
from kvpool.sim.cluster import DEFAULT_COST, Shape, simulate
from kvpool.sim.parallel import run_all
from kvpool.sim.trace import SimRequest


def parse_instances(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise BadRequest(f"--instances {text!r}: engine instances per cluster, comma-separated (e.g. 8,32,128)")
    return out


def _one(reqs: list[SimRequest], task: tuple[str, Shape, float]) -> dict:
    policy, shape, utilization = task
    return simulate(reqs, policy, shape, DEFAULT_COST, utilization)


def run(reqs: list[SimRequest], source: str, sizes: list[int], per_node: int = 4, gpu_blocks: int = 600,
        node_blocks: int = 8000, utilization: float = 0.7, progress: bool = True) -> list[dict]:
    """Every (size, policy) pair, in parallel over the machine's cores."""
    tasks = [(p, Shape(n, per_node, gpu_blocks, node_blocks), utilization) for n in sizes for p in POLICIES]
    done = run_all(reqs, tasks, _one, "kvpool sim (routing)", lambda t: f"{t[0]} @ {t[1].instances}", progress)
    results = {(t[0], t[1].instances): row for t, row in done.items()}
    return [{**results[(p, n)], "source": source, "gpu_blocks": gpu_blocks, "node_blocks": node_blocks,
             "per_node": per_node} for n in sizes for p in POLICIES]


def format_table(rows: list[dict]) -> str:
    lines = [f"{'instances':>9}  {'policy':<13}{'gpu':>7}{'node':>7}{'remote':>8}{'miss':>7}{'own+node':>10}"
             f"{'mean TTFT s':>13}{'p99 TTFT s':>12}{'max load':>10}"]
    for r in rows:
        lines.append(f"{r['instances']:>9}  {r['policy']:<13}{r['gpu_share']:>7.1%}{r['node_share']:>7.1%}"
                     f"{r['remote_share']:>8.1%}{r['miss_share']:>7.1%}{r['local_share']:>10.1%}"
                     f"{r['mean_ttft_s']:>13.3f}{r['p99_ttft_s']:>12.3f}{r['max_load_vs_mean']:>9.2f}x")
    if rows:
        r = rows[0]
        lines.append(f"(prompt tokens served by each tier; {r['source']}, {r['requests']} requests; {r['per_node']} "
                     f"instances a node, {r['gpu_blocks']} GPU blocks each, {r['node_blocks']} blocks a node's shard; "
                     f"cold prefill would keep {r['utilization']:.0%} of the instances busy)")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["instances"] for r in rows})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for p in POLICIES:
        mine = {r["instances"]: r for r in rows if r["policy"] == p}
        a.plot(sizes, [mine[n]["mean_ttft_s"] for n in sizes], marker="o", label=p)
        b.plot(sizes, [mine[n]["local_share"] for n in sizes], marker="o", label=p)
    for ax, what in ((a, "modelled mean TTFT (s)"), (b, "tokens from own GPU cache or node shard")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engine instances")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    a.legend()
    fig.suptitle(f"routing policies, {rows[0]['source']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
