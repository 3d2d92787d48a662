"""A kvpool pool started outside this process, as an operator runs it, for the benchmarks that
put an engine on the node path: a Ray head with a temp dir and port of its own (and ``nodes - 1``
more Ray nodes on this machine, a shard each, all announcing themselves in one run dir: an engine
names its node's shard), ``kvpool up`` with
its index in a redis-server of its own when one is installed (else the embedded index), both with
``.venv/bin`` when it exists, else this environment's; a run dir of its own under /dev/shm.
Everything it starts is stopped by :meth:`NodePool.close`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvpool.errors import BadRequest

TENANT = "default"
CHUNK_TOKENS = 256
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool_bin(name: str) -> str:
    """``name`` from the pool's virtualenv (``.venv``) when there is one, else from this one."""
    for d in (os.path.join(REPO, ".venv", "bin"), os.path.dirname(sys.executable)):
        p = os.path.join(d, name)
        if os.path.exists(p):
            return p
    found = shutil.which(name)
    if found is None:
        raise BadRequest(f"{name} not found in .venv/bin nor beside {sys.executable}")
    return found


def log(msg: str, progress: bool, bench: str = "ttft") -> None:
    if progress:
        print(f"[bench {bench}] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


class NodePool:
    """A pool outside this process: Ray head + ``kvpool up`` (+ redis-server), a run dir of its own."""

    def __init__(self, page_bytes: int, dram_pages: int, progress: bool = True, nodes: int = 1,
                 tenants: tuple[str, ...] = (TENANT,)) -> None:
        if nodes < 1 or TENANT not in tenants:
            raise BadRequest(f"a pool of at least one node serving tenant {TENANT!r}")
        self.progress, self.nodes, self.tenants = progress, nodes, tuple(tenants)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.run_dir = tempfile.mkdtemp(prefix="kvpool-bench-run-", dir=shm)  # the slab lives here: tmpfs
        # NOTE: short: Ray puts its sockets under its temp dir (a Unix socket path has ~107 bytes)
        self.ray_tmp = tempfile.mkdtemp(prefix="kvb", dir="/tmp")
        self.secret_file = os.path.join(self.run_dir, "pool-secret")
        from kvpool.auth import Authority

        secret = os.urandom(24).hex()
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        self.credentials = {t: Authority(secret).issue(t) for t in self.tenants}  # what the operator hands engines
        self.credential = self.credentials[TENANT]
        self.env = {**{k: v for k, v in os.environ.items()
                       if not k.startswith(("VLLM_", "KVPOOL_SECRET", "RAY_ADDRESS", "PYTHONPATH"))},
                    # NOTE: Ray refuses a second node beside a head on 127.0.0.1 unless asked to ("1")
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1" if nodes > 1 else "0", "RAY_AUTH_MODE": "disabled",
                    "KVPOOL_RUN_DIR": self.run_dir, "RAY_USAGE_STATS_ENABLED": "0"}
        self.redis: subprocess.Popen | None = None
        self.index = "embedded"
        self.ray_port = free_port()
        self.address = f"127.0.0.1:{self.ray_port}"
        self.page_bytes, self.dram_pages = page_bytes, dram_pages

    def start(self) -> None:
        if shutil.which("redis-server"):
            port = free_port()
            self.redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL, start_new_session=True)
            _wait_port(port, 10)
            self.index = f"redis://127.0.0.1:{port}"
        log(f"Ray head on {self.address} (temp dir {self.ray_tmp})", self.progress)
        r = subprocess.run([pool_bin("ray"), "start", "--head", f"--port={self.ray_port}", "--node-ip-address=127.0.0.1",
                            "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats",
                            "--object-store-memory=100000000", f"--temp-dir={self.ray_tmp}"],
                           env=self.env, capture_output=True, text=True, timeout=180, start_new_session=True)
        if r.returncode:
            raise RuntimeError(f"ray start failed:\n{(r.stdout + r.stderr)[-3000:]}")
        for _ in range(self.nodes - 1):  # NOTE: a node's processes live under the head's temp dir too
            r = subprocess.run([pool_bin("ray"), "start", f"--address={self.address}", "--node-ip-address=127.0.0.1",
                                "--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"],
                               env=self.env, capture_output=True, text=True, timeout=180, start_new_session=True)
            if r.returncode:
                raise RuntimeError(f"ray start (another node) failed:\n{(r.stdout + r.stderr)[-3000:]}")
        log(f"kvpool up (index {self.index}, {self.dram_pages} pages of {self.page_bytes >> 20} MiB)", self.progress)
        cmd = [pool_bin("kvpool"), "up", "--ray-address", self.address, "--page-size", str(self.page_bytes),
               "--dram-pages", str(self.dram_pages), *(a for t in self.tenants for a in ("--tenant", t)),
               "--secret-file", self.secret_file, "--insecure-ray"]  # its own loopback head, started without Ray's token
        if self.redis is not None:
            cmd += ["--redis", self.index, "--insecure-redis"]  # its own loopback redis-server, without ACL users
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=240, start_new_session=True)
        if r.returncode:
            raise RuntimeError(f"kvpool up failed:\n{(r.stdout + r.stderr)[-3000:]}")
        deadline = time.monotonic() + 60
        while len(self.shards()) < self.nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvpool up left {len(self.shards())} shard files in {self.run_dir}, not {self.nodes}")
            time.sleep(0.2)

    def shards(self) -> list[str]:
        """The shards' ids, from their node files (kvpool-<pool>-<shard>.node)."""
        return sorted(f[len("kvpool-default-"):-len(".node")] for f in os.listdir(self.run_dir)
                      if f.startswith("kvpool-default-") and f.endswith(".node"))

    def connector_config(self, chunk_tokens: int = CHUNK_TOKENS, **more: Any) -> dict[str, Any]:
        """An engine's pool config, serving every tenant of the pool (``more``: ``shard``, ...)."""
        return {"backend": "node", "pool": "default", "run_dir": self.run_dir, "chunk_tokens": chunk_tokens,
                "tenants": [{"id": t, "credential": c} for t, c in self.credentials.items()], **more}

    def head_pids(self) -> list[int]:
        """This Ray head's processes: every one names its temp dir (other Rays here are left alone)."""
        mine = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.ray_tmp.encode() in f.read():
                        mine.append(int(pid))
            except OSError:
                continue
        return mine

    def close(self) -> None:
        for pid in self.head_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()
            self.redis.wait(10)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def terminated_as_interrupt():
    """SIGTERM raises KeyboardInterrupt here, so the ``finally`` blocks tear everything down."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)

