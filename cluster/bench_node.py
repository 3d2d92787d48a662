"""``kvpool bench datapath``: kvpool's node data path (issue 17) measured with exactly the operations
and the shape of ``kvpool bench peers``, and (``peers=True``) Mooncake Store, Redis and memcpy in the
same invocation, round for round, with the ratios kvpool/peer of each round.

Setup: a local 2-node Ray cluster on the loopback address (:func:`kvpool.cluster.local.local_cluster`)
with the pool up (one shard per node, pages of the large size plus 4 KiB, a Redis index of its own:
a ``redis-server`` this run starts on a free port). The engine side is two plain worker processes
that never import Ray (checked in each worker after the work): the **writer** holds a
``kvpool.node.client.NodeClient`` of the head node's shard, the **reader** one of the other node's.
Both slabs are filled with small filler chunks first, so every measured put runs in the steady
state of a full cache (it evicts the least recently used page) and no put spills to the other node.

Per round, for each size (256 KiB, then the large size, 32 MiB by default), per key (a fresh
random 16-byte ``ChunkKey`` per operation, so no read ever sees what an earlier one left), after
untimed warm-up operations:

- **put**: the writer stores the key (its bytes already in the writer's buffer): reserve on the
  socket, one copy (and hash) into the slab, commit.
- **get_same**: the writer reads it back: from shared memory, no call.
- **get_cross**: the reader reads it: one socket call; its shard fetches the chunk from the
  writer's shard over their TCP peer link. The reader first waits (untimed) until the pool's index
  lists the key (the shard publishes just after the commit).
- **copy** (memcpy): ``numpy.copyto`` of the same sizes in the writer process; beside it
  **copy_checksum**: ``kvpool.checksum.copy_with_checksum`` heap to heap (the verified copy a put or
  a same-node get makes), the ceiling of a verified copy on this machine.

Every get is timed twice, into preallocated ``outs`` buffers (the engine's case, the main figure)
and without (a fresh array), in alternating order; every read is checked byte for byte outside
the timed section; a wrong or missing byte fails the run. Timing is inside the worker process
(the harness's pipe round trips are not counted), as in ``kvpool bench peers``. The peers'
round ``i`` (``kvpool.bench.peers.run(rounds=1)``) runs right after kvpool's round ``i``, while
the cluster stays up (same machine state for both).

Result of :func:`run` (``[lo, hi]``: the range over rounds of the per-round figure; 256 KiB:
per-operation latency percentiles in ms; the large size: GB/s (1e9 B/s) per operation, median and
minimum)::

    {"config": {"rounds": 3, "ops": {"256KiB": 200, "32MiB": 8}, "warmup": {...}, "sizes": {...},
                "page_bytes": ..., "dram_pages": ..., "peers": true, ...},
     "kvpool": {"256KiB": {"put": {"p50_ms": [lo, hi], "p99_ms": [lo, hi]},
                           "get_same": {...}, "get_cross": {...},
                           "get_same_no_outs": {...}, "get_cross_no_outs": {...}},
                "32MiB": {"put": {"gbps_median": [lo, hi], "gbps_min": [lo, hi]}, ...},
                "wrong_bytes": 0, "missing": 0, "put_failed": 0, "put_forwarded": 0,
                "outs_unused": 0, "wrong_path": 0, "index_wait_s_max": s, "workers_imported_ray": false,
                "node_rtt": {"writer's shard": {"p50_ms": [lo, hi], "p99_ms": [lo, hi]}, "reader's shard": ...},
                "client_counts": {"writer": {...}, "reader": {...}}, "node_op_s": {...},
                "breakdown_ms": {"256KiB": {"writer": {"call put_staged": {"calls": n, "ms_per_call": x},
                                                       "shard put_staged": {...}, "client_copy": {...}, ...},
                                            "reader": {"call get": ..., "shard get": ..., ...}}, "32MiB": ...}},
     "memcpy": {"256KiB": {"copy": {...}, "copy_checksum": {...}}, "32MiB": {...}, "wrong_bytes": 0},
     "peers": <kvpool.bench.peers.run()'s result, its rounds merged> | {"skipped": "why"},
     "ratios": {"256KiB p50 put kvpool/mooncake": [lo, hi], ..., "32MiB put kvpool/memcpy": [lo, hi], ...},
     "ratios_per_round": [{"256KiB p50 put kvpool/mooncake": x, ...}, ...],
     "targets": [{"name": ..., "ratio": "<a key of ratios>", "bound": "<= 2" | ">= 0.8", "range": [lo, hi],
                  "worst": x, "met": true}, ...]}

Ratios are computed per round, from the two figures of that round: latency ratios are
kvpool/peer ms (lower is better), throughput ratios kvpool/peer GB/s medians (higher is better);
``32MiB put kvpool/memcpy`` and ``32MiB get_same kvpool/memcpy`` divide by the memcpy of kvpool's
writer process in the same round (``32MiB copy_checksum/memcpy``: the verified copy's). A target is met when its worst round meets it. ``node_op_s``:
seconds each node-server operation handler ran during the measured rounds, per shard, with the
calls this benchmark made. ``breakdown_ms``: where a call's time goes, per size over all rounds
(warm-up included): each socket call as the engine timed it (``call OP``), the engine's copy into
the slab (``client_copy``), and the shard's handler of it (``shard OP``, from ``node_op_s`` between
the sizes), in ms per call; the reader's ``call lookup`` are its untimed waits for the index.

This module imports Ray only in the parent (in :func:`run`); ``python -m kvpool.cluster.bench_node
--worker`` (the engine side) never does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvpool.bench import peers as P

NS = "kvpool-bench-node"
TENANT = "bench"
SMALL = "256KiB"
DEFAULT_OPS = {"small": 200, "large": 8}
DEFAULT_WARMUP = {"small": 5, "large": 1}
DEFAULT_DRAM_PAGES = 32  # x (32 MiB + 4 KiB) = ~1 GiB per node's slab
FILLER_BYTES = 4096
RTT_CALLS = 200  # per worker and round: the node socket's round trip (``hello``)
OPS = ("put", "get_same", "get_cross")
TARGETS = (  # (name, ratio, "<=" or ">=", bound)
    ("256 KiB p50 same-node get within 2x of Mooncake's", "256KiB p50 get_same kvpool/mooncake", "<=", 2.0),
    ("256 KiB p50 put within 2x of Mooncake's", "256KiB p50 put kvpool/mooncake", "<=", 2.0),
    ("256 KiB p50 cross-node get within 2x of Mooncake's cross-process get",
     "256KiB p50 get_cross kvpool/mooncake", "<=", 2.0),
    ("32 MiB same-node get >= 0.8x memcpy", "32MiB get_same kvpool/memcpy", ">=", 0.8),
    ("32 MiB put >= 0.8x memcpy", "32MiB put kvpool/memcpy", ">=", 0.8),
    ("32 MiB cross-node get >= 1.0x Mooncake's cross-process get", "32MiB get_cross kvpool/mooncake", ">=", 1.0),
)


def sizes_for(large_mib: int = 32) -> dict:
    return {SMALL: 256 << 10, f"{large_mib}MiB": large_mib << 20}


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"bench datapath: {text}", file=sys.stderr, flush=True)


# --- the engine side: a worker process without Ray ---------------------------------------------

class _Engine:
    """One NodeClient of one shard, a source buffer and preallocated ``outs`` buffers."""

    def __init__(self, cfg: dict) -> None:
        from kvpool.node.client import NodeClient

        self.sizes = cfg["sizes"]
        self.client = NodeClient(pool="default", shard=cfg["shard"], directory=cfg["run_dir"],
                                 timeout_s=cfg.get("timeout_s", 10.0))
        if self.client._at is None:
            raise RuntimeError(f"shard {cfg['shard']} does not answer in {cfg['run_dir']}")
        self.phase: dict[str, list] = {}
        self._instrument()
        n = max(self.sizes.values())
        self.src = np.zeros(n, dtype=np.uint8)
        self.outs = {name: np.zeros(size, dtype=np.uint8) for name, size in self.sizes.items()}

    def _instrument(self) -> None:
        """Where a call's time goes, seen from the engine: each socket call (by operation) and the
        client's own copy into the slab (``client_copy``); a perf_counter pair each, ~1 us."""
        from kvpool.node import client as mod

        phase, clock = self.phase, time.perf_counter

        def timed(name, fn):
            def wrapper(*a, **kw):
                t0 = clock()
                try:
                    return fn(*a, **kw)
                finally:
                    acc = phase.setdefault(name(a), [0, 0.0])
                    acc[0] += 1
                    acc[1] += clock() - t0
            return wrapper

        self.client._call = timed(lambda a: f"call {a[0]}", self.client._call)
        if hasattr(mod, "copy_with_checksum"):
            mod.copy_with_checksum = timed(lambda a: "client_copy", mod.copy_with_checksum)

    def phases(self) -> dict:
        out = {k: list(v) for k, v in self.phase.items()}
        self.phase.clear()
        return {"phases": out}

    @staticmethod
    def _key(hexkey: str):
        from kvpool.keys import ChunkKey

        return ChunkKey(bytes.fromhex(hexkey))

    def put(self, key: str, size: int, seed: int) -> dict:
        self.src[:size] = P.byte_pattern(size, seed)
        k = self._key(key)
        data = self.src[:size]
        t0 = time.perf_counter()
        n = self.client.put(TENANT, [k], [data])
        t = time.perf_counter() - t0
        return {"s": t, "stored": n}

    def get(self, key: str, name: str, seed: int, outs_first: bool, wait_s: float = 0.0) -> dict:
        size = self.sizes[name]
        k = self._key(key)
        waited = 0.0
        if wait_s:  # untimed: the index lists the chunk (published just after the commit)
            t0 = time.monotonic()
            while self.client.lookup(TENANT, [k]).count < 1 and time.monotonic() - t0 < wait_s:
                time.sleep(0.0005)
            waited = time.monotonic() - t0
        out = self.outs[name]
        res = {"waited_s": waited, "wrong": 0, "missing": 0}
        before = dict(self.client.counts)
        for with_outs in ((True, False) if outs_first else (False, True)):
            if with_outs:
                out[:] = 0
                t0 = time.perf_counter()
                got = self.client.get(TENANT, [k], outs=[out])
                t = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                got = self.client.get(TENANT, [k])
                t = time.perf_counter() - t0
            if len(got) != 1:
                res["missing"] += 1
                res["wrong"] += size
            else:
                res["wrong"] += P.count_wrong_bytes(got[0], seed, size)
                if with_outs and got[0].ctypes.data != out.ctypes.data:
                    res["outs_unused"] = res.get("outs_unused", 0) + 1
                    res["wrong"] += P.count_wrong_bytes(out, seed, size)
            res["s_outs" if with_outs else "s_plain"] = t
        res["paths"] = {c: self.client.counts[c] - before.get(c, 0) for c in ("get_shm", "get_remote", "get_failed")}
        return res

    def fill(self, n: int, seed: int) -> dict:
        """``n`` small filler chunks (one page each), untimed."""
        stored = 0
        data = P.byte_pattern(FILLER_BYTES, seed)
        for _ in range(n):
            stored += self.client.put(TENANT, [self._key(os.urandom(16).hex())], [data])
        return {"stored": stored}

    def memcpy(self, ops: dict, warmup: dict) -> dict:
        """``copy``: numpy.copyto; ``copy_checksum``: kvpool.checksum.copy_with_checksum (the copy a
        put or a same-node get makes, with its xxh3 in the same pass), heap to heap, alternating."""
        from kvpool.checksum import checksum
        from kvpool.checksum import copy_with_checksum as cwc

        out, wrong = {}, 0
        for name, size in self.sizes.items():
            src = np.empty(size, dtype=np.uint8)
            dst = np.empty(size, dtype=np.uint8)
            times = {"copy": [], "copy_checksum": []}
            for i in range(warmup[name] + ops[name]):
                seed = i + 1
                src[:] = P.byte_pattern(size, seed)
                for kind in (("copy", "copy_checksum") if i % 2 == 0 else ("copy_checksum", "copy")):
                    dst[:] = 0
                    t0 = time.perf_counter()
                    if kind == "copy":
                        np.copyto(dst, src)
                    else:
                        digest = cwc(dst, src)
                    t = time.perf_counter() - t0
                    wrong += P.count_wrong_bytes(dst, seed, size)
                    if kind == "copy_checksum" and digest != checksum(src):
                        wrong += 1
                    if i >= warmup[name]:
                        times[kind].append(t)
            out[name] = times
        return {"times": out, "wrong": wrong}

    def rtt(self, n: int) -> dict:
        """``n`` calls of the node's trivial ``hello`` operation: the socket's round trip alone."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.client._call("hello", {})
            times.append(time.perf_counter() - t0)
        return {"s": times}

    def stats(self) -> dict:
        r, _ = self.client._call("stats", {})
        return {"node_op_s": r.get("node_op_s", {}), "node_served": r.get("node_served"),
                "peer_fetched": r.get("peer_fetched"), "peer_failed": r.get("peer_failed")}

    def close(self) -> dict:
        counts = dict(self.client.counts)
        self.client.close()
        return {"counts": counts}


def _worker_main(config: dict) -> int:
    """Requests on stdin, one JSON answer per line on the saved stdout (as kvpool.bench.peers)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(**msg) -> None:
        proto.write(json.dumps(msg) + "\n")

    try:
        engine = _Engine(config)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say(error=f"{type(e).__name__}: {e}")
        return 1
    say(ready=True, pid=os.getpid(), endpoint=config["shard"], ray_imported="ray" in sys.modules)
    closed = False
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.pop("op", None)
        try:
            if op == "quit":
                r = engine.close()
                closed = True
                say(**r, ray_imported="ray" in sys.modules)
                break
            fn = getattr(engine, op, None) if op in ("put", "get", "fill", "memcpy", "stats", "phases", "rtt") else None
            if fn is None:
                say(error=f"unknown op {op!r}")
                continue
            say(**fn(**msg))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            say(error=f"{type(e).__name__}: {e}")
    if not closed:
        engine.close()
    return 0


class _Worker(P.WorkerProcess):
    """A child ``python -m kvpool.cluster.bench_node --worker`` (the engine side, no Ray)."""

    def __init__(self, name: str, config: dict, log_dir: str, start_timeout_s: float = 60.0) -> None:
        self.peer = name
        fd, self.log = tempfile.mkstemp(prefix=f"kvpool-bench-node-{name}-", suffix=".log", dir=log_dir)
        os.close(fd)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.cluster.bench_node", "--worker", "--config", json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True, bufsize=1,
                preexec_fn=P._die_with_parent,
            )
        try:
            self.hello = self._read(start_timeout_s)
        except BaseException:
            self.close()
            raise
        if "error" in self.hello:
            self.close()
            raise RuntimeError(f"{name} worker: {self.hello['error']}")

    def quit(self) -> dict:
        try:
            return self.call(op="quit", timeout_s=30)
        finally:
            self.close()


# --- the parent: cluster, rounds, peers, ratios -------------------------------------------------

@contextlib.contextmanager
def _own_redis(log_dir: str):
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not on PATH (the pool's index)")
    port = P.free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", log_dir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=P._die_with_parent)
    try:
        if not P._wait_port(port, proc, 10):
            raise RuntimeError(f"redis-server did not listen on 127.0.0.1:{port}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        P._stop(proc)


@contextlib.contextmanager
def _pool(run_dir: str, index_url: str, page_bytes: int, dram_pages: int, progress: bool):
    """The 2-node cluster with the pool up; yields (head shard id, other shard id, free_pages(sid))."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    old = os.environ.get("KVPOOL_RUN_DIR")
    os.environ["KVPOOL_RUN_DIR"] = run_dir  # the shards inherit it
    try:
        import ray

        from kvpool.cluster.bootstrap import shard_id_of, up
        from kvpool.cluster.local import local_cluster
        from kvpool.cluster.shard import shard_name

        with local_cluster(2, namespace=NS, object_store_memory=256 << 20, logging_level="WARNING") as (_, nodes):
            up(index_url=index_url, store={"page_bytes": page_bytes, "dram_pages": dram_pages},
               tenants=[{"id": TENANT}], namespace=NS)
            head = shard_id_of(ray.get_runtime_context().get_node_id())
            other = shard_id_of(nodes[0].node_id)
            files = [os.path.join(run_dir, f"kvpool-default-{s}.node") for s in (head, other)]
            deadline = time.monotonic() + 60
            while not all(os.path.exists(f) for f in files):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the shards' node files did not appear in {run_dir}")
                time.sleep(0.1)
            _say(progress, f"pool up: head shard {head}, other shard {other}")

            def free_pages(sid: str) -> int:
                return int(ray.get(ray.get_actor(shard_name("default", sid), namespace=NS).free_pages.remote(),
                                   timeout=30))

            yield head, other, free_pages
    finally:
        if old is None:
            os.environ.pop("KVPOOL_RUN_DIR", None)
        else:
            os.environ["KVPOOL_RUN_DIR"] = old


def _summary(name: str, seconds: list[float], size: int) -> dict:
    return P.latency_summary(seconds) if name == SMALL else P.throughput_summary(seconds, size)


def _brief(name: str, s: dict) -> str:
    if name == SMALL:
        return f"p50 {s['p50_ms']:.3f} ms p99 {s['p99_ms']:.3f} ms"
    return f"{s['gbps_median']:.2f} GB/s (min {s['gbps_min']:.2f})"


def _kvpool_round(writer: _Worker, reader: _Worker, rnd: int, sizes: dict, ops: dict, warmup: dict,
                  progress: bool, tally: dict) -> dict:
    out = {}
    for k, (name, size) in enumerate(sizes.items()):
        times = {op: [] for op in (*OPS, "get_same_no_outs", "get_cross_no_outs")}
        before = _snapshot(writer, reader)
        for i in range(warmup[name] + ops[name]):
            key = os.urandom(16).hex()
            seed = (rnd << 20) + (k << 16) + i + 1
            put = writer.call(op="put", key=key, size=size, seed=seed)
            if put["stored"] != 1:
                tally["put_failed"] += 1
                tally["missing"] += 2
                continue
            same = writer.call(op="get", key=key, name=name, seed=seed, outs_first=i % 2 == 0)
            cross = reader.call(op="get", key=key, name=name, seed=seed, outs_first=i % 2 == 1, wait_s=10.0)
            for r, path in ((same, "get_shm"), (cross, "get_remote")):
                tally["wrong_bytes"] += r["wrong"]
                tally["missing"] += r["missing"]
                tally["outs_unused"] += r.get("outs_unused", 0)
                if r["paths"].get(path, 0) != 2:
                    tally["wrong_path"] += 1
            tally["index_wait_s"] = max(tally["index_wait_s"], cross["waited_s"])
            if i >= warmup[name]:
                times["put"].append(put["s"])
                times["get_same"].append(same["s_outs"])
                times["get_cross"].append(cross["s_outs"])
                times["get_same_no_outs"].append(same["s_plain"])
                times["get_cross_no_outs"].append(cross["s_plain"])
            tally["calls"][name] += 1  # every operation, warm-up included (the shards' handler time does)
        _add_breakdown(tally["breakdown"].setdefault(name, {}), before, _snapshot(writer, reader))
        if not times["put"]:
            raise RuntimeError(f"round {rnd + 1}, {name}: no put stored anything")
        out[name] = {op: _summary(name, ts, size) for op, ts in times.items() if ts}
        _say(progress, f"round {rnd + 1} kvpool {name} ({ops[name]} ops): "
             + "; ".join(f"{op} {_brief(name, s)}" for op, s in out[name].items() if op in OPS))
    return out


def _snapshot(writer: _Worker, reader: _Worker) -> dict:
    """The shards' handler seconds so far, and the workers' call and copy times since the last one."""
    return {role: {"shard": w.call(op="stats")["node_op_s"], "client": w.call(op="phases")["phases"]}
            for role, w in (("writer", writer), ("reader", reader))}


def _add_breakdown(acc: dict, before: dict, after: dict) -> None:
    """Adds one size phase's times to ``acc``: ``{"writer": {"shard put_staged": s, "call put_staged":
    [n, s], ...}, "reader": ...}`` (the shard's handler seconds, the engine's calls and copies)."""
    for role in ("writer", "reader"):
        r = acc.setdefault(role, {})
        for op, s in after[role]["shard"].items():
            d = s - before[role]["shard"].get(op, 0.0)
            if op != "stats" and d > 0:
                r[f"shard {op}"] = r.get(f"shard {op}", 0.0) + d
        for op, (n, s) in after[role]["client"].items():
            if op in ("call stats", "call phases"):
                continue
            cur = r.setdefault(op, [0, 0.0])
            cur[0] += n
            cur[1] += s


def _breakdown_ms(acc: dict) -> dict:
    """``acc`` (see :func:`_add_breakdown`) as ms per call: the engine's calls (``call OP``, timed in
    the engine, and ``client_copy``) by their own count, each shard's handler (``shard OP``) by the
    count of the calls it served (the engine's ``call OP`` on its own shard; ``peer_get``: one per
    cross-node ``get``)."""
    out = {}
    for role, r in acc.items():
        out[role] = {}
        for k, v in sorted(r.items()):
            if isinstance(v, list):
                out[role][k] = {"calls": v[0], "ms_per_call": v[1] / max(v[0], 1) * 1e3}
                continue
            op = k.split(" ", 1)[1]
            served = acc.get("reader", {}).get("call get") if op == "peer_get" else r.get(f"call {op}")
            n = served[0] if served else 0
            out[role][k] = {"calls": n, "ms_per_call": v / n * 1e3} if n else {"seconds": v}
    return out


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


def mooncake_installed() -> bool:
    return importlib.util.find_spec("mooncake") is not None


def run(rounds: int = 3, ops: dict | None = None, warmup: dict | None = None, large_mib: int = 32,
        peers: bool | None = None, redis_url: str = "redis://127.0.0.1:6379/0", dram_pages: int = DEFAULT_DRAM_PAGES,
        progress: bool = True) -> dict:
    """kvpool's node path (and, with ``peers``, the peers round for round); see the module docstring.
    ``ops``/``warmup``: ``{"small": n, "large": n}``. ``peers=None``: when Mooncake is importable."""
    ops_in = {**DEFAULT_OPS, **(ops or {})}
    warm_in = {**DEFAULT_WARMUP, **(warmup or {})}
    if rounds < 1 or min(ops_in.values()) < 1 or min(warm_in.values()) < 0 or large_mib < 1 or dram_pages < 4:
        raise ValueError("rounds, operation counts and --large-mib must be at least 1, dram_pages at least 4")
    peers = mooncake_installed() if peers is None else peers
    if peers and large_mib != 32:
        raise ValueError("the peers measure 32 MiB chunks: run them with large_mib=32 (or without peers)")
    sizes = sizes_for(large_mib)
    large = f"{large_mib}MiB"
    ops = {SMALL: ops_in["small"], large: ops_in["large"]}
    warmup = {SMALL: warm_in["small"], large: warm_in["large"]}
    page_bytes = sizes[large] + 4096
    result: dict = {"config": {"rounds": rounds, "ops": ops, "warmup": warmup, "sizes": sizes, "nodes": 2,
                               "page_bytes": page_bytes, "dram_pages": dram_pages, "peers": bool(peers),
                               "filler": f"both slabs filled with {FILLER_BYTES} B chunks first: puts evict",
                               "index": "redis-server of its own", "worker": "python -m kvpool.cluster.bench_node"}}
    tally = {"wrong_bytes": 0, "missing": 0, "put_failed": 0, "outs_unused": 0, "wrong_path": 0,
             "index_wait_s": 0.0, "calls": {name: 0 for name in sizes}, "breakdown": {}}
    kv_rounds, mem_rounds, mem_wrong, peer_runs, rtt_rounds = [], [], 0, [], {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-node-") as tmp, _own_redis(tmp) as index_url:
        run_dir = os.path.join(tmp, "run")
        os.mkdir(run_dir)
        with _pool(run_dir, index_url, page_bytes, dram_pages, progress) as (head, other, free_pages), \
                contextlib.ExitStack() as stack:
            cfg = {"run_dir": run_dir, "sizes": sizes}
            writer = _Worker("writer", {**cfg, "shard": head}, tmp)
            stack.callback(writer.close)
            reader = _Worker("reader", {**cfg, "shard": other}, tmp)
            stack.callback(reader.close)
            for w, sid in ((reader, other), (writer, head)):  # full slabs: puts evict and never spill
                w.call(op="fill", n=dram_pages, seed=7, timeout_s=300)
                if free_pages(sid) != 0:
                    raise RuntimeError(f"shard {sid} still has {free_pages(sid)} free pages after the filler")
            time.sleep(2.5)  # the shards' view of each other's free pages is refreshed every 2 s
            op_before = {w: w.call(op="stats")["node_op_s"] for w in (writer, reader)}
            for rnd in range(rounds):
                m = writer.call(op="memcpy", ops=ops, warmup=warmup, timeout_s=300)
                mem_wrong += m["wrong"]
                mem = {name: {kind: _summary(name, ts, sizes[name]) for kind, ts in m["times"][name].items()}
                       for name in sizes}
                for role, w in (("writer", writer), ("reader", reader)):
                    rtt_rounds.setdefault(role, []).append(P.latency_summary(w.call(op="rtt", n=RTT_CALLS)["s"]))
                mem_rounds.append(mem)
                _say(progress, f"round {rnd + 1} memcpy: " + "; ".join(f"{n} {_brief(n, mem[n]['copy'])}" for n in sizes))
                kv_rounds.append(_kvpool_round(writer, reader, rnd, sizes, ops, warmup, progress, tally))
                if peers:
                    _say(progress, f"round {rnd + 1}: the peers (kvpool.bench.peers, one round; it says 'round 1')")
                    pr = P.run(rounds=1, peers=P.PEERS, progress=progress, redis_url=redis_url,
                               ops={SMALL: ops[SMALL], "32MiB": ops[large]},
                               warmup={SMALL: warmup[SMALL], "32MiB": warmup[large]})
                    peer_runs.append(pr)
            op_after = {w: w.call(op="stats") for w in (writer, reader)}
            finals = {name: w.quit() for name, w in (("writer", writer), ("reader", reader))}
    kv = _merge_rounds(kv_rounds)
    counts = {n: f["counts"] for n, f in finals.items()}
    kv.update({k: tally[k] for k in ("wrong_bytes", "missing", "put_failed", "outs_unused", "wrong_path")})
    kv["put_forwarded"] = counts["writer"].get("put_forwarded", 0)
    kv["index_wait_s_max"] = tally["index_wait_s"]
    kv["node_rtt"] = {f"{role}'s shard": P.range_over_rounds(rs) for role, rs in rtt_rounds.items()}
    kv["workers_imported_ray"] = any(f["ray_imported"] for f in finals.values())
    kv["client_counts"] = counts
    kv["node_op_s"] = {
        f"{role} shard": {op: s - op_before[w].get(op, 0.0) for op, s in op_after[w]["node_op_s"].items()
                          if op != "stats" and s - op_before[w].get(op, 0.0) > 0}
        for role, w in (("writer's", writer), ("reader's", reader))}
    kv["node_op_s"]["ops_per_size"] = tally["calls"]
    kv["breakdown_ms"] = {name: _breakdown_ms(tally["breakdown"].get(name, {})) for name in sizes}
    kv["node_op_s"]["peer_fetched"] = op_after[writer].get("peer_fetched", 0) + op_after[reader].get("peer_fetched", 0)
    result["kvpool"] = kv
    result["memcpy"] = {**_merge_rounds(mem_rounds), "wrong_bytes": mem_wrong}
    if not peers:
        result["peers"] = {"skipped": "--no-peers" if mooncake_installed() else "mooncake is not installed"}
    else:
        result["peers"] = _merge_peer_runs(peer_runs)
    per_round = []
    for i in range(rounds):
        peer_rounds = {}
        if peers:
            for p in P.PEERS:
                if "skipped" not in peer_runs[i][p]:
                    peer_rounds[p] = peer_runs[i][p]
        per_round.append(_round_ratios(kv_rounds[i], mem_rounds[i], peer_rounds, large))
    keys = [k for k in per_round[0] if all(k in r for r in per_round)]
    result["ratios"] = {k: [min(r[k] for r in per_round), max(r[k] for r in per_round)] for k in keys}
    result["ratios_per_round"] = per_round
    result["targets"] = _targets(result["ratios"], large)
    return result


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


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvpool.cluster.bench_node")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    return _worker_main(json.loads(a.config))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
