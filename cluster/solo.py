"""A single-node pool: the pool's one shard as one process, with the embedded index (or Redis), and
no Ray at all -- what `kvpool up` runs on a machine when no Ray cluster is named.

Engines attach exactly as they do on a Ray pool: through the shard's node file, socket, page table
and slab in the run dir. Their connector config names neither Ray nor this process, so the same
config later reaches a pool on a Ray cluster unchanged. `kvpool up` starts the process detached
(its own session, logging to ``~/.kvpool/pool.log``) and records it (``~/.kvpool/pool.json``);
`kvpool stats` asks it on its socket; `kvpool down` stops it (SIGTERM: it drains and exits).

    python -m kvpool.cluster.solo CONFIG.json    # what `kvpool up` runs; not meant to be typed
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from kvpool.cluster.reports import Reports
from kvpool.errors import BadRequest, Unavailable
from kvpool.node.paths import node_files, run_dir
from kvpool.node.trust import check_run_dir
from kvpool.procs import zombie

POOL = "default"
SHARD = "single-node"
RECORD_ENV = "KVPOOL_POOL_RECORD"
START_TIMEOUT_S = 120.0
log = logging.getLogger("kvpool.solo")


class Alone:
    """The rest of the pool, for the one shard there is: no peers, no loads to spill to; engines'
    reports kept here, for `kvpool stats`."""

    def __init__(self) -> None:
        self.reports = Reports()

    def peers(self) -> dict:
        return {}

    def peer_address(self, shard_id: str) -> None:
        return None

    def loads(self) -> dict:
        return {}

    def report(self, name: str, figures: dict) -> None:
        self.reports.add(name, figures)

    def engines(self, timeout_s: float = 0.0) -> dict:
        return self.reports.live()

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- the record of the running process
def record_path() -> str:
    return os.path.expanduser(os.environ.get(RECORD_ENV) or os.path.join("~", ".kvpool", "pool.json"))


def running() -> dict | None:
    """The record of the single-node pool `kvpool up` started here, while its process still runs
    (its pid names this module on its command line); None otherwise."""
    try:
        with open(record_path()) as f:
            rec = json.load(f)
        with open(f"/proc/{int(rec['pid'])}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec if b"kvpool.cluster.solo" in cmd and rec.get("config", "").encode() in cmd else None


def _live_node_files(directory: str) -> list[str]:
    """Node files of the pool in ``directory`` whose shard process still runs."""
    out = []
    for path in node_files(directory, POOL):
        try:
            with open(path) as f:
                pid = int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not zombie(pid):  # gone, or killed and not reaped yet
            out.append(path)
    return out


# ---------------------------------------------------------------- `kvpool up`, `kvpool down`
def start(store: dict, tenants: list[dict], redis: str | None, secret_file: str | None,
          timeout_s: float = START_TIMEOUT_S) -> dict:
    """Starts the single-node pool's process and waits until its shard answers on the node's
    socket; its node file's info, with ``"pid"`` and ``"log"``. One at a time on this machine
    (cluster.up_lock, held from the check that none runs until the new one answers, recorded): of
    `kvpool up`s started together, one starts the pool and the others are refused, naming it."""
    from kvpool.cluster.up_lock import held

    with held("kvpool up"):
        return _start(store, tenants, redis, secret_file, timeout_s)


def _start(store: dict, tenants: list[dict], redis: str | None, secret_file: str | None, timeout_s: float) -> dict:
    from kvpool.auth import SECRET_FILE_ENV
    from kvpool.auth_cli import find_secret, secret_path

    if (rec := running()) is not None:
        raise BadRequest(f"a single-node pool is already up here (pid {rec['pid']}, started {rec['started']}): "
                         "`kvpool down` first to change its size or tenants")
    secret, where = find_secret(secret_file, create=True)
    directory = run_dir()
    check_run_dir(directory)  # refused here, with the fix, when others can write in it
    if taken := _live_node_files(directory):
        raise BadRequest(f"a shard of pool {POOL!r} already runs in {directory} ({taken[0]}): a pool on Ray? stop it "
                         "with `kvpool down --ray-address ...`, or start this one with another $KVPOOL_RUN_DIR")
    home = os.path.dirname(record_path())
    os.makedirs(home, mode=0o700, exist_ok=True)
    config = os.path.join(home, "pool-config.json")
    with open(os.open(config + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"store": store, "tenants": tenants, "redis": redis, "run_dir": directory}, f)
    os.replace(config + ".tmp", config)
    env = dict(os.environ)
    if (path := secret_path(secret_file, where)) is not None:
        env[SECRET_FILE_ENV] = path
    logfile = os.path.join(home, "pool.log")
    with open(os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpool.cluster.solo", config], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, env=env, start_new_session=True, close_fds=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    tmp = record_path() + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"pid": proc.pid, "config": config, "log": logfile, "started": started, "run_dir": directory}, f)
    os.replace(tmp, record_path())
    info = _wait_started(proc, directory, logfile, timeout_s)
    return {**info, "log": logfile, "secret_from": where}


def _wait_started(proc: subprocess.Popen, directory: str, logfile: str, timeout_s: float) -> dict:
    deadline, said = time.monotonic() + timeout_s, time.monotonic()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            try:
                os.unlink(record_path())
            except OSError:
                pass
            raise Unavailable(f"the pool's process exited at start (code {proc.returncode}):\n{_tail(logfile)}")
        for path in node_files(directory, POOL, SHARD):
            try:
                with open(path) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                continue
            if info.get("pid") == proc.pid:
                return info
        if time.monotonic() - said > 5:
            said = time.monotonic()
            print(f"kvpool: waiting for the pool's process (pid {proc.pid}) to commit its DRAM tier ...",
                  file=sys.stderr)
        time.sleep(0.05)
    proc.terminate()
    raise Unavailable(f"the pool's process did not start within {timeout_s:.0f} s (log: {logfile}):\n{_tail(logfile)}")


def _tail(logfile: str, lines: int = 15) -> str:
    try:
        with open(logfile, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no log)"


def stop(timeout_s: float = 60.0) -> dict | None:
    """Stops the single-node pool's process (SIGTERM: it drains, then exits; SIGKILL after
    ``timeout_s``); what it stopped, or None when none runs here. A `kvpool up` under way is waited
    for (cluster.up_lock), then what it started is stopped."""
    from kvpool.cluster.up_lock import held

    with held("kvpool down"):
        return _stop(timeout_s)


def _stop(timeout_s: float) -> dict | None:
    rec = running()
    if rec is None:
        return None
    pid = int(rec["pid"])
    chunks = None
    try:
        from kvpool.node.client import NodeClient

        c = NodeClient(pool=POOL, shard=SHARD, directory=rec.get("run_dir"), timeout_s=2.0)
        try:
            chunks = sum(t["chunks"] for t in c.shard_stats()["tiers"].values())
        finally:
            c.close()
    except Exception:  # noqa: BLE001 - stopped all the same
        pass
    os.kill(pid, signal.SIGTERM)
    deadline, killed = time.monotonic() + timeout_s, False
    while os.path.exists(f"/proc/{pid}") and not zombie(pid):
        if time.monotonic() > deadline and not killed:
            os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    try:
        os.unlink(record_path())
    except OSError:
        pass
    return {"pid": pid, "chunks": chunks, "killed": killed, "log": rec.get("log")}


# ---------------------------------------------------------------- the process itself
def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with open(argv[0]) as f:
        cfg = json.load(f)
    os.environ["KVPOOL_RUN_DIR"] = cfg["run_dir"]
    from kvpool.auth import Authority
    from kvpool.cluster.shard_core import Shard
    from kvpool.index import open_index
    from kvpool.index.embedded import EmbeddedIndex

    index = open_index(cfg["redis"]) if cfg.get("redis") else EmbeddedIndex()
    shard = Shard(SHARD, POOL, cfg["store"], cfg["tenants"], index, Alone(), node_id=socket.gethostname(),
                  host="127.0.0.1")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    log.info("single-node pool up: shard %s, pid %d, run dir %s", SHARD, os.getpid(), cfg["run_dir"])
    while not done.wait(1.0):
        pass
    n = shard.drain(Authority.from_env().pool_credential())
    log.info("drained: %d index entries removed; exiting", n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
