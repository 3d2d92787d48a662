"""The faults of the chaos suite (cluster/bench/chaos.py), each a small function of the run's context,
and the Redis server the suite starts, kills, stops and restarts. Every fault injects, then heals
what it broke (a killed shard is started again with ``up``, a removed node is replaced), so that
the next fault starts from a whole pool; the quiet period that follows is the suite's."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import ray

from kvpool.errors import KvPoolError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2) -> float:
    """Seconds until ``predicate()`` is truthy (an exception counts as "not yet"); a TimeoutError
    naming ``what`` after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if predicate():
                return time.monotonic() - t0
        except (ray.exceptions.RayError, KvPoolError, OSError):
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"waited {timeout_s:g} s for {what}")


class RedisServer:
    """A redis-server of the suite's own on a free loopback port, without persistence: a restart
    is an empty Redis on the same port."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH: the chaos suite starts its own Redis (apt install redis-server)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvpool-chaos-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def reachable(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.reachable, 10, f"redis-server to accept connections on port {self.port}", 0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies only once continued
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Context:
    """What the faults act on: the Ray cluster, its worker nodes (never the head: the clients, the
    controller and the driver live there), the Redis server, and how to (re)start the pool."""

    cluster: object
    workers: list
    redis: RedisServer
    namespace: str
    up: Callable[[], dict]
    controller: Callable[[], object]
    flood: Callable[[float], dict]
    seconds: float
    rng: object
    notes: dict = field(default_factory=dict)

    def shards(self) -> dict:
        return ray.get(self.controller().state.remote(), timeout=30)["shards"]

    def worker_shards(self) -> list[str]:
        from kvpool.cluster.bootstrap import shard_id_of

        on_workers = {shard_id_of(w.node_id) for w in self.workers}
        return sorted(s for s in self.shards() if s in on_workers)

    def wait_shards(self, n: int, what: str) -> None:
        wait_until(lambda: len(self.shards()) == n, 60, what)


def shard_kill(ctx: Context, local: bool = False) -> None:
    """SIGKILL a shard's worker process (on a worker node; ``local``: the head's, which the
    one the first client reaches through shared memory); heal: ``up`` starts it again, under the same
    id, once the controller dropped it."""
    from kvpool.cluster.bootstrap import shard_id_of
    from kvpool.cluster.shard import shard_name

    if local:
        sid = shard_id_of(ray.get_runtime_context().get_node_id())
    else:
        sid = ctx.worker_shards()[int(ctx.rng.integers(len(ctx.worker_shards())))]
    h = ray.get_actor(shard_name("default", sid), namespace=ctx.namespace)
    pid = ray.get(h.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    n = len(ctx.shards())
    os.kill(pid, signal.SIGKILL)
    ctx.notes.update(shard=sid, pid=pid)
    ctx.notes["dropped_s"] = round(wait_until(lambda: sid not in ctx.shards(), 60, f"the controller to drop {sid}"), 2)
    ctx.up()
    ctx.wait_shards(n, "the restarted shard to join the pool")


def node_kill(ctx: Context) -> None:
    """SIGKILL a worker node's raylet (and so its shard); heal: a new node joins, ``up`` gives it
    a shard."""
    from kvpool.cluster.bootstrap import shard_id_of

    victim = ctx.workers.pop(int(ctx.rng.integers(len(ctx.workers))))
    sid = shard_id_of(victim.node_id)
    n = len(ctx.shards())
    ctx.cluster.remove_node(victim, allow_graceful=False)
    ctx.notes["dropped_s"] = round(wait_until(lambda: sid not in ctx.shards(), 60, f"the controller to drop {sid}"), 2)
    ctx.workers.append(ctx.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1"))
    ctx.up()
    ctx.wait_shards(n, "the new node's shard to join the pool")


def redis_stop(ctx: Context, stopped_s: float = 3.0) -> None:
    """SIGSTOP Redis for ``stopped_s`` (it holds every connection open and answers nothing), then
    SIGCONT."""
    ctx.redis.stop()
    time.sleep(stopped_s)
    ctx.redis.cont()
    ctx.notes["stopped_s"] = stopped_s


def redis_restart(ctx: Context) -> None:
    """Kill Redis and start it again, empty, on the same port after 2 s."""
    ctx.redis.kill()
    time.sleep(2.0)
    ctx.redis.start()


def controller_restart(ctx: Context) -> None:
    """Kill the controller; Ray restarts it empty and it adopts the shards from the index."""
    c = ctx.controller()
    old = ray.get(c.health.remote(), timeout=30)
    ray.kill(c, no_restart=False)

    def adopted() -> bool:
        h = ray.get(c.health.remote(), timeout=5)
        return h["incarnation"] != old["incarnation"] and set(h["shards"]) == set(old["shards"])

    ctx.notes["adopted_s"] = round(wait_until(adopted, 60, "the restarted controller to adopt every shard"), 2)


def fill(ctx: Context) -> None:
    """A writer floods the pool past its capacity (another tenant, for half the quiet period):
    eviction must make room, never serve wrong bytes."""
    ctx.notes.update(ctx.flood(max(ctx.seconds / 2, 2.0)))


def members_change(ctx: Context) -> None:
    """A node joins (``up`` gives it a shard: the membership grows mid-call), then leaves again."""
    n = len(ctx.shards())
    node = ctx.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ctx.up()
    ctx.wait_shards(n + 1, "the added node's shard to join the pool")
    time.sleep(max(ctx.seconds / 3, 1.0))
    ctx.cluster.remove_node(node)
    ctx.wait_shards(n, "the removed node's shard to leave the pool")


FAULTS: dict[str, Callable[[Context], None]] = {
    "shard-kill": shard_kill, "local-shard-kill": partial(shard_kill, local=True), "node-kill": node_kill,
    "redis-stop": redis_stop, "redis-restart": redis_restart,
    "controller-restart": controller_restart, "fill": fill, "members-change": members_change,
}
