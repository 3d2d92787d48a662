"""The embedded index for a Ray cluster with no Redis: one named actor holds it, and
``ActorIndex`` speaks the index contract to it with a timeout on every call.

Reads through ``ActorIndex`` never raise (a slow or dead actor is a miss), like RedisIndex.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from kvpool.auth import Authority, default_credential
from kvpool.errors import KvPoolError, Unavailable
from kvpool.index.base import Index, IndexEntry, PrefixHit, TenantInfo
from kvpool.index.embedded import EmbeddedIndex
from kvpool.keys import ChunkKey
from kvpool.tenants import UNLIMITED

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

    def call(self, credential: str, method: str, *args, **kwargs):
        try:
            if method not in OPEN:
                self.auth.require(credential, f"the index's {method}", "pool" if method in POOL_ONLY else "operator")
            return "ok", getattr(self.index, method)(*args, **kwargs)
        except KvPoolError as e:  # travels back as a value so the caller re-raises the same type
            return "error", e


class ActorIndex(Index):
    def __init__(self, handle=None, timeout_s: float = 2.0, namespace: str | None = None,
                 credential: str | None = None) -> None:
        self._h = handle if handle is not None else ray.get_actor(INDEX_ACTOR, namespace=namespace)
        self.timeout_s = timeout_s
        self.credential = credential if credential is not None else default_credential()

    def _call(self, method: str, *args, **kwargs):
        try:
            status, value = ray.get(self._h.call.remote(self.credential, method, *args, **kwargs),
                                    timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise Unavailable(f"index actor did not answer {method} in {self.timeout_s}s ({type(e).__name__})") from None
        if status == "error":
            raise value
        return value

    def _read(self, method: str, default, *args):
        try:
            return self._call(method, *args)
        except Unavailable:
            return default

    def add_tenant(self, tenant: str, quota: int = UNLIMITED, priority: str = "normal") -> None:
        self._call("add_tenant", tenant, quota, priority)

    def set_quota(self, tenant: str, quota: int) -> None:
        self._call("set_quota", tenant, quota)

    def set_priority(self, tenant: str, priority: str) -> None:
        self._call("set_priority", tenant, priority)

    def tenants(self) -> list[TenantInfo]:
        return self._call("tenants")

    def publish(self, entries: Sequence[IndexEntry]) -> list[bool]:
        return self._call("publish", list(entries))

    def remove(self, keys: Sequence[ChunkKey], shard: str | None = None) -> int:
        return self._call("remove", list(keys), shard)

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixHit:
        return self._read("lookup", PrefixHit(0, error="index actor unavailable"), list(keys))

    def get(self, key: ChunkKey) -> IndexEntry | None:
        return self._read("get", None, key)

    def register_shard(self, shard: str, address: str = "", ttl_s: float = 10.0) -> None:
        self._call("register_shard", shard, address, ttl_s)

    def heartbeat(self, shard: str, ttl_s: float = 10.0) -> None:
        self._call("heartbeat", shard, ttl_s)

    def shards(self) -> dict[str, bool]:
        return self._call("shards")

    def purge_dead(self) -> dict[str, int]:
        return self._call("purge_dead")

    def shard_keys(self, shard: str) -> set[ChunkKey]:
        return self._call("shard_keys", shard)

    def forget_shard(self, shard: str) -> int:
        return self._call("forget_shard", shard)

    def epoch(self) -> str | None:
        return self._call("epoch")

    def set_epoch(self, token: str) -> None:
        self._call("set_epoch", token)

    def events(self, after: str = "0-0", count: int = 1000):
        return self._call("events", after, count)

    def invalidate(self, key: ChunkKey, shard: str) -> bool:
        """A reader's report that ``shard`` lacks ``key`` (open: a reader holds no pool credential)."""
        try:
            return self._call("invalidate", key, shard)
        except Unavailable:
            return False
