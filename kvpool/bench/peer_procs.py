"""The processes of ``kvpool bench peers`` (and of ``kvpool bench node``'s peer rounds): the
line-JSON worker children that call Mooncake Store or Redis, the services they talk to
(``mooncake_master``, a ``redis-server`` of the run's own), and the byte pattern every read is
checked against.

A worker is ``python -m kvpool.bench.peer_procs --worker PEER --config JSON``: one JSON request per
line on stdin, one JSON answer per line on a stdout kept clean of native chatter
(:class:`WorkerProcess`). mooncake is imported only in the workers, so its native logging never
reaches the parent's stdout. Every child dies with its parent (``die_with_parent``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
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

MOONCAKE_SEGMENT = 256 << 20  # each client's share of the pool; one 32 MiB object lives at a time
MOONCAKE_LOCAL_BUFFER = 16 << 20


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when this process dies (Linux), so no service outlives a
    benchmark that was killed."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def tail(path: str | os.PathLike, n: int = 2000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


class WorkerProcess:
    """A child ``python -m kvpool.bench.peer_procs --worker PEER`` that answers one JSON line per JSON
    line sent. Its native libraries' chatter goes to a log file (``log``), not to the protocol."""

    def __init__(self, peer: str, config: dict, env: dict | None = None, log_dir: str | None = None,
                 start_timeout_s: float = 60.0) -> None:
        self._start(peer, ["-m", "kvpool.bench.peer_procs", "--worker", peer, "--config", json.dumps(config)], env,
                    log_dir, start_timeout_s, "kvpool-peers")

    def _start(self, name: str, args: list[str], env: dict | None, log_dir: str | None, start_timeout_s: float,
               prefix: str) -> None:
        """Starts ``python ARGS`` (stderr to a log of its own) and waits for its first line."""
        self.peer = name
        fd, self.log = tempfile.mkstemp(prefix=f"{prefix}-{name}-", suffix=".log", dir=log_dir)
        os.close(fd)
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True, bufsize=1,
                preexec_fn=die_with_parent,
            )
        try:
            self.hello = self._read(start_timeout_s)
        except BaseException:
            self.close()
            raise
        if "error" in self.hello:
            self.close()
            raise RuntimeError(f"{name} worker: {self.hello['error']}")

    def _read(self, timeout_s: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.poll()
            raise RuntimeError(f"{self.peer} worker gave no answer (exit {self.proc.returncode}, "
                               f"{'timed out' if not ready else 'closed'}); its log:\n{tail(self.log)}")
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
        stop(self.proc)
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


def line_protocol():
    """A worker's answers: a ``say(**msg)`` that writes one JSON line to the process's real stdout,
    which from now on only it writes (fd 1 and ``sys.stdout`` point at stderr, so whatever native
    code or a library prints cannot break the protocol)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(**msg) -> None:
        proto.write(json.dumps(msg) + "\n")

    return say


def _worker_main(peer: str, config: dict) -> int:
    """The worker's loop: requests on stdin, one JSON answer per line on the saved stdout; whatever
    native code prints to fd 1 goes to stderr instead."""
    say = line_protocol()
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
    """Where the shared libraries Mooncake links were extracted (kvpool.bench.te's rule where it exists)."""
    try:
        from kvpool.bench import te
    except ImportError:
        return Path(os.environ.get("KVPOOL_MOONCAKE_SYSROOT") or os.path.join(sys.prefix, "mooncake-sysroot"))
    return Path(te.sysroot())


def _preload_mooncake() -> None:
    """kvpool.bench.te.preload() (the shared libraries Mooncake's wheel needs) where that module
    exists; otherwise the dynamic loader finds them on LD_LIBRARY_PATH (see :func:`_mooncake_env`)."""
    try:
        from kvpool.bench import te
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


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False

def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvpool.bench.peer_procs")
    p.add_argument("--worker", choices=sorted(_CLIENTS), required=True)
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    return _worker_main(a.worker, json.loads(a.config))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
