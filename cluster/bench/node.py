"""``kvpool bench datapath``: kvpool's data path as engines use it measured with exactly the operations
and the shape of ``kvpool bench peers``, and (``peers=True``) Mooncake Store, Redis and memcpy in the
same invocation, round for round, with the ratios kvpool/peer of each round.

Setup: a local 2-node Ray cluster on the loopback address (:func:`kvpool.cluster.local.local_cluster`)
with the pool up (one shard per node, pages of the large size plus 4 KiB, a Redis index of its own:
a ``redis-server`` this run starts on a free port, the slabs and node files in /dev/shm as in
production), up for kvpool's part of each round only: each system is measured alone. The engine side is two plain worker processes
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
- **get_cross**: the reader reads it cold: one socket call, in which its shard looks the key up in
  the index and fetches the chunk from the writer's shard over their TCP peer link (the lookup is
  inside the timed get, as Mooncake's get includes its metadata lookup). The harness first waits
  (untimed) until the index lists the key (the shard publishes just after the commit), asking
  Redis itself so that nothing is remembered on the reader's side. ``get_cross_no_outs`` is the
  reader's second read, into a fresh array, with the location its first read left.
- **copy** (memcpy): ``numpy.copyto`` of the same sizes in the writer process; beside it
  **copy_checksum**: ``kvpool.checksum.copy_with_checksum`` heap to heap (the verified copy a put or
  a same-node get makes), the ceiling of a verified copy on this machine.

Every get is timed twice, into preallocated ``outs`` buffers (the engine's case, the main figure)
and without (a fresh array), same-node in alternating order; every read is checked byte for byte outside
the timed section; a wrong or missing byte fails the run. Timing is inside the worker process
(the harness's pipe round trips are not counted), as in ``kvpool bench peers``. The peers'
round ``i`` (``kvpool.bench.peers.run(rounds=1)``) runs right after kvpool's round ``i``, once the
pool's cluster is down (alone on the machine, as kvpool's round was).

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

Ratios, targets and the table: :mod:`kvpool.cluster.bench.node_report`.

This module imports Ray only in :func:`run`; the engine side, ``python -m
kvpool.cluster.bench.node_worker``, never does.
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

from kvpool.bench import peer_procs as W
from kvpool.bench import peers as P
from kvpool.cluster.bench.node_report import (  # noqa: F401 - failures and format_table: this module's API
    OPS,
    RTT_CALLS,
    SMALL,
    _merge_peer_runs,
    _merge_rounds,
    _round_ratios,
    _targets,
    failures,
    format_table,
)
from kvpool.cluster.bench.node_worker import FILLER_BYTES, TENANT
from kvpool.index import open_index

NS = "kvpool-bench-node"
DEFAULT_OPS = {"small": 200, "large": 8}
DEFAULT_WARMUP = {"small": 5, "large": 1}
DEFAULT_DRAM_PAGES = 32  # x (32 MiB + 4 KiB) = ~1 GiB per node's slab


def sizes_for(large_mib: int = 32) -> dict:
    return {SMALL: 256 << 10, f"{large_mib}MiB": large_mib << 20}


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"bench datapath: {text}", file=sys.stderr, flush=True)


# --- the engine's worker process (kvpool.cluster.bench.node_worker), as the parent sees it ---------

class _Worker(W.WorkerProcess):
    """A child ``python -m kvpool.cluster.bench.node_worker`` (the engine side, no Ray)."""

    def __init__(self, name: str, config: dict, log_dir: str, start_timeout_s: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self._start(name, ["-m", "kvpool.cluster.bench.node_worker", "--config", json.dumps(config)], env, log_dir,
                    start_timeout_s, "kvpool-bench-node")

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
    port = W.free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", log_dir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=W.die_with_parent)
    try:
        if not W.wait_port(port, proc, 10):
            raise RuntimeError(f"redis-server did not listen on 127.0.0.1:{port}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        W.stop(proc)


@contextlib.contextmanager
def _pool(run_dir: str, index_url: str, page_bytes: int, dram_pages: int, progress: bool):
    """The 2-node cluster with the pool up; yields (head shard id, other shard id, free_pages(sid))."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from kvpool.cluster.bootstrap import shard_id_of, up
    from kvpool.cluster.local import local_cluster
    from kvpool.cluster.shard import shard_name
    from kvpool.node.paths import own_run_dir

    with own_run_dir(run_dir), local_cluster(2, namespace=NS, object_store_memory=256 << 20,
                                             logging_level="WARNING") as (_, nodes):  # the shards inherit it
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


def _summary(name: str, seconds: list[float], size: int) -> dict:
    return P.latency_summary(seconds) if name == SMALL else P.throughput_summary(seconds, size)


def _brief(name: str, s: dict) -> str:
    if name == SMALL:
        return f"p50 {s['p50_ms']:.3f} ms p99 {s['p99_ms']:.3f} ms"
    return f"{s['gbps_median']:.2f} GB/s (min {s['gbps_min']:.2f})"


def _listed(index, key: str, wait_s: float = 10.0) -> float:
    """Seconds until the pool's index lists ``key`` (the tenant's address of it)."""
    from kvpool.auth import scope_tag, scoped
    from kvpool.keys import ChunkKey

    where = scoped([ChunkKey(bytes.fromhex(key))], scope_tag(TENANT))
    t0 = time.monotonic()
    while index.lookup(where).count < 1 and time.monotonic() - t0 < wait_s:
        time.sleep(0.0005)
    return time.monotonic() - t0


def _kvpool_round(writer: _Worker, reader: _Worker, rnd: int, sizes: dict, ops: dict, warmup: dict,
                  progress: bool, tally: dict, index) -> dict:
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
            waited = _listed(index, key)  # untimed: the index lists it (the shard publishes just after the commit)
            # cold: nothing looked up before, the shard's lookup is inside the timed get (as Mooncake's is);
            # the second read of the pair (get_cross_no_outs) finds the location the first one left
            cross = {**reader.call(op="get", key=key, name=name, seed=seed, outs_first=True), "waited_s": waited}
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
                               "index": "redis-server of its own", "worker": "python -m kvpool.cluster.bench.node"}}
    tally = {"wrong_bytes": 0, "missing": 0, "put_failed": 0, "outs_unused": 0, "wrong_path": 0,
             "index_wait_s": 0.0, "calls": {name: 0 for name in sizes}, "breakdown": {}}
    kv_rounds, mem_rounds, mem_wrong, peer_runs, rtt_rounds = [], [], 0, [], {}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where production keeps the slabs
    op_s: dict[str, dict[str, float]] = {"writer's": {}, "reader's": {}}
    counts: dict[str, dict[str, int]] = {"writer": {}, "reader": {}}
    imported_ray, peer_fetched = False, 0
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-node-", dir=shm) as tmp, _own_redis(tmp) as index_url:
        for rnd in range(rounds):
            # Each system alone: the pool's cluster is up for kvpool's round only, the peers run after it is down.
            run_dir = os.path.join(tmp, f"run-{rnd}")
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
                m = writer.call(op="memcpy", ops=ops, warmup=warmup, timeout_s=300)
                mem_wrong += m["wrong"]
                mem = {name: {kind: _summary(name, ts, sizes[name]) for kind, ts in m["times"][name].items()}
                       for name in sizes}
                for role, w in (("writer", writer), ("reader", reader)):
                    rtt_rounds.setdefault(role, []).append(P.latency_summary(w.call(op="rtt", n=RTT_CALLS)["s"]))
                mem_rounds.append(mem)
                _say(progress, f"round {rnd + 1} memcpy: " + "; ".join(f"{n} {_brief(n, mem[n]['copy'])}" for n in sizes))
                with contextlib.closing(open_index(index_url)) as index:
                    kv_rounds.append(_kvpool_round(writer, reader, rnd, sizes, ops, warmup, progress, tally, index))
                for role, w in (("writer's", writer), ("reader's", reader)):
                    after = w.call(op="stats")
                    peer_fetched += after.get("peer_fetched") or 0
                    for op, sec in after["node_op_s"].items():
                        if op != "stats" and sec - op_before[w].get(op, 0.0) > 0:
                            op_s[role][op] = op_s[role].get(op, 0.0) + sec - op_before[w].get(op, 0.0)
                for name, w in (("writer", writer), ("reader", reader)):
                    f = w.quit()
                    imported_ray |= bool(f["ray_imported"])
                    for c, n in f["counts"].items():
                        counts[name][c] = counts[name].get(c, 0) + n
            if peers:
                _say(progress, f"round {rnd + 1}: the peers alone (kvpool.bench.peers, one round; it says 'round 1')")
                pr = P.run(rounds=1, peers=P.PEERS, progress=progress, redis_url=redis_url,
                           ops={SMALL: ops[SMALL], "32MiB": ops[large]},
                           warmup={SMALL: warmup[SMALL], "32MiB": warmup[large]})
                peer_runs.append(pr)
    kv = _merge_rounds(kv_rounds)
    kv.update({k: tally[k] for k in ("wrong_bytes", "missing", "put_failed", "outs_unused", "wrong_path")})
    kv["put_forwarded"] = counts["writer"].get("put_forwarded", 0)
    kv["index_wait_s_max"] = tally["index_wait_s"]
    kv["node_rtt"] = {f"{role}'s shard": P.range_over_rounds(rs) for role, rs in rtt_rounds.items()}
    kv["workers_imported_ray"] = imported_ray
    kv["client_counts"] = counts
    kv["node_op_s"] = {f"{role} shard": ops_ for role, ops_ in op_s.items()}
    kv["node_op_s"]["ops_per_size"] = tally["calls"]
    kv["breakdown_ms"] = {name: _breakdown_ms(tally["breakdown"].get(name, {})) for name in sizes}
    kv["node_op_s"]["peer_fetched"] = peer_fetched
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
