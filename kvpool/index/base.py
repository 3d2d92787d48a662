"""The index contract: where every chunk of the pool is, who pays for it, which shards are alive.

Two implementations keep it: ``EmbeddedIndex`` (in-process, the default for one machine) and
``RedisIndex`` (a cluster's global index). One contract test suite runs against both.

Rules of the contract:
- bytes before index: a shard publishes a chunk only after storing it;
- publication charges the tenant atomically: racing writers never push usage past the quota
  (QuotaExceeded, 429), and a removal refunds exactly what was charged;
- a lookup answers "how many leading keys of this prompt exist, and where" in one round trip,
  and never raises: when the index cannot answer in time it is a miss (count 0);
- a shard whose heartbeat lapses is dead; ``purge_dead`` removes its entries and refunds them;
- the index is rebuildable: ``reconcile`` republishes what a shard holds (after a Redis restart
  with an empty dataset) and drops what it no longer holds;
- stored and removed chunks are appended to an event stream for routers.
"""

from __future__ import annotations

import numbers
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from kvpool.errors import BadRequest
from kvpool.keys import ChunkKey, as_key
from kvpool.tenants import PRIORITY_CLASSES, UNLIMITED

MAX_LOOKUP = 2048  # keys answered in one round trip
_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


def check_name(kind: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise BadRequest(
            f"{kind} {value!r} is not a valid name: 1-128 characters of letters, digits and _ . : @ -"
        )
    return value


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One published chunk."""

    key: ChunkKey
    shard: str
    tier: str
    nbytes: int
    tenant: str
    checksum: int
    created: float = 0.0

    def __post_init__(self) -> None:
        as_key(self.key)
        check_name("shard id", self.shard)
        check_name("tier", self.tier)
        check_name("tenant", self.tenant)
        for name, lo, hi in (("nbytes", 1, 2**40), ("checksum", 0, 2**64)):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not lo <= v < hi:
                raise BadRequest(f"entry {name} must be an int in [{lo}, {hi}), got {v!r}")
            object.__setattr__(self, name, int(v))  # numpy ints become plain ints

    # Wire form: shard \\0 tier \\0 msgpack([nbytes, tenant, checksum, created]). A lookup reads the
    # location without decoding the rest; Redis's Lua reads the rest with cmsgpack.
    def encode(self) -> bytes:
        rest = msgpack.packb([self.nbytes, self.tenant, self.checksum, self.created or time.time()])
        return self.shard.encode() + b"\0" + self.tier.encode() + b"\0" + rest

    @classmethod
    def decode(cls, key: ChunkKey, raw: bytes) -> "IndexEntry":
        shard, tier, rest = raw.split(b"\0", 2)
        nbytes, tenant, checksum, created = msgpack.unpackb(rest)
        return cls(key, shard.decode(), tier.decode(), nbytes, tenant, checksum, created)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The leading run of a prompt's keys that the index holds, and where each one is."""

    count: int
    shards: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    error: str | None = None  # set when the index could not answer (then count is 0)


MISS = PrefixHit(0)


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    kind: str  # "stored" | "removed"
    key: ChunkKey
    shard: str
    tenant: str


@dataclass(frozen=True, slots=True)
class TenantInfo:
    id: str
    usage: int
    quota: int
    priority: str


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    published: int
    removed: int


def check_keys(keys: Sequence[object]) -> list[ChunkKey]:
    if all(type(k) is ChunkKey for k in keys):  # the common case, without a call per key
        return list(keys)
    return [as_key(k) for k in keys]


def check_quota(quota: object) -> int:
    if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
        raise BadRequest(f"a quota is a whole number of bytes >= 0, got {quota!r}")
    return min(quota, UNLIMITED)


def check_priority(priority: object) -> str:
    if priority not in PRIORITY_CLASSES:
        raise BadRequest(f"priority must be one of {PRIORITY_CLASSES}, got {priority!r}")
    return priority


class Index(ABC):
    """The contract. Reads (``lookup``, ``get``) never raise on an unreachable index; writes raise
    ``Unavailable`` (503) then."""

    # ---------------------------------------------------------------- tenants
    @abstractmethod
    def add_tenant(self, tenant: str, quota: int = UNLIMITED, priority: str = "normal") -> None:
        """Registers a tenant (or updates its quota and priority)."""

    @abstractmethod
    def set_quota(self, tenant: str, quota: int) -> None: ...

    @abstractmethod
    def set_priority(self, tenant: str, priority: str) -> None: ...

    @abstractmethod
    def tenants(self) -> list[TenantInfo]: ...

    def usage(self, tenant: str) -> int:
        for t in self.tenants():
            if t.id == tenant:
                return t.usage
        from kvpool.errors import UnknownTenant

        raise UnknownTenant(tenant)

    # ---------------------------------------------------------------- chunks
    @abstractmethod
    def publish(self, entries: Sequence[IndexEntry]) -> list[bool]:
        """Publishes chunks and charges their tenants, all or nothing per tenant's quota: a True per
        entry newly published (False: the key was already published). Raises QuotaExceeded (429)
        and writes nothing when a tenant would pass its quota, UnknownTenant for an unregistered
        tenant, BadRequest for a shard that is not registered."""

    @abstractmethod
    def remove(self, keys: Sequence[ChunkKey], shard: str | None = None) -> int:
        """Removes entries (only those on ``shard`` when given) and refunds; how many."""

    @abstractmethod
    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixHit:
        """The leading run of ``keys`` that is published, in one round trip. Never raises."""

    @abstractmethod
    def get(self, key: ChunkKey) -> IndexEntry | None: ...

    def invalidate(self, key: ChunkKey, shard: str) -> bool:
        """A reader found no bytes (or bad ones) where the index pointed: drop that entry."""
        return self.remove([key], shard=shard) == 1

    # ---------------------------------------------------------------- membership
    @abstractmethod
    def register_shard(self, shard: str, address: str = "", ttl_s: float = 10.0) -> None: ...

    @abstractmethod
    def heartbeat(self, shard: str, ttl_s: float = 10.0) -> None: ...

    @abstractmethod
    def shards(self) -> dict[str, bool]:
        """Every registered shard and whether its heartbeat is alive."""

    @abstractmethod
    def purge_dead(self) -> dict[str, int]:
        """Removes the entries of every shard whose heartbeat lapsed (refunding them) and forgets
        the shard; how many entries each had."""

    @abstractmethod
    def shard_keys(self, shard: str) -> set[ChunkKey]: ...

    def reconcile(self, shard: str, held: Sequence[IndexEntry]) -> ReconcileResult:
        """Makes the index say exactly what ``shard`` holds: publishes what is missing, removes
        what it no longer has. Idempotent."""
        for e in held:
            if e.shard != shard:
                raise BadRequest(f"reconcile of shard {shard!r} got an entry of shard {e.shard!r}")
        have = self.shard_keys(shard)
        want = {e.key for e in held}
        removed = self.remove(sorted(have - want), shard=shard) if have - want else 0
        published = sum(self.publish([e for e in held if e.key not in have]))
        return ReconcileResult(published, removed)

    # ---------------------------------------------------------------- events
    @abstractmethod
    def events(self, after: str = "0-0", count: int = 1000) -> list[Event]:
        """Stored/removed events after the event id ``after`` (oldest first)."""

    def close(self) -> None:
        pass
