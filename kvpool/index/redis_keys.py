"""The Redis key scheme of the index, in one place. ``{p}`` is the pool's prefix (default "kvp"),
so several pools can share one Redis.

| key | type | holds |
|---|---|---|
| ``{p}:c:<16-byte chunk key>`` | string | ``shard \\0 tier \\0 msgpack([nbytes, tenant, checksum, created])`` |
| ``{p}:s:<shard>`` | set | the chunk keys a shard holds (for purge and reconcile) |
| ``{p}:shards`` | hash | shard id -> address |
| ``{p}:hb:<shard>`` | string with TTL | the shard's heartbeat; gone = the shard is dead |
| ``{p}:t:<tenant>`` | hash | ``quota`` (bytes), ``priority``: written by operators only |
| ``{p}:u:<tenant>`` | string | the tenant's usage in bytes, charged and refunded by the Lua scripts |
| ``{p}:su:<shard>`` | hash | tenant -> the bytes of its chunks indexed on this shard (the shard's part of usage) |
| ``{p}:sv:<shard>`` | hash | tenant -> how many publishes charged it on this shard (a reconcile's guard) |
| ``{p}:tenants`` | set | tenant ids |
| ``{p}:epoch`` | string | the controller's token: gone = the index restarted empty |
| ``{p}:events`` | stream | ``kind`` stored/removed, ``key``, ``shard``, ``tenant`` |

The Lua scripts build the same names from the prefix (they are written for one Redis server,
not Redis Cluster: a publish touches many hash slots). Usage lives apart from the quota so that
Redis ACLs (kvpool.index.redis_acl) can let shards charge usage without letting them set quotas.
A tenant's usage is the sum of the registered shards' parts: every reconcile sets its shard's part
from the entries it finds indexed and the totals from the parts (redis_lua.SETTLE), so a counter
written from outside heals.
"""

from __future__ import annotations


class Keys:
    def __init__(self, prefix: str = "kvp") -> None:
        self.prefix = prefix
        self._c = f"{prefix}:c:".encode()
        self.shards = f"{prefix}:shards"
        self.tenants = f"{prefix}:tenants"
        self.events = f"{prefix}:events"
        self.epoch = f"{prefix}:epoch"

    def chunk(self, key: bytes) -> bytes:
        return self._c + key

    def shard_set(self, shard: str) -> str:
        return f"{self.prefix}:s:{shard}"

    def heartbeat(self, shard: str) -> str:
        return f"{self.prefix}:hb:{shard}"

    def tenant(self, tenant: str) -> str:
        return f"{self.prefix}:t:{tenant}"

    def usage(self, tenant: str) -> str:
        return f"{self.prefix}:u:{tenant}"

    def shard_usage(self, shard: str) -> str:
        return f"{self.prefix}:su:{shard}"

    def shard_charges(self, shard: str) -> str:
        return f"{self.prefix}:sv:{shard}"
