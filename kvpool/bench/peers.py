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
and :class:`WorkerProcess` (a line-JSON child process that keeps its stdout clean of native chatter).

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
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

SIZES = {"256KiB": 256 << 10, "32MiB": 32 << 20}
LATENCY_SIZES = ("256KiB",)  # reported as p50/p99 ms; the others as GB/s
DEFAULT_OPS = {"256KiB": 200, "32MiB": 8}
DEFAULT_WARMUP = {"256KiB": 5, "32MiB": 1}  # untimed operations before each size, per round
PEERS = ("mooncake", "redis")
OPS = ("put", "get_same", "get_cross")
MOONCAKE_SEGMENT = 256 << 20  # each client's share of the pool; one 32 MiB object lives at a time
MOONCAKE_LOCAL_BUFFER = 16 << 20


class PeerMissing(RuntimeError):
    """A peer the run must measure (CI) is not installed or cannot start."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# --- helpers (reusable by kvpool's own datapath benchmarks) ---------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def byte_pattern(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` deterministic bytes (uint8) that differ with ``seed`` at every 8-byte word, cheap
    enough for 32 MiB (a multiply and a xor per word); a shorter pattern is a prefix of a longer one."""
    words = (nbytes + 7) // 8
    with np.errstate(over="ignore"):
        w = (np.arange(words, dtype=np.uint64) + (np.uint64(seed & 0xFFFFFFFF) << np.uint64(32))) * _GOLDEN
        w ^= w >> np.uint64(29)
    return w.view(np.uint8)[:nbytes]


def count_wrong_bytes(got, seed: int, nbytes: int | None = None) -> int:
    """How many of ``got``'s bytes (a buffer or array, read as uint8) differ from
    ``byte_pattern(nbytes, seed)``; a short or long read counts its missing or extra bytes."""
    a = np.frombuffer(got, dtype=np.uint8) if not isinstance(got, np.ndarray) else got.view(np.uint8).reshape(-1)
    n = a.size if nbytes is None else nbytes
    want = byte_pattern(n, seed)
    k = min(a.size, n)
    return int(np.count_nonzero(a[:k] != want[:k])) + abs(a.size - n)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when this process dies (Linux), so no service outlives a
    benchmark that was killed."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def _tail(path: str | os.PathLike, n: int = 2000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


class WorkerProcess:
    """A child ``python -m kvpool.bench.peers --worker PEER`` that answers one JSON line per JSON
    line sent. Its native libraries' chatter goes to a log file (``log``), not to the protocol."""

    def __init__(self, peer: str, config: dict, env: dict | None = None, log_dir: str | None = None,
                 start_timeout_s: float = 60.0) -> None:
        self.peer = peer
        fd, self.log = tempfile.mkstemp(prefix=f"kvpool-peers-{peer}-", suffix=".log", dir=log_dir)
        os.close(fd)
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.bench.peers", "--worker", peer, "--config", json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True, bufsize=1,
                preexec_fn=_die_with_parent,
            )
        try:
            self.hello = self._read(start_timeout_s)
        except BaseException:
            self.close()
            raise
        if "error" in self.hello:
            self.close()
            raise RuntimeError(f"{peer} worker: {self.hello['error']}")

    def _read(self, timeout_s: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.poll()
            raise RuntimeError(f"{self.peer} worker gave no answer (exit {self.proc.returncode}, "
                               f"{'timed out' if not ready else 'closed'}); its log:\n{_tail(self.log)}")
        return json.loads(line)

    def call(self, timeout_s: float = 120.0, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{self.peer} worker, {msg.get('op')}: {reply['error']}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=15)
        _stop(self.proc)
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log)


# --- peer clients (run inside worker processes) ---------------------------------------------------

class _MooncakeClient:
    """One Mooncake Store client with its own segment, a registered source and destination buffer."""

    def __init__(self, cfg: dict) -> None:
        _preload_mooncake()
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", cfg["segment"], cfg["local_buffer"], "tcp", "",
                              cfg["master"])
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        n = cfg["max_size"]
        self.src = np.zeros(n, dtype=np.uint8)
        self.dst = np.zeros(n, dtype=np.uint8)
        for b in (self.src, self.dst):
            rc = self.store.register_buffer(b.ctypes.data, b.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        # Put into this client's own segment: the writer's bytes stay in the writer's process.
        self.rcfg = ReplicateConfig()
        self.rcfg.preferred_segment = self.store.get_hostname()
        self.endpoint = self._probe_endpoint()

    def _probe_endpoint(self) -> str:
        """The transport endpoint of this client's own segment (a probe put, then removed)."""
        key = f"kvpool-peers-probe-{uuid.uuid4().hex}"
        self.fill(4096, 1)
        self.put(key, 4096)
        try:
            return self.where(key)
        finally:
            self.remove(key)

    def fill(self, size: int, seed: int) -> None:
        self.src[:size] = byte_pattern(size, seed)

    def put(self, key: str, size: int) -> float:
        ptrs, sizes = [self.src.ctypes.data], [size]
        t0 = time.perf_counter()
        rc = self.store.batch_put_from([key], ptrs, sizes, self.rcfg)
        t = time.perf_counter() - t0
        if rc[0] != 0:
            raise RuntimeError(f"batch_put_from({key!r}) returned {rc[0]}")
        return t

    def get(self, key: str, size: int) -> tuple[float, memoryview | np.ndarray]:
        ptrs, sizes = [self.dst.ctypes.data], [size]
        self.dst[:size] = 0
        t0 = time.perf_counter()
        rc = self.store.batch_get_into([key], ptrs, sizes)
        t = time.perf_counter() - t0
        if rc[0] < 0:
            raise RuntimeError(f"batch_get_into({key!r}) returned {rc[0]}")
        return t, self.dst[: rc[0]]

    def where(self, key: str) -> str:
        desc = self.store.get_replica_desc(key)
        return desc[0].get_memory_descriptor().buffer_descriptor.transport_endpoint

    def remove(self, key: str) -> None:
        self.store.remove(key, True)

    def close(self) -> None:
        self.store.close()


class _RedisClient:
    """redis-py on one connection: SET of the bytes, GET of the bytes."""

    def __init__(self, cfg: dict) -> None:
        import redis

        self.r = redis.Redis.from_url(cfg["url"], socket_timeout=60)
        self.r.ping()
        self.data = b""
        self.endpoint = cfg["url"]

    def fill(self, size: int, seed: int) -> None:
        self.data = byte_pattern(size, seed).tobytes()

    def put(self, key: str, size: int) -> float:
        data = self.data[:size]
        t0 = time.perf_counter()
        self.r.set(key, data)
        return time.perf_counter() - t0

    def get(self, key: str, size: int) -> tuple[float, bytes]:
        t0 = time.perf_counter()
        got = self.r.get(key)
        t = time.perf_counter() - t0
        return t, got if got is not None else b""

    def where(self, key: str) -> str:
        return self.endpoint

    def remove(self, key: str) -> None:
        self.r.delete(key)

    def close(self) -> None:
        self.r.close()


_CLIENTS = {"mooncake": _MooncakeClient, "redis": _RedisClient}


def _worker_main(peer: str, config: dict) -> int:
    """The worker's loop: requests on stdin, one JSON answer per line on the saved stdout; whatever
    native code prints to fd 1 goes to stderr instead."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(**msg) -> None:
        proto.write(json.dumps(msg) + "\n")

    try:
        client = _CLIENTS[peer](config)
    except Exception as e:  # reported to the parent, which decides between a skip and an error
        say(error=f"{type(e).__name__}: {e}")
        return 1
    say(ready=True, endpoint=client.endpoint, pid=os.getpid())
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            op = msg.get("op")
            try:
                if op == "quit":
                    break
                if op == "put":
                    client.fill(msg["size"], msg["seed"])
                    say(s=client.put(msg["key"], msg["size"]))
                elif op == "get":
                    t, got = client.get(msg["key"], msg["size"])
                    say(s=t, wrong=count_wrong_bytes(got, msg["seed"], msg["size"]))
                elif op == "where":
                    say(endpoint=client.where(msg["key"]))
                elif op == "remove":
                    client.remove(msg["key"])
                    say(ok=True)
                else:
                    say(error=f"unknown op {op!r}")
            except Exception as e:
                say(error=f"{type(e).__name__}: {e}")
    finally:
        client.close()
    return 0


# --- services ------------------------------------------------------------------------------------

def _mooncake_sysroot() -> Path:
    """Where the shared libraries Mooncake links were extracted (kvpool.node.te's rule where it exists)."""
    try:
        from kvpool.node import te
    except ImportError:
        return Path(os.environ.get("KVPOOL_MOONCAKE_SYSROOT") or os.path.join(sys.prefix, "mooncake-sysroot"))
    return Path(te.sysroot())


def _preload_mooncake() -> None:
    """kvpool.node.te.preload() (the shared libraries Mooncake's wheel needs) where that module
    exists; otherwise the dynamic loader finds them on LD_LIBRARY_PATH (see :func:`_mooncake_env`)."""
    try:
        from kvpool.node import te
    except ImportError:
        return
    te.preload()


def _mooncake_env() -> dict:
    """The environment of Mooncake's processes: TCP on loopback, and the sysroot's library folders
    on LD_LIBRARY_PATH (the master is a binary: an in-process preload does not reach it)."""
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    root = _mooncake_sysroot()
    if root.is_dir():
        dirs = sorted({str(p.parent) for p in root.rglob("lib*.so*") if p.parent.name != "rsocket"})
        if env.get("LD_LIBRARY_PATH"):
            dirs.append(env["LD_LIBRARY_PATH"])
        if dirs:
            env["LD_LIBRARY_PATH"] = ":".join(dirs)
    return env


def _mooncake_master_binary() -> str | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
    if path.is_file():
        if not os.access(path, os.X_OK):
            path.chmod(path.stat().st_mode | 0o111)
        return str(path)
    return shutil.which("mooncake_master")


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


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
                                    preexec_fn=_die_with_parent)
        if not _wait_port(port, proc, 20):
            raise RuntimeError(f"mooncake_master did not listen on 127.0.0.1:{port} "
                               f"(exit {proc.poll()}); its log:\n{_tail(log)}")
        yield f"127.0.0.1:{port}", cmd
    finally:
        _stop(proc)


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
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        if not _wait_port(port, proc, 10):
            raise RuntimeError(f"redis-server did not listen on 127.0.0.1:{port}")
        own = f"redis://127.0.0.1:{port}/0"
        yield own, f"own redis-server at {own}"
    finally:
        _stop(proc)


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


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvpool.bench.peers")
    p.add_argument("--worker", choices=sorted(_CLIENTS), required=True)
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    return _worker_main(a.worker, json.loads(a.config))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
