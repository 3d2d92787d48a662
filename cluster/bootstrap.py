"""Starting and stopping a pool on a Ray cluster: an index (Redis, or the embedded one in an
actor), the controller, and one shard on every alive node, pinned there."""

from __future__ import annotations

import logging
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.auth import Authority, default_credential
from kvpool.cluster.controller import CONTROLLER, Controller
from kvpool.cluster.index_actor import INDEX_ACTOR, IndexActor
from kvpool.cluster.shard import ShardActor, shard_name

log = logging.getLogger("kvpool.bootstrap")


def shard_id_of(node_id: str) -> str:
    return f"node-{node_id[:12]}"


def up(pool: str = "default", store: dict | None = None, tenants: list[dict] | None = None,
       index_url: str | None = None, namespace: str | None = None, ttl_s: float = 5.0,
       controller_interval_s: float = 1.0, timeout_s: float = 120.0, secret: str | None = None,
       secret_file: str | None = None) -> dict:
    """Places what is missing (idempotent: run it again after nodes join). Ray must be initialized.

    ``secret``: the pool secret (kvpool.auth); by default this process's (``$KVPOOL_SECRET_FILE`` /
    ``$KVPOOL_SECRET``), and without one the pool is open (any caller may act as any tenant:
    loopback tests and demos only). The pool's actors read it from a file (``secret_file``, which
    every node must have, or a private copy on this machine): their environment names only the
    path, since Ray stores an actor's environment where any Ray client can read it."""
    if index_url:  # a dead Redis is a typed 503 naming it, before any actor starts
        from kvpool.index import open_index

        idx = open_index(index_url)
        try:
            idx.check(min(timeout_s, 3.0))
        finally:
            idx.close()
    auth = Authority(secret) if secret is not None else Authority.from_env()
    env = {"runtime_env": {"env_vars": auth.secret_file_env(secret_file)}} if auth.secured else {}
    store = store or {"page_bytes": 32 << 20, "dram_pages": 16}
    tenants = tenants or [{"id": "default"}]
    # The control plane (and the embedded index) stays on this node, the one running `kvpool up`
    # (the head, normally): a worker node that leaves must not take them along.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    if not index_url:
        IndexActor.options(name=INDEX_ACTOR, namespace=namespace, get_if_exists=True, lifetime="detached",
                           scheduling_strategy=here, **env).remote()
    controller = Controller.options(name=CONTROLLER, namespace=namespace, get_if_exists=True, lifetime="detached",
                                    scheduling_strategy=here, **env).remote(pool, index_url, controller_interval_s,
                                                                            grace_s=max(2 * ttl_s, 2 * controller_interval_s))
    known = ray.get(controller.state.remote(), timeout=timeout_s)["shards"]
    started = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        sid = shard_id_of(node["NodeID"])
        if sid in known:
            continue
        h = ShardActor.options(
            name=shard_name(pool, sid), namespace=namespace, get_if_exists=True, lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False), **env,
        ).remote(sid, pool, store, tenants, index_url, ttl_s)
        started.append((sid, h))
    for sid, h in started:
        try:
            challenge = uuid.uuid4().hex
            info = ray.get(h.info.remote(challenge), timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            _raise_start_error(sid, e)
        if not auth.proven(info.get("proof"), "shard", sid, str(info.get("incarnation")), challenge):
            from kvpool.errors import Forbidden

            raise Forbidden(f"the actor named {shard_name(pool, sid)} does not hold the pool secret: not one of the "
                            "pool's shards (another Ray process took its name); not registered")
        ray.get(controller.register.remote(sid, info, credential=auth.pool_credential()), timeout=timeout_s)
        log.info("kvpool: shard %s on node %s", sid, info["node_id"][:12])
    return ray.get(controller.state.remote(), timeout=timeout_s)


def _raise_start_error(sid: str, e: Exception) -> None:
    """A shard whose start refused its config (a tier too small on its node, a /dev/shm too small):
    the shard's own message, typed, instead of Ray's traceback of a dead actor."""
    import re

    from kvpool.errors import BadRequest, Unavailable

    m = re.findall(r"\[(400|503)\] (.+)", str(e)) if getattr(e, "actor_init_failed", False) else []
    if not m:
        raise e
    status, message = m[-1]
    raise (BadRequest if status == "400" else Unavailable)(f"shard {sid} did not start: {message}") from None


def down(pool: str = "default", namespace: str | None = None, timeout_s: float = 30.0,
         secret: str | None = None) -> int:
    """Drains every shard (their entries leave the index) and stops the pool's actors (with the
    pool secret, ``secret`` or this process's, as in ``up``)."""
    credential = Authority(secret).pool_credential() if secret is not None else default_credential()
    n = 0
    try:
        controller = ray.get_actor(CONTROLLER, namespace=namespace)
        shards = ray.get(controller.state.remote(), timeout=timeout_s)["shards"]
    except ValueError:
        return 0
    for sid in shards:
        try:
            h = ray.get_actor(shard_name(pool, sid), namespace=namespace)
            ray.get(h.drain.remote(credential), timeout=timeout_s)
            ray.kill(h)
            n += 1
        except Exception as e:  # noqa: BLE001 - a dead shard has nothing to drain
            log.warning("kvpool down: shard %s: %s", sid, e)
    ray.kill(controller)
    try:
        ray.kill(ray.get_actor(INDEX_ACTOR, namespace=namespace))
    except ValueError:
        pass
    return n
