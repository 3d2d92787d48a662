"""EmbeddedIndex: the index contract in-process, for one machine with no server to run.

Same semantics as RedisIndex, TTL membership and quotas included, under one lock (the way SQLite
stands in for a server database).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvpool.errors import BadRequest, QuotaExceeded, UnknownTenant
from kvpool.index import base as checks
from kvpool.index.base import MISS, Event, Index, IndexEntry, PrefixHit, TenantInfo
from kvpool.keys import ChunkKey
from kvpool.tenants import UNLIMITED


class EmbeddedIndex(Index):
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_events: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._entries: dict[ChunkKey, IndexEntry] = {}
        self._by_shard: dict[str, set[ChunkKey]] = {}
        self._shards: dict[str, tuple[str, float]] = {}  # shard -> (address, heartbeat deadline)
        self._tenants: dict[str, list] = {}  # id -> [usage, quota, priority]
        self._events: deque[Event] = deque(maxlen=checks.check_max_events(max_events))
        self._seq = itertools.count(1)
        self._epoch: str | None = None

    # ---------------------------------------------------------------- tenants
    def add_tenant(self, tenant: str, quota: int = UNLIMITED, priority: str = "normal") -> None:
        checks.check_name("tenant", tenant)
        quota, priority = checks.check_quota(quota), checks.check_priority(priority)
        with self._lock:
            t = self._tenants.setdefault(tenant, [0, quota, priority])
            t[1], t[2] = quota, priority

    def set_quota(self, tenant: str, quota: int) -> None:
        checks.check_name("tenant", tenant)
        quota = checks.check_quota(quota)
        with self._lock:
            self._tenant(tenant)[1] = quota

    def set_priority(self, tenant: str, priority: str) -> None:
        checks.check_name("tenant", tenant)
        priority = checks.check_priority(priority)
        with self._lock:
            self._tenant(tenant)[2] = priority

    def tenants(self) -> list[TenantInfo]:
        with self._lock:
            return [TenantInfo(k, v[0], v[1], v[2]) for k, v in sorted(self._tenants.items())]

    def _tenant(self, tenant: str) -> list:
        t = self._tenants.get(tenant)
        if t is None:
            raise UnknownTenant(tenant)
        return t

    # ---------------------------------------------------------------- chunks
    def publish(self, entries: Sequence[IndexEntry]) -> list[bool]:
        entries = checks.check_entries(entries)
        with self._lock:
            charge: dict[str, int] = {}
            fresh: list[bool] = []
            seen: set[ChunkKey] = set()
            for e in entries:
                if e.shard not in self._shards:
                    raise BadRequest(f"unknown shard {e.shard!r}: register it before publishing")
                self._tenant(e.tenant)
                new = e.key not in self._entries and e.key not in seen
                seen.add(e.key)
                fresh.append(new)
                if new:
                    charge[e.tenant] = charge.get(e.tenant, 0) + e.nbytes
            for tenant, nbytes in charge.items():
                usage, quota, _ = self._tenants[tenant]
                if usage + nbytes > quota:
                    raise QuotaExceeded(tenant, usage, quota, nbytes)
            now = time.time()
            for e, new in zip(entries, fresh):
                if not new:
                    continue
                if not e.created:
                    e = IndexEntry(e.key, e.shard, e.tier, e.nbytes, e.tenant, e.checksum, now)
                self._entries[e.key] = e
                self._by_shard.setdefault(e.shard, set()).add(e.key)
                self._tenants[e.tenant][0] += e.nbytes
                self._events.append(Event(f"{next(self._seq)}-0", "stored", e.key, e.shard, e.tenant))
            return fresh

    def remove(self, keys: Sequence[ChunkKey], shard: str | None = None) -> int:
        keys = checks.check_keys(keys)
        if shard is not None:
            checks.check_name("shard id", shard)
        with self._lock:
            return sum(self._remove(k, shard) for k in keys)

    def _remove(self, key: ChunkKey, shard: str | None) -> bool:
        e = self._entries.get(key)
        if e is None or (shard is not None and e.shard != shard):
            return False
        del self._entries[key]
        self._by_shard[e.shard].discard(key)
        t = self._tenants.get(e.tenant)
        if t is not None:
            t[0] -= e.nbytes
        self._events.append(Event(f"{next(self._seq)}-0", "removed", key, e.shard, e.tenant))
        return True

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixHit:
        try:
            keys = checks.check_lookup_keys(keys)
        except BadRequest as e:
            return PrefixHit(0, error=str(e))
        shards, tiers = [], []
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    break
                shards.append(e.shard)
                tiers.append(e.tier)
        return PrefixHit(len(shards), tuple(shards), tuple(tiers)) if shards else MISS

    def get(self, key: ChunkKey) -> IndexEntry | None:
        (key,) = checks.check_keys([key])
        with self._lock:
            return self._entries.get(key)

    # ---------------------------------------------------------------- membership
    def register_shard(self, shard: str, address: str = "", ttl_s: float = 10.0) -> None:
        checks.check_name("shard id", shard)
        address, ttl_s = checks.check_address(address), checks.check_ttl(ttl_s)
        with self._lock:
            self._shards[shard] = (address, self._clock() + ttl_s)

    def heartbeat(self, shard: str, ttl_s: float = 10.0) -> None:
        checks.check_name("shard id", shard)
        ttl_s = checks.check_ttl(ttl_s)
        with self._lock:
            if shard not in self._shards:
                raise BadRequest(f"unknown shard {shard!r}: register it first")
            self._shards[shard] = (self._shards[shard][0], self._clock() + ttl_s)

    def shards(self) -> dict[str, bool]:
        now = self._clock()
        with self._lock:
            return {s: deadline > now for s, (_, deadline) in sorted(self._shards.items())}

    def purge_dead(self) -> dict[str, int]:
        now = self._clock()
        out: dict[str, int] = {}
        with self._lock:
            for s, (_, deadline) in list(self._shards.items()):
                if deadline > now:
                    continue
                keys = list(self._by_shard.pop(s, set()))
                self._by_shard[s] = set(keys)
                out[s] = sum(self._remove(k, s) for k in keys)
                del self._by_shard[s]
                del self._shards[s]
        return out

    def forget_shard(self, shard: str) -> int:
        checks.check_name("shard id", shard)
        with self._lock:
            keys = list(self._by_shard.get(shard, ()))
            n = sum(self._remove(k, shard) for k in keys)
            self._by_shard.pop(shard, None)
            self._shards.pop(shard, None)
            return n

    def epoch(self) -> str | None:
        return self._epoch

    def set_epoch(self, token: str) -> None:
        self._epoch = token

    def shard_keys(self, shard: str) -> set[ChunkKey]:
        checks.check_name("shard id", shard)
        with self._lock:
            return set(self._by_shard.get(shard, ()))

    # ---------------------------------------------------------------- events
    def events(self, after: str = "0-0", count: int = 1000) -> list[Event]:
        after, count = checks.check_event_query(after, count)
        n = int(after.split("-")[0])
        with self._lock:
            return [e for e in self._events if int(e.id.split("-")[0]) > n][:count]
