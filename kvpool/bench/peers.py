"""``kvpool bench peers``: the operations kvpool's datapath claims are measured on (put, same-node get,
cross-process get of one 256 KiB chunk and of 32 MiB chunks), run in the same run on the peers that
are installed: Mooncake Store (its fast path: registered buffers, ``batch_put_from`` and
``batch_get_into``) and Redis (SET/GET of the bytes), beside a plain memcpy in one process.

Every figure is timed inside the process that makes the call (the harness's pipe round trips are not
counted), and every read is checked byte for byte against what was written.

- **put**: the writer process stores a fresh key (its bytes already in the writer's buffer).
- **get_same**: the writer process reads the key back (Mooncake: the bytes are in its own segment).
- **get_cross**: a second process, a client of its own, reads the key the writer put (Mooncake: the
  second client has its own segment; the bytes live in the writer's, checked, so the read crosses
  processes over TCP).
- **copy** (memcpy): ``numpy.copyto`` of the same sizes into another buffer, in this process.

Result of :func:`run` (``[lo, hi]`` is the range over rounds of the per-round figure; 256 KiB figures
are per-operation latency percentiles in ms, 32 MiB figures are GB/s (1e9 bytes/s) per operation,
their median and their minimum)::

    {"config": {"rounds": 3, "ops": {"256KiB": 200, "32MiB": 8}, "warmup": {"256KiB": 5, "32MiB": 1}, ...},
     "memcpy": {"256KiB": {"copy": {"p50_ms": [lo, hi], "p99_ms": [lo, hi]}},
                "32MiB": {"copy": {"gbps_median": [lo, hi], "gbps_min": [lo, hi]}},
                "wrong_bytes": 0},
     "mooncake": {"256KiB": {"put": {...}, "get_same": {...}, "get_cross": {...}},
                  "32MiB": {"put": {...}, "get_same": {...}, "get_cross": {...}},
                  "wrong_bytes": 0, "setup": {...}} | {"skipped": "why"},
     "redis": {... as mooncake ...} | {"skipped": "why"}}

A peer that is not installed (or whose service cannot start) is ``{"skipped": reason}``, except with
``CI=true``, where a missing Mooncake or Redis raises :class:`PeerMissing`.

Helpers the datapath benchmarks can reuse: :func:`byte_pattern`, :func:`count_wrong_bytes`,
:func:`latency_summary`, :func:`throughput_summary`, :func:`range_over_rounds`, :func:`free_port`
and :class:`WorkerProcess` (a line-JSON child process that keeps its stdout clean of native chatter;
these live in :mod:`kvpool.bench.peer_procs`, with the workers themselves).

Not a peer here: LMCache 0.5.6. Its wheel pulls cupy-cuda13x, cuda-python/cuda-bindings and numba and pins
numpy 2.2.6 (below the venv's), which is CUDA the CPU venv should not carry.

This module imports neither Ray nor an engine; mooncake and redis are imported inside functions (mooncake only
in the worker processes, so native logging never reaches this process's stdout).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from kvpool.bench.peer_procs import (
    MOONCAKE_LOCAL_BUFFER,
    MOONCAKE_SEGMENT,
    WorkerProcess,
    _mooncake_env,
    _mooncake_master_binary,
    byte_pattern,
    count_wrong_bytes,
    die_with_parent,
    free_port,
    stop,
    tail,
    wait_port,
)

SIZES = {"256KiB": 256 << 10, "32MiB": 32 << 20}
LATENCY_SIZES = ("256KiB",)  # reported as p50/p99 ms; the others as GB/s
DEFAULT_OPS = {"256KiB": 200, "32MiB": 8}
DEFAULT_WARMUP = {"256KiB": 5, "32MiB": 1}  # untimed operations before each size, per round
PEERS = ("mooncake", "redis")
OPS = ("put", "get_same", "get_cross")


class PeerMissing(RuntimeError):
    """A peer the run must measure (CI) is not installed or cannot start."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# --- helpers (reusable by kvpool's own datapath benchmarks) ---------------------------------------

def percentile(xs, q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s) - 1e-9) - 1))]


def latency_summary(seconds) -> dict:
    """p50 and p99 in milliseconds of per-operation times in seconds."""
    return {"p50_ms": percentile(seconds, 0.50) * 1e3, "p99_ms": percentile(seconds, 0.99) * 1e3}


def throughput_summary(seconds, nbytes: int) -> dict:
    """Median and minimum GB/s (1e9 bytes per second) over operations of ``nbytes`` each."""
    gbps = [nbytes / s / 1e9 for s in seconds]
    return {"gbps_median": percentile(gbps, 0.50), "gbps_min": min(gbps)}


def range_over_rounds(rounds: list[dict]) -> dict:
    """``[{"p50_ms": 1.0, ...}, {"p50_ms": 1.2, ...}]`` -> ``{"p50_ms": [1.0, 1.2], ...}``."""
    return {k: [min(r[k] for r in rounds), max(r[k] for r in rounds)] for k in rounds[0]}


# --- the services the peers' workers talk to ------------------------------------------------

@contextlib.contextmanager
def mooncake_master(log_dir: str):
    """``mooncake_master`` on free loopback ports as a child process, stopped on the way out (errors
    and Ctrl-C included). Yields ``(address, command)``."""
    binary = _mooncake_master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master not found in the mooncake package or on PATH")
    port, metrics = free_port(), free_port()
    cmd = [binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
           "--metrics_host=127.0.0.1", "--enable_http_metadata_server=false", "--logtostderr"]
    log = os.path.join(log_dir, "mooncake_master.log")
    proc = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_mooncake_env(),
                                    preexec_fn=die_with_parent)
        if not wait_port(port, proc, 20):
            raise RuntimeError(f"mooncake_master did not listen on 127.0.0.1:{port} "
                               f"(exit {proc.poll()}); its log:\n{tail(log)}")
        yield f"127.0.0.1:{port}", cmd
    finally:
        stop(proc)


def _redis_reachable(url: str) -> bool:
    try:
        import redis

        r = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return bool(r.ping())
        finally:
            r.close()
    except Exception:
        return False


@contextlib.contextmanager
def redis_service(url: str, log_dir: str):
    """``url`` when a Redis answers there, else a redis-server of its own on a free port (stopped on
    the way out). Yields ``(url, how)``."""
    if _redis_reachable(url):
        yield url, f"existing server at {url}"
        return
    if shutil.which("redis-server") is None:
        raise RuntimeError(f"no Redis at {url} and redis-server is not on PATH")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", log_dir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        if not wait_port(port, proc, 10):
            raise RuntimeError(f"redis-server did not listen on 127.0.0.1:{port}")
        own = f"redis://127.0.0.1:{port}/0"
        yield own, f"own redis-server at {own}"
    finally:
        stop(proc)


# --- the measurements ----------------------------------------------------------------------------

def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"bench peers: {text}", file=sys.stderr, flush=True)


def _summary(size_name: str, seconds: list[float]) -> dict:
    if size_name in LATENCY_SIZES:
        return latency_summary(seconds)
    return throughput_summary(seconds, SIZES[size_name])


def _brief(size_name: str, s: dict) -> str:
    if size_name in LATENCY_SIZES:
        return f"p50 {s['p50_ms']:.3f} ms p99 {s['p99_ms']:.3f} ms"
    return f"{s['gbps_median']:.2f} GB/s (min {s['gbps_min']:.2f})"


def _memcpy_round(ops: dict, warmup: dict) -> tuple[dict, int]:
    out, wrong = {}, 0
    for name, size in SIZES.items():
        src = np.empty(size, dtype=np.uint8)
        dst = np.empty(size, dtype=np.uint8)
        times = []
        for i in range(warmup[name] + ops[name]):
            seed = i + 1
            src[:] = byte_pattern(size, seed)
            dst[:] = 0
            t0 = time.perf_counter()
            np.copyto(dst, src)
            t = time.perf_counter() - t0
            wrong += count_wrong_bytes(dst, seed, size)
            if i >= warmup[name]:
                times.append(t)
        out[name] = {"copy": _summary(name, times)}
    return out, wrong


def _peer_round(writer: WorkerProcess, reader: WorkerProcess, rnd: int, ops: dict, warmup: dict,
                check_placement: bool, progress: bool, peer: str) -> tuple[dict, int]:
    """One round on one peer: for each size, per key, put (writer), get_same (writer), get_cross
    (reader), then remove. Returns per-size summaries and the wrong bytes seen."""
    out, wrong = {}, 0
    tag = uuid.uuid4().hex[:8]
    for k, (name, size) in enumerate(SIZES.items()):
        times = {op: [] for op in OPS}
        for i in range(warmup[name] + ops[name]):
            key = f"kvpool-bench-peers-{tag}-{name}-{i}"
            seed = (rnd << 20) + (k << 16) + i + 1
            t_put = writer.call(op="put", key=key, size=size, seed=seed)["s"]
            if check_placement and i == 0:
                where = writer.call(op="where", key=key)["endpoint"]
                if where != writer.hello["endpoint"] or where == reader.hello["endpoint"]:
                    raise RuntimeError(f"{peer}: {key} was placed at {where}, not in the writer's segment "
                                       f"({writer.hello['endpoint']}); the cross-process read would not cross")
            same = writer.call(op="get", key=key, size=size, seed=seed)
            cross = reader.call(op="get", key=key, size=size, seed=seed)
            writer.call(op="remove", key=key)
            wrong += same["wrong"] + cross["wrong"]
            if i >= warmup[name]:
                times["put"].append(t_put)
                times["get_same"].append(same["s"])
                times["get_cross"].append(cross["s"])
        out[name] = {op: _summary(name, ts) for op, ts in times.items()}
        _say(progress, f"round {rnd + 1} {peer} {name} ({ops[name]} ops): "
             + "; ".join(f"{op} {_brief(name, s)}" for op, s in out[name].items()))
    return out, wrong


def _merge_rounds(rounds: list[dict]) -> dict:
    return {name: {op: range_over_rounds([r[name][op] for r in rounds]) for op in rounds[0][name]}
            for name in rounds[0]}


def _availability(peer: str) -> str | None:
    """Why ``peer`` cannot run here, or None."""
    if peer == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            return "mooncake is not installed (pip install mooncake-transfer-engine-non-cuda==0.3.13.post1)"
        if _mooncake_master_binary() is None:
            return "mooncake_master not found"
        return None
    if peer == "redis":
        if importlib.util.find_spec("redis") is None:
            return "redis-py is not installed"
        return None
    return f"unknown peer {peer!r} (choose from {', '.join(PEERS)})"


@contextlib.contextmanager
def _peer_service(peer: str, log_dir: str, redis_url: str):
    """The service a peer's clients talk to; yields (worker config, worker env, setup info)."""
    if peer == "mooncake":
        with mooncake_master(log_dir) as (addr, cmd):
            cfg = {"master": addr, "segment": MOONCAKE_SEGMENT, "local_buffer": MOONCAKE_LOCAL_BUFFER,
                   "max_size": max(SIZES.values())}
            setup = {"master": " ".join([os.path.basename(cmd[0]), *cmd[1:]]),
                     "setup": {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                               "global_segment_size": MOONCAKE_SEGMENT, "local_buffer_size": MOONCAKE_LOCAL_BUFFER,
                               "protocol": "tcp", "rdma_devices": "", "master_server_addr": addr},
                     "env": {"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
                     "put": "batch_put_from (registered buffer, ReplicateConfig.preferred_segment = own segment)",
                     "get": "batch_get_into (registered buffer)"}
            yield cfg, _mooncake_env(), setup
    elif peer == "redis":
        with redis_service(redis_url, log_dir) as (url, how):
            yield {"url": url}, None, {"server": how, "client": "redis-py SET/GET, one connection per process"}
    else:
        raise ValueError(peer)


def _run_peer(peer: str, rounds: int, ops: dict, warmup: dict, progress: bool, log_dir: str,
              redis_url: str) -> dict:
    why = _availability(peer)
    if why is not None:
        return {"skipped": why}
    with contextlib.ExitStack() as stack:  # closes the workers, then stops the service
        try:
            cfg, env, setup = stack.enter_context(_peer_service(peer, log_dir, redis_url))
        except Exception as e:
            return {"skipped": f"{type(e).__name__}: {e}"}
        try:
            writer = stack.enter_context(contextlib.closing(WorkerProcess(peer, cfg, env, log_dir)))
            reader = stack.enter_context(contextlib.closing(WorkerProcess(peer, cfg, env, log_dir)))
        except RuntimeError as e:
            return {"skipped": str(e)}
        per_round, wrong = [], 0
        for rnd in range(rounds):
            r, w = _peer_round(writer, reader, rnd, ops, warmup, peer == "mooncake", progress, peer)
            per_round.append(r)
            wrong += w
        result = _merge_rounds(per_round)
        result["wrong_bytes"] = wrong
        if peer == "mooncake":
            setup["placement"] = (f"writer's segment at {writer.hello['endpoint']}, reader's at "
                                  f"{reader.hello['endpoint']} (checked once per size and round)")
        result["setup"] = setup
        return result


def run(rounds: int = 3, peers=PEERS, progress: bool = True, ops: dict | None = None, warmup: dict | None = None,
        redis_url: str = "redis://127.0.0.1:6379/0") -> dict:
    """Every peer of ``peers`` and memcpy, ``rounds`` times each (see the module's docstring for the
    result). Under ``CI=true`` a skipped Mooncake or Redis raises :class:`PeerMissing`."""
    ops = {**DEFAULT_OPS, **(ops or {})}
    warmup = {**DEFAULT_WARMUP, **(warmup or {})}
    if rounds < 1 or min(ops.values()) < 1 or min(warmup.values()) < 0:
        raise ValueError("rounds and operation counts must be at least 1")
    result: dict = {"config": {"rounds": rounds, "ops": ops, "warmup": warmup, "sizes": dict(SIZES)}}
    mem_rounds, mem_wrong = [], 0
    for rnd in range(rounds):
        r, w = _memcpy_round(ops, warmup)
        mem_rounds.append(r)
        mem_wrong += w
        _say(progress, f"round {rnd + 1} memcpy: "
             + "; ".join(f"{name} {_brief(name, r[name]['copy'])}" for name in SIZES))
    result["memcpy"] = {**_merge_rounds(mem_rounds), "wrong_bytes": mem_wrong}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-peers-") as log_dir:
        for peer in peers:
            _say(progress, f"{peer}: starting")
            result[peer] = _run_peer(peer, rounds, ops, warmup, progress, log_dir, redis_url)
            if "skipped" in result[peer]:
                _say(progress, f"{peer}: skipped: {result[peer]['skipped']}")
                if in_ci() and peer in PEERS:
                    raise PeerMissing(f"CI=true and {peer} could not run: {result[peer]['skipped']}")
    return result


def wrong_bytes(result: dict) -> int:
    """All wrong bytes a :func:`run` result reports (0 for a good run)."""
    return sum(v.get("wrong_bytes", 0) for v in result.values() if isinstance(v, dict))


def _rng(lo_hi: list[float], fmt: str) -> str:
    lo, hi = lo_hi
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}-{b}"


def format_table(r: dict) -> str:
    cfg = r["config"]
    lines = [f"peers, same run: {cfg['rounds']} round(s), ranges over rounds; "
             f"256 KiB: {cfg['ops']['256KiB']} ops, 32 MiB: {cfg['ops']['32MiB']} ops (after "
             f"{cfg['warmup']['256KiB']} and {cfg['warmup']['32MiB']} untimed)",
             f"{'':<10}{'op':<11}{'256KiB p50 ms':>18}{'256KiB p99 ms':>18}{'32MiB GB/s med':>18}{'32MiB GB/s min':>18}"]
    notes = []
    for peer in ["memcpy", *[k for k in r if k not in ("config", "memcpy")]]:
        v = r[peer]
        if "skipped" in v:
            lines.append(f"{peer:<10}skipped: {v['skipped']}")
            continue
        for op in v["256KiB"]:
            a, b = v["256KiB"][op], v["32MiB"][op]
            lines.append(f"{peer:<10}{op:<11}{_rng(a['p50_ms'], '.3f'):>18}{_rng(a['p99_ms'], '.3f'):>18}"
                         f"{_rng(b['gbps_median'], '.2f'):>18}{_rng(b['gbps_min'], '.2f'):>18}")
        notes.append(f"{peer}: wrong bytes {v['wrong_bytes']}")
        if "setup" in v:
            notes.extend(f"  {peer} {k}: {json.dumps(x) if isinstance(x, dict) else x}"
                         for k, x in v["setup"].items())
    return "\n".join(lines + notes)
