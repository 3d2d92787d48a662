"""The embedded index for a Ray cluster with no Redis: one named actor holds it, and
``ActorIndex`` speaks the index contract to it with a timeout on every call.

Reads through ``ActorIndex`` never raise (a slow or dead actor is a miss), like RedisIndex.
"""

from __future__ import annotations

import abc

import ray

from kvpool.auth import Authority, default_credential
from kvpool.errors import KvPoolError, Unavailable
from kvpool.index.base import Index, PrefixHit
from kvpool.index.embedded import EmbeddedIndex

INDEX_ACTOR = "kvpool-index"
# Who may call what: lookups are open (they answer for addresses only a credential's holder can
# compute, kvpool.auth), what keeps the index true is the pool's own processes', and the rest
# (quotas, listings, events) operators'.
OPEN = frozenset({"lookup", "get", "invalidate", "shards"})
POOL_ONLY = frozenset({"publish", "remove", "register_shard", "heartbeat", "purge_dead", "reconcile", "add_tenant",
                       "forget_shard", "epoch", "set_epoch"})


@ray.remote(num_cpus=0, max_restarts=-1)
class IndexActor:
    """Hosts an EmbeddedIndex. Restartable: a restart starts empty, and shards reconcile."""

    def __init__(self) -> None:
        self.index = EmbeddedIndex()
        self.auth = Authority.from_env()

    def call(self, credential: str, method: str, args: tuple, kwargs: dict):
        try:
            if method not in OPEN:
                self.auth.require(credential, f"the index's {method}", "pool" if method in POOL_ONLY else "operator")
            return "ok", getattr(self.index, method)(*args, **kwargs)
        except KvPoolError as e:  # travels back as a value so the caller re-raises the same type
            return "error", e


_RAISE = object()  # a call whose failure the caller sees (Unavailable)
# Reads never raise: a slow or dead actor answers what a miss is.
_READS = {"lookup": PrefixHit(0, error="index actor unavailable"), "get": None, "invalidate": False}


def _forwarder(method: str):
    default = _READS.get(method, _RAISE)

    def forward(self, *args, **kwargs):
        try:
            return self._call(method, *args, **kwargs)
        except Unavailable:
            if default is _RAISE:
                raise
            return default

    forward.__name__ = forward.__qualname__ = method
    forward.__doc__ = getattr(Index, method).__doc__
    return forward


def _forwarding(cls):
    """Every method of the index contract, forwarded to the actor (one way, not twenty)."""
    for method in sorted(Index.__abstractmethods__ | _READS.keys()):
        setattr(cls, method, _forwarder(method))
    return abc.update_abstractmethods(cls)


@_forwarding
class ActorIndex(Index):
    """The index contract over the actor: each call one ``IndexActor.call`` with this caller's
    credential and a timeout; the index's own errors re-raised as their types."""

    def __init__(self, handle=None, timeout_s: float = 2.0, namespace: str | None = None,
                 credential: str | None = None) -> None:
        self._h = handle if handle is not None else ray.get_actor(INDEX_ACTOR, namespace=namespace)
        self.timeout_s = timeout_s
        self.credential = credential if credential is not None else default_credential()

    def _call(self, method: str, *args, **kwargs):
        # NOTE: in one tuple: Ray passes a bare bytes argument as plain bytes, which would turn a
        # ChunkKey into bytes (and the index refuses bytes for keys).
        args = tuple(list(a) if isinstance(a, (tuple, list)) else a for a in args)  # sequences travel as lists
        try:
            status, value = ray.get(self._h.call.remote(self.credential, method, args, kwargs),
                                    timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise Unavailable(f"index actor did not answer {method} in {self.timeout_s}s ({type(e).__name__})") from None
        if status == "error":
            raise value
        return value
