"""Chaos: faults injected one at a time, on a schedule, into a real pool under load.

A local Ray cluster (3 nodes), a pool started with ``bootstrap.up`` on a Redis server of the
suite's own (its node files in a run dir of its own), and verifying clients that act like
engines, each a process (a Ray actor on the head, only as a place to run) with the engines' own
client, a NodeClient of one node's shard (spread over the nodes; one whose shard is gone for good
moves to another node's, as a rescheduled engine would): lookup a prompt's chunks, get them,
check every byte against what its key implies, put what was missing. One prompt per client (the probe) is read every other
step: after a fault, the seconds until each client reads its whole probe again are the recovery.

Per fault (cluster/bench/chaos_faults.py) the report gives: ops, wrong bytes, untyped errors (anything
not a KvPoolError, by type name with one message), typed errors by status, calls over their
deadline (client timeout + slack), the recovery and the shards that left the pool. Faults:
SIGKILL a shard's worker (on a worker node, or the head's), SIGKILL a node's raylet (a node joins in its place), SIGSTOP Redis for 3 s, Redis killed
and restarted empty, the controller killed (Ray restarts it), a writer flooding past capacity, a
node added and removed mid-traffic.
"""

from __future__ import annotations

import os
import threading
import time
from functools import partial

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # its cluster is loopback-only

import numpy as np  # noqa: E402
import ray  # noqa: E402

from kvpool.cluster.bench.chaos_faults import FAULTS, Context, RedisServer  # noqa: E402
from kvpool.cluster.bench.soak import truth  # noqa: E402
from kvpool.errors import KvPoolError  # noqa: E402
from kvpool.keys import Namespace, chunk_keys  # noqa: E402
from kvpool.spec import KVSpec  # noqa: E402

SPEC = KVSpec("chaos", 2, 2, 64, dtype="float16", block_size=16, chunk_tokens=64)
NAMESPACE = "kvpool-chaos"
TENANT, FLOOD_TENANT = "a", "flood"
PROMPTS = 50  # shared by the clients, 2-6 chunks each (the probe: 8): they fit the pool, so only faults evict
RETARGET_S = 3.0  # a client whose shard is gone this long moves to another node's
PROBE_CHUNKS = 8
# Ray declares a node dead after 1 s of missed health checks (its default: 30 s).
FAST_HEALTH = {"health_check_failure_threshold": 2, "health_check_period_ms": 500, "health_check_initial_delay_ms": 0}


def prompt_keys(prompt: int) -> list:
    """The same prompts for every client: what one engine wrote, the others read across nodes."""
    n = PROBE_CHUNKS if prompt == 0 else 2 + prompt % 5
    tokens = np.random.default_rng([7, prompt]).integers(0, 32000, n * SPEC.chunk_tokens)
    return chunk_keys(tokens, Namespace.for_spec(SPEC, b"chaos/"), SPEC.chunk_tokens)


def wrong_bytes(got, want: np.ndarray) -> int:
    g = np.asarray(got).view(np.uint8).ravel()
    return max(g.size, want.size) if g.size != want.size else int(np.count_nonzero(g != want))


def new_stats() -> dict:
    return {"ops": 0, "chunks_read": 0, "wrong_bytes": 0, "untyped": {}, "typed": {}, "typed_example": {}, "over_deadline": 0,
            "max_call_s": 0.0}


class Recorder:
    """Counts ops, typed and untyped errors and calls over their deadline into a stats dict."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s

    def call(self, st: dict, fn):
        t0 = time.monotonic()
        try:
            return fn()
        except KvPoolError as e:
            st["typed"][str(e.status)] = st["typed"].get(str(e.status), 0) + 1
            st["typed_example"].setdefault(str(e.status), f"{type(e).__name__}: {e}"[:300])
        except Exception as e:  # noqa: BLE001 - what the suite looks for: an error of no kvpool type
            name = type(e).__name__
            n, example = st["untyped"].get(name, (0, f"{e}"[:300]))
            st["untyped"][name] = (n + 1, example)
        finally:
            dt = time.monotonic() - t0
            st["ops"] += 1
            st["max_call_s"] = max(st["max_call_s"], dt)
            st["over_deadline"] += dt > self.deadline_s
        return None


def node_shards(run: str) -> list[str]:
    """The shards whose node files are in the run dir (their engines' view of the node)."""
    import glob

    return sorted(os.path.basename(p)[len("kvpool-default-"): -len(".node")]
                  for p in glob.glob(os.path.join(run, "kvpool-default-*.node")))


@ray.remote(num_cpus=0, max_concurrency=4)
class ChaosClient:
    def __init__(self, index: int, run: str, shard: str, timeout_s: float, slack_s: float, chunk_bytes: int) -> None:
        from kvpool.node.client import NodeClient

        self.i, self.nb, self.run, self.timeout_s = index, chunk_bytes, run, timeout_s
        self.c = NodeClient(shard=shard, directory=run, timeout_s=timeout_s)
        self.lost_since: float | None = None
        self.moves = 0
        self.rec = Recorder(timeout_s + slack_s)
        self.prompts = [prompt_keys(j) for j in range(PROMPTS)]
        self.rng = np.random.default_rng(1000 + index)
        self.phase = "warm-up"
        self.stats: dict[str, dict] = {}
        self.reads: list[tuple[float, str, int]] = []  # the probe's reads: (time, phase, chunks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="chaos-client")

    def start(self) -> None:
        self._thread.start()

    def mark(self, phase: str) -> None:
        self.phase = phase

    def _retarget(self) -> None:
        """An engine whose node's shard is gone for good (its node replaced) is rescheduled: it
        moves to another node's shard."""
        if self.c.shards:
            self.lost_since = None
            return
        now = time.monotonic()
        self.lost_since = self.lost_since or now
        others = [s for s in node_shards(self.run) if s != self.c.shard]
        if now - self.lost_since >= RETARGET_S and others:
            from kvpool.node.client import NodeClient

            self.c.close()
            self.c = NodeClient(shard=others[self.i % len(others)], directory=self.run, timeout_s=self.timeout_s)
            self.lost_since, self.moves = None, self.moves + 1

    def _request(self, j: int) -> None:
        """What an engine does with a prompt: lookup, get, verify, put the chunks that missed."""
        self._retarget()
        st = self.stats.setdefault(self.phase, new_stats())
        keys = self.prompts[j]
        hit = self.rec.call(st, partial(self.c.lookup, TENANT, keys))
        got = (self.rec.call(st, partial(self.c.get, TENANT, keys, hit)) or []) if hit is not None and hit.count else []
        st["chunks_read"] += len(got)
        st["wrong_bytes"] += sum(wrong_bytes(g, truth(keys[k], self.nb)) for k, g in enumerate(got))
        if j == 0:
            self.reads.append((time.time(), self.phase, len(got)))
        if len(got) < len(keys):
            rest = keys[len(got):]
            self.rec.call(st, partial(self.c.put, TENANT, rest, [truth(k, self.nb) for k in rest],
                                      first_position=len(got)))

    def _loop(self) -> None:
        step = 0
        while not self._stop.is_set():
            self._request(0 if step % 2 == 0 else int(self.rng.integers(1, PROMPTS)))
            step += 1
            time.sleep(0.005)  # 2-core machines: leave the pool's own processes some CPU

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=60)
        hung = self._thread.is_alive()
        self.c.close()
        return {"stats": self.stats, "reads": self.reads, "hung": hung, "moves": self.moves}


def _flood(client, seconds: float, nb: int) -> dict:
    """Puts new chunks of another tenant, 32 a call, for ``seconds``: past any pool's capacity."""
    rec, st = Recorder(float("inf")), new_stats()
    stored = batch = 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        tokens = np.random.default_rng([7, batch]).integers(0, 32000, 32 * SPEC.chunk_tokens)
        keys = chunk_keys(tokens, Namespace.for_spec(SPEC, b"flood/"), SPEC.chunk_tokens)
        stored += rec.call(st, partial(client.put, FLOOD_TENANT, keys, [truth(k, nb) for k in keys])) or 0
        batch += 1
    return {"flood_chunks": 32 * batch, "flood_stored": stored, "flood_typed": st["typed"],
            "flood_untyped": st["untyped"]}


class MembersWatcher:
    """Polls the controller's membership every 0.25 s from the driver: which shards left it, when.
    A shard leaving under a fault that killed none is a live shard dropped (a flap)."""

    def __init__(self, shards) -> None:
        self.shards, self.left = shards, []  # [(time, shard id)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="chaos-members")
        self._thread.start()

    def _loop(self) -> None:
        last = None
        while not self._stop.wait(0.25):
            try:
                now = set(self.shards())
            except Exception:  # noqa: BLE001 - the controller restarting: look again
                continue
            if last is not None:
                self.left += [(time.time(), s) for s in sorted(last - now)]
            last = now

    def since(self, t0: float) -> list[str]:
        return [s for t, s in self.left if t >= t0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def recovery(reads: list[tuple[float, str, int]], phase: str, t0: float) -> float | None:
    """Seconds from the fault (t0) to the first whole read of the probe after its last short read
    in the phase: 0 when no read was short; None when it never read whole again in the phase."""
    mine = [(t, n) for t, p, n in reads if p == phase]
    short = [t for t, n in mine if n < PROBE_CHUNKS]
    if not short:
        return 0.0
    after = [t for t, n in mine if n == PROBE_CHUNKS and t > short[-1]]
    return max(after[0] - t0, 0.0) if after else None


def merge(into: dict, st: dict) -> None:
    for k in ("ops", "chunks_read", "wrong_bytes", "over_deadline"):
        into[k] += st[k]
    into["max_call_s"] = max(into["max_call_s"], st["max_call_s"])
    into["typed"] = {s: into["typed"].get(s, 0) + st["typed"].get(s, 0) for s in {*into["typed"], *st["typed"]}}
    for status, example in st["typed_example"].items():
        into["typed_example"].setdefault(status, example)
    for name, (n, example) in st["untyped"].items():
        into["untyped"][name] = (into["untyped"].get(name, (0, example))[0] + n, example)


def run(faults: list[str] | None = None, runs: int = 1, seconds_per_fault: float = 10.0, clients: int = 3,
        nodes: int = 3, timeout_s: float = 1.5, slack_s: float = 1.5, chunk_kib: int = 16, dram_pages: int = 512,
        seed: int = 0, progress: bool = True) -> dict:
    import tempfile

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvpool.cluster.bootstrap import down, shard_id_of, up
    from kvpool.cluster.controller import CONTROLLER
    from kvpool.cluster.local import local_cluster
    from kvpool.node.client import NodeClient
    from kvpool.node.paths import own_run_dir
    from kvpool.progress import Progress

    faults = list(faults or FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}: choose from {sorted(FAULTS)}")
    nb = chunk_kib << 10
    occurrences: list[dict] = []
    redis = RedisServer()
    run = tempfile.mkdtemp(prefix="kvpool-chaos-run-")  # the suite's own node files
    try:
        with own_run_dir(run), local_cluster(nodes, namespace=NAMESPACE, system_config=FAST_HEALTH,
                                             logging_level="ERROR") as (c, workers):
            def pool_up() -> dict:
                return up(store={"page_bytes": nb, "dram_pages": dram_pages}, index_url=redis.url,
                          tenants=[{"id": TENANT}, {"id": FLOOD_TENANT}], namespace=NAMESPACE, ttl_s=1.5,
                          controller_interval_s=0.5)

            pool_up()
            here = shard_id_of(ray.get_runtime_context().get_node_id())
            shards = [here] + [shard_id_of(w.node_id) for w in workers]
            head = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            procs = [ChaosClient.options(scheduling_strategy=head).remote(i, run, shards[i % len(shards)], timeout_s,
                                                                         slack_s, nb)
                     for i in range(clients)]
            ray.get([p.start.remote() for p in procs], timeout=120)
            flooder = NodeClient(shard=here, directory=run, timeout_s=timeout_s)
            ctx = Context(c, list(workers), redis, NAMESPACE, pool_up,
                          lambda: ray.get_actor(CONTROLLER, namespace=NAMESPACE),
                          lambda s: _flood(flooder, s, nb), seconds_per_fault, np.random.default_rng(seed))
            watcher = MembersWatcher(ctx.shards)
            schedule = [(r, f) for r in range(runs) for f in faults]
            with Progress(len(schedule) + 1, "chaos", enabled=progress) as bar:
                time.sleep(seconds_per_fault)  # warm-up: every prompt stored once
                bar.advance(note="warm-up")
                for r, name in schedule:
                    phase = f"{name}#{r}"
                    t0 = time.time()
                    ray.get([p.mark.remote(phase) for p in procs], timeout=60)
                    ctx.notes, error = {}, None
                    try:
                        FAULTS[name](ctx)
                    except Exception as e:  # noqa: BLE001 - reported; the next fault still runs
                        error = f"{type(e).__name__}: {e}"[:300]
                    inject_s = time.time() - t0
                    time.sleep(seconds_per_fault)  # quiet: the pool recovers
                    try:  # the pool is whole again: a shard on every alive node
                        ctx.notes["members_after"] = f"{len(ctx.shards())}/{sum(n['Alive'] for n in ray.nodes())}"
                    except Exception as e:  # noqa: BLE001
                        ctx.notes["members_after"] = type(e).__name__
                    ctx.notes["members_left"] = watcher.since(t0)
                    occurrences.append({"fault": name, "run": r, "phase": phase, "t0": t0,
                                        "inject_s": round(inject_s, 2), "notes": dict(ctx.notes), "error": error})
                    bar.advance(note=phase)
            ray.get([p.mark.remote("end") for p in procs], timeout=60)
            watcher.close()
            results = ray.get([p.stop.remote() for p in procs], timeout=180)
            flooder.close()
            down(namespace=NAMESPACE)
    finally:
        redis.close()
        import shutil

        shutil.rmtree(run, ignore_errors=True)
    return summarize(results, occurrences, faults, runs, seconds_per_fault, clients, timeout_s, slack_s)


def summarize(results: list[dict], occurrences: list[dict], faults: list[str], runs: int,
              seconds_per_fault: float, clients: int, timeout_s: float, slack_s: float) -> dict:
    rows: dict[str, dict] = {}
    for phase in ["warm-up", *[o["phase"] for o in occurrences]]:
        occ = next((o for o in occurrences if o["phase"] == phase), None)
        name = occ["fault"] if occ else phase
        row = rows.setdefault(name, {**new_stats(), "recovery_s": [], "members_left": 0, "occurrences": []})
        for r in results:
            merge(row, r["stats"].get(phase, new_stats()))
        if occ:
            row["members_left"] += len(occ["notes"].get("members_left", []))
            recs = [recovery(r["reads"], phase, occ["t0"]) for r in results]
            row["recovery_s"].append(None if None in recs else round(max(recs), 2))
            row["occurrences"].append({k: v for k, v in occ.items() if k != "t0"})
            for name_, (n, ex) in occ["notes"].get("flood_untyped", {}).items():
                merge(row, {**new_stats(), "untyped": {name_: (n, ex)}})
    for row in rows.values():
        row["untyped"] = {k: {"count": n, "example": ex} for k, (n, ex) in row["untyped"].items()}
        row["max_call_s"] = round(row["max_call_s"], 3)
    total = {k: sum(r[k] for r in rows.values()) for k in ("ops", "chunks_read", "wrong_bytes", "over_deadline")}
    total["untyped"] = sum(v["count"] for r in rows.values() for v in r["untyped"].values())
    total["fault_errors"] = [o for r in rows.values() for o in r["occurrences"] if o["error"]]
    return {"faults": faults, "runs": runs, "seconds_per_fault": seconds_per_fault, "clients": clients,
            "timeout_s": timeout_s, "deadline_s": timeout_s + slack_s, "rows": rows, "total": total,
            "hung_clients": sum(r["hung"] for r in results), "client_moves": sum(r["moves"] for r in results)}


def format_table(r: dict) -> str:
    lines = [f"chaos: {r['clients']} clients, {r['runs']} run(s), {r['seconds_per_fault']:g} s quiet after each fault; "
             f"deadline {r['deadline_s']:g} s (timeout {r['timeout_s']:g} s + slack); "
             "left: shards that left the pool",
             f"{'fault':<20}{'ops':>7}{'chunks':>8}{'wrong B':>8}{'untyped':>8}{'typed':>14}{'>deadline':>10}"
             f"{'max s':>7}{'left':>7}  recovery s"]
    for name, row in r["rows"].items():
        typed = ",".join(f"{s}x{n}" for s, n in sorted(row["typed"].items())) or "-"
        rec = ",".join("never" if x is None else f"{x:.2f}" for x in row["recovery_s"]) or "-"
        lines.append(f"{name:<20}{row['ops']:>7}{row['chunks_read']:>8}{row['wrong_bytes']:>8}"
                     f"{sum(v['count'] for v in row['untyped'].values()):>8}{typed:>14}{row['over_deadline']:>10}"
                     f"{row['max_call_s']:>7.2f}{row['members_left']:>7}  {rec}")
    for name, row in r["rows"].items():
        for t, v in row["untyped"].items():
            lines.append(f"untyped in {name}: {t} x{v['count']}: {v['example']}")
        for status, example in row["typed_example"].items():
            lines.append(f"typed {status} in {name}, e.g. {example}")
        for o in row["occurrences"]:
            if o["error"]:
                lines.append(f"fault {o['phase']} did not complete: {o['error']}")
            if o["notes"]:
                lines.append(f"{o['phase']}: injected in {o['inject_s']} s; {o['notes']}")
    t = r["total"]
    lines.append(f"total: {t['ops']} ops, {t['chunks_read']} chunks read, wrong bytes {t['wrong_bytes']}, "
                 f"untyped errors {t['untyped']}, over deadline {t['over_deadline']}, hung clients {r['hung_clients']}")
    return "\n".join(lines)
