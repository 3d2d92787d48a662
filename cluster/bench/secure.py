"""``kvpool bench secure``: what a pool locked by default costs on the engines' hot paths, side by
side with an open pool in one run.

Two single-node pools run at the same time on this machine, each on a Ray head of its own:

- **secured**: ``kvpool up``'s defaults (a Ray head with token authentication, a pool secret in a
  0600 file): the engine presents a credential the shard verifies;
- **insecure**: a Ray head without a token (``--insecure-ray``) and a pool without a secret: the
  engine names its tenant bare.

One engine process (no Ray) holds a ``NodeClient`` of each pool's shard and runs the same
operations on both, alternating which pool goes first at every step, so that whatever else loads
the machine loads both alike. Each step: a **put** of one new 256 KiB chunk (reserve on the socket,
copy and hash into the slab, commit; both slabs are filled first, so every put evicts), a
**get_same** of it (from the node's shared memory, into a preallocated buffer; its bytes checked
after the timed call), a **lookup_here** of the 16 chunks put last (the node's page table, no call)
and a **lookup_miss** of 16 keys nobody stored (one socket call: the shard asks the pool's index).
Per round: the median of each operation on each pool and their ratio, and the median over steps
of each step's own ratio secured/insecure (**paired**: the two calls of a step are made within a
millisecond of each other, so load that comes and goes cancels out); ranges are over rounds. The
target: no hot path worse by more than 5% (the median of the paired ratios of every step of the
run). ``--control`` runs the same harness on
two open pools: the spread it shows between equal pools.

This module imports Ray nowhere: the pools are started and stopped by ``kvpool`` processes.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from kvpool.bench import peer_procs as W
from kvpool.bench.peers import percentile
from kvpool.cluster.bench.node import _own_redis

TENANT = "bench"
CHUNK = 256 << 10
PAGE = CHUNK + 4096
OPS = ("put", "get_same", "lookup_here", "lookup_miss")
LOOKUP_KEYS = 16
BOUND = 1.05

INSECURE_UP = """
import json, sys
from kvpool.cluster import bootstrap, ops
ops.connect(None, start_local=True, insecure_ray=True)
bootstrap.up(store={"page_bytes": %d, "dram_pages": %d}, tenants=[{"id": %r}], namespace=ops.NAMESPACE, secret=None,
             index_url=%r)
"""


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"bench secure: {text}", file=sys.stderr, flush=True)


def _env(home: str, secured: bool) -> dict:
    """A pool's own everything: HOME, Ray's temp dir and head record, its run dir, its secrets."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "KVPOOL_SECRET", "KVPOOL_CREDENTIAL", "KVPOOL_RUN_DIR"))}
    env.update({"HOME": home, "RAY_TMPDIR": home, "KVPOOL_LOCAL_RAY_RECORD": os.path.join(home, "ray.json"),
                "KVPOOL_RUN_DIR": os.path.join(home, "run"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    if secured:
        env.update({"RAY_AUTH_TOKEN_PATH": os.path.join(home, "ray-token"),
                    "KVPOOL_SECRET_FILE": os.path.join(home, "secret")})
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    return env


def _kvpool(env: dict, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout_s, env=env)


@contextlib.contextmanager
def _pool(home: str, secured: bool, dram_pages: int, progress: bool, redis_url: str | None = None):
    """One pool up (see the module docstring), its index a Ray actor or the Redis at ``redis_url``
    (the secured pool: ACL users made on it first, the shards given the shard user's URL); yields
    its facts for the worker."""
    env = _env(home, secured)
    os.makedirs(env["KVPOOL_RUN_DIR"], mode=0o700)
    name = "secured" if secured else "insecure"
    if secured:
        redis = []
        if redis_url:
            from kvpool.index.redis_acl import apply

            redis = ["--redis", apply(redis_url, lock_default=True)["shard"]]
        r = _kvpool(env, "-m", "kvpool.cli", "up", "--ray-address", "local", "--page-size", str(PAGE), "--dram-pages", str(dram_pages),
                    "--tenant", TENANT, "--secret-file", env["KVPOOL_SECRET_FILE"], *redis)
    else:
        r = _kvpool(env, "-c", INSECURE_UP % (PAGE, dram_pages, TENANT, redis_url))
    try:
        if r.returncode:
            raise RuntimeError(f"the {name} pool did not start:\n{r.stderr[-3000:]}")
        record = json.loads(open(env["KVPOOL_LOCAL_RAY_RECORD"]).read())
        deadline = time.monotonic() + 60
        while not glob.glob(os.path.join(env["KVPOOL_RUN_DIR"], "kvpool-*.node")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} pool's node file did not appear in {env['KVPOOL_RUN_DIR']}")
            time.sleep(0.1)
        (node_file,) = glob.glob(os.path.join(env["KVPOOL_RUN_DIR"], "kvpool-*.node"))
        shard = json.loads(open(node_file).read())["shard"]
        _say(progress, f"{name} pool up (Ray auth: {record.get('ray_auth_mode')}, shard {shard})")
        yield {"run_dir": env["KVPOOL_RUN_DIR"], "shard": shard, "ray_auth_mode": record.get("ray_auth_mode"),
               "secret_file": env.get("KVPOOL_SECRET_FILE")}
    finally:
        d = _kvpool(env, "-m", "kvpool.cli", "down", "--stop-ray", timeout_s=120)
        if d.returncode:
            _say(progress, f"{name} pool: kvpool down failed: {d.stderr[-1000:]}")


class _Worker(W.WorkerProcess):
    """The engine: ``python -m kvpool.cluster.bench.secure --worker CONFIG`` (no Ray)."""

    def __init__(self, config: dict, log_dir: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self._start("engine", ["-m", "kvpool.cluster.bench.secure", "--worker", json.dumps(config)], env, log_dir,
                    60, "kvpool-secure")


def run(rounds: int = 3, steps: int = 300, warmup: int = 100, dram_pages: int = 64, index: str = "actor",
        control: bool = False, progress: bool = True) -> dict:
    """See the module docstring. ``steps`` per round (each: the four operations on both pools);
    ``index``: ``actor`` (the pool's own, a Ray actor: ``kvpool up`` without --redis) or ``redis``
    (a redis-server of each pool's own, as ``kvpool up --redis``). ``control``: both pools open
    (the "secured" one too): the ratios this harness shows between two equal pools, its noise."""
    if rounds < 1 or steps < 10 or warmup < 0 or dram_pages < LOOKUP_KEYS + 4 or index not in ("actor", "redis"):
        raise ValueError(f"rounds >= 1, steps >= 10, warmup >= 0, dram_pages >= {LOOKUP_KEYS + 4}, "
                         "index actor or redis")
    home = tempfile.mkdtemp(prefix="kvs", dir="/tmp")  # NOTE: short: Ray's socket paths live under it
    try:
        with contextlib.ExitStack() as stack:
            urls = [stack.enter_context(_own_redis(home)) for _ in range(2)] if index == "redis" else [None, None]
            sec = stack.enter_context(_pool(os.path.join(home, "s"), not control, dram_pages, progress, urls[0]))
            ins = stack.enter_context(_pool(os.path.join(home, "o"), False, dram_pages, progress, urls[1]))
            worker = _Worker({"secured": sec, "insecure": ins}, home)
            try:
                checks = worker.call(op="check")
                worker.call(op="fill", n=dram_pages, timeout_s=300)
                per_round = []
                for rnd in range(rounds):
                    r = worker.call(op="round", steps=steps, warmup=warmup, seed=rnd, timeout_s=1800)
                    per_round.append(r)
                    _say(progress, f"round {rnd + 1}: " + "; ".join(
                        f"{op} {r['p50_us']['secured'][op]:.1f}/{r['p50_us']['insecure'][op]:.1f} us "
                        f"(paired {r['paired'][op]:.3f}x)" for op in OPS))
                end = worker.call(op="quit")
            finally:
                worker.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return _result({"rounds": rounds, "steps": steps, "warmup": warmup, "chunk_bytes": CHUNK, "page_bytes": PAGE,
                    "dram_pages": dram_pages, "lookup_keys": LOOKUP_KEYS, "index": index, "control": control},
                   sec, ins, checks, per_round, end)


def _result(config, sec, ins, checks, per_round, end) -> dict:
    def rng(values):
        return [min(values), max(values)]

    out = {"config": config,
           "pools": {"secured": {"ray_auth_mode": sec["ray_auth_mode"], **checks["secured"]},
                     "insecure": {"ray_auth_mode": ins["ray_auth_mode"], **checks["insecure"]}},
           "wrong_bytes": sum(r["wrong_bytes"] for r in per_round), "missing": sum(r["missing"] for r in per_round),
           "worker_imported_ray": end["ray_imported"]}
    for pool in ("secured", "insecure"):
        out[pool] = {op: {s: rng([r[s][pool][op] for r in per_round]) for s in ("p50_us", "p99_us")} for op in OPS}
    ratios = {op: [r["p50_us"]["secured"][op] / r["p50_us"]["insecure"][op] for r in per_round] for op in OPS}
    paired = {op: [r["paired"][op] for r in per_round] for op in OPS}
    out["ratios_per_round"] = {"p50 secured/insecure": ratios, "median of paired secured/insecure": paired}
    out["ratios"] = {op: rng(v) for op, v in ratios.items()}
    out["paired_ratios"] = {op: rng(v) for op, v in paired.items()}
    overall = {op: percentile([x for r in per_round for x in r["pairs"][op]], 0.5) for op in OPS}
    out["paired_all_steps"] = overall
    out["targets"] = [{"op": op, "ratio": "median of paired secured/insecure over every step", "bound": f"<= {BOUND}",
                       "value": v, "met": v <= BOUND} for op, v in overall.items()]
    return out


def failures(result: dict) -> list[str]:
    """What makes the run wrong (not slow): wrong or missing bytes, a pool that is not what it says."""
    out = []
    if result["wrong_bytes"] or result["missing"]:
        out.append(f"{result['wrong_bytes']} wrong bytes, {result['missing']} chunks missing")
    p = result["pools"]
    if result["config"]["control"]:
        return out
    if p["secured"]["ray_auth_mode"] != "token" or not p["secured"]["bare_name_refused"]:
        out.append(f"the secured pool is not locked: {p['secured']}")
    if p["insecure"]["ray_auth_mode"] != "disabled" or p["insecure"]["bare_name_refused"]:
        out.append(f"the insecure pool is not open: {p['insecure']}")
    if result["worker_imported_ray"]:
        out.append("the engine process imported Ray")
    return out


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [f"bench secure: {c['rounds']} rounds x {c['steps']} steps, 256 KiB chunks, index: {c['index']}, "
             "medians in us (range over rounds)" + (" -- CONTROL: both pools open" if c["control"] else ""), "",
             f"{'operation':<13} {'secured p50':>16} {'insecure p50':>16} {'ratio of p50s':>15} "
             f"{'paired ratio':>15} {'all steps':>9}  target (all steps)"]
    for op in OPS:
        s, i, r = result["secured"][op]["p50_us"], result["insecure"][op]["p50_us"], result["ratios"][op]
        q = result["paired_ratios"][op]
        met = next(t["met"] for t in result["targets"] if t["op"] == op)
        lines.append(f"{op:<13} {s[0]:7.1f}-{s[1]:<7.1f} {i[0]:7.1f}-{i[1]:<7.1f} {r[0]:6.3f}-{r[1]:<6.3f}  "
                     f"{q[0]:6.3f}-{q[1]:<6.3f}  {result['paired_all_steps'][op]:8.3f}   "
                     f"<= {BOUND} {'met' if met else 'NOT MET'}")
    lines.append(f"wrong bytes {result['wrong_bytes']}, missing {result['missing']}; Ray auth: secured "
                 f"{result['pools']['secured']['ray_auth_mode']}, insecure {result['pools']['insecure']['ray_auth_mode']}")
    return "\n".join(lines)


# --- the engine process ----------------------------------------------------------------------------

class _Engine:
    def __init__(self, cfg: dict) -> None:
        import numpy as np

        from kvpool.auth import Authority
        from kvpool.node.client import NodeClient
        from kvpool.private import read_private

        self.np = np
        self.pools = {}
        for name in ("secured", "insecure"):
            c = cfg[name]
            client = NodeClient(pool="default", shard=c["shard"], directory=c["run_dir"], timeout_s=10.0)
            if client._at is None:
                raise RuntimeError(f"the {name} pool's shard does not answer in {c['run_dir']}")
            who = Authority(read_private(c["secret_file"], "the pool secret", binary=True).strip()).issue(TENANT) \
                if c["secret_file"] else TENANT
            self.pools[name] = {"client": client, "who": who, "recent": []}
        self.src = np.zeros(CHUNK, dtype=np.uint8)
        self.out = np.zeros(CHUNK, dtype=np.uint8)

    @staticmethod
    def _key():
        from kvpool.keys import ChunkKey

        return ChunkKey(os.urandom(16))

    def check(self) -> dict:
        """Whether each pool refuses a bare tenant name (the secured one must, the open one must not)."""
        from kvpool.errors import KvPoolError

        out = {}
        for name, p in self.pools.items():
            try:
                p["client"].put(TENANT, [self._key()], [self.src[:4096]])
                out[name] = {"bare_name_refused": False}
            except KvPoolError as e:
                out[name] = {"bare_name_refused": e.status == 401}
        return out

    def fill(self, n: int) -> dict:
        data = self.np.ones(4096, dtype=self.np.uint8)
        for p in self.pools.values():
            for _ in range(n):
                p["client"].put(p["who"], [self._key()], [data])
        return {}

    def round(self, steps: int, warmup: int, seed: int) -> dict:
        times = {pool: {op: [] for op in OPS} for pool in self.pools}
        wrong = missing = 0
        clock = time.perf_counter
        for i in range(warmup + steps):
            order = list(self.pools) if i % 2 == 0 else list(self.pools)[::-1]
            self.src[:] = W.byte_pattern(CHUNK, (seed << 20) + i + 1)
            for name in order:
                p = self.pools[name]
                c, who, key = p["client"], p["who"], self._key()
                t0 = clock()
                stored = c.put(who, [key], [self.src])
                t1 = clock()
                got = c.get(who, [key], outs=[self.out])
                t2 = clock()
                here = c.lookup(who, p["recent"][-LOOKUP_KEYS:])
                t3 = clock()
                miss = c.lookup(who, [self._key() for _ in range(LOOKUP_KEYS)])
                t4 = clock()
                if stored != 1 or len(got) != 1:
                    missing += 1
                    continue
                wrong += int((self.out != self.src).sum())
                p["recent"] = (p["recent"] + [key])[-LOOKUP_KEYS:]
                if i < warmup or len(p["recent"]) < LOOKUP_KEYS:
                    continue
                missing += (here.count != LOOKUP_KEYS) + (miss.count != 0)
                for op, t in zip(OPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    times[name][op].append(t)
        pairs = {op: [a / b for a, b in zip(times["secured"][op], times["insecure"][op])] for op in OPS}
        paired = {op: percentile(v, 0.5) for op, v in pairs.items()}  # NOTE: one step's two calls: within ~1 ms
        return {s: {pool: {op: percentile(ts, q) * 1e6 for op, ts in ops.items()} for pool, ops in times.items()}
                for s, q in (("p50_us", 0.5), ("p99_us", 0.99))} | {"paired": paired, "pairs": pairs, "wrong_bytes": wrong,
                                                                    "missing": missing}


def _worker(cfg: dict) -> int:
    say = W.line_protocol()
    try:
        engine = _Engine(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say(error=f"{type(e).__name__}: {e}")
        return 1
    say(ready=True)
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.pop("op", None)
        if op == "quit":
            say(ray_imported="ray" in sys.modules)
            break
        try:
            say(**getattr(engine, op)(**msg)) if op in ("check", "fill", "round") else say(error=f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the parent
            say(error=f"{type(e).__name__}: {e}")
    for p in engine.pools.values():
        p["client"].close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        sys.exit("usage: python -m kvpool.cluster.bench.secure --worker CONFIG_JSON (started by kvpool bench secure)")
    sys.exit(_worker(json.loads(sys.argv[2])))
