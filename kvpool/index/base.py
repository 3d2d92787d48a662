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
- the index is rebuildable: ``reconcile`` republishes what a shard holds and the index lacks
  (after a Redis restart with an empty dataset, or entries deleted behind its back: it compares
  the shard's store with the entries present, not with its own listing) and drops what it no
  longer holds; a backend whose usage counters can be written from outside (Redis) recomputes
  them there from what is indexed, so a forged counter heals;
- stored and removed chunks are appended to an event stream for routers.
"""

from __future__ import annotations

import math
import numbers
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from kvpool.errors import BadRequest, QuotaExceeded, UnknownTenant
from kvpool.keys import ChunkKey, as_key, as_keys
from kvpool.tenants import PRIORITY_CLASSES, UNLIMITED

MAX_LOOKUP = 2048  # keys answered in one round trip
_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_EVENT_ID = re.compile(r"^[0-9]{1,19}(-[0-9]{1,19})?$")  # Redis stream ids: two 64-bit parts


def check_name(kind: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):  # NOTE: match() lets "a\n" through
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
        c = self.created
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not (math.isfinite(c) and c >= 0):
            raise BadRequest(f"entry created must be a Unix time in seconds >= 0 (0: now), got {c!r}")

    # Wire form: shard \\0 tier \\0 msgpack([nbytes, tenant, checksum, created]). A lookup reads the
    # location without decoding the rest; Redis's Lua reads the rest with cmsgpack.
    def encode(self) -> bytes:
        rest = msgpack.packb([self.nbytes, self.tenant, self.checksum, self.created or time.time()])
        return self.shard.encode() + b"\0" + self.tier.encode() + b"\0" + rest

    @classmethod
    def decode(cls, key: ChunkKey, raw: bytes) -> "IndexEntry":
        """The entry from its wire form; a BadRequest when the bytes are not one (corrupt, or
        written by something else)."""
        try:
            shard, tier, rest = raw.split(b"\0", 2)
            nbytes, tenant, checksum, created = msgpack.unpackb(rest)
            return cls(key, shard.decode(), tier.decode(), nbytes, tenant, checksum, created)
        except (ValueError, TypeError, msgpack.UnpackException) as e:  # UnicodeDecodeError is a ValueError
            if isinstance(e, BadRequest):
                raise BadRequest(f"malformed index entry for key {key}: {e.message}") from None
            raise BadRequest(
                f"malformed index entry for key {key}: {type(e).__name__}: expected shard \\0 tier \\0 "
                "msgpack([nbytes, tenant, checksum, created]); remove it and let its shard republish it"
            ) from None


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
    refused: tuple = ()  # the held entries the index refused (a tenant over its quota, or unknown)


def check_keys(keys: Sequence[object]) -> list[ChunkKey]:
    if type(keys) is list and all(type(k) is ChunkKey for k in keys):  # the common case, without a call per key
        return list(keys)
    return as_keys(keys)


def check_lookup_keys(keys: object) -> list[ChunkKey]:
    """The first MAX_LOOKUP keys of a lookup, checked."""
    if isinstance(keys, (list, tuple)) and len(keys) > MAX_LOOKUP:
        keys = keys[:MAX_LOOKUP]
    return check_keys(keys)[:MAX_LOOKUP]


def check_entries(entries: object) -> list["IndexEntry"]:
    if not isinstance(entries, (list, tuple)):
        raise BadRequest(f"publish takes a list of IndexEntry objects, got {type(entries).__name__}")
    for e in entries:
        if not isinstance(e, IndexEntry):
            raise BadRequest(f"publish takes IndexEntry objects, got {type(e).__name__}")
    return list(entries)


def check_ttl(ttl_s: object) -> float:
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not (math.isfinite(ttl_s) and ttl_s >= 0):
        raise BadRequest(f"ttl_s must be a finite number of seconds >= 0, got {ttl_s!r}")
    return float(ttl_s)


def check_max_events(max_events: object) -> int:
    if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 1:
        raise BadRequest(f"max_events must be an int >= 1 (events the stream keeps), got {max_events!r}")
    return max_events


def check_address(address: object) -> str:
    if not isinstance(address, str):
        raise BadRequest(f"a shard's address is a string ('' for none), got {type(address).__name__}")
    return address


def check_event_query(after: object, count: object) -> tuple[str, int]:
    """An event id (``n`` or ``n-m``, each part below 2**64) and a count >= 1."""
    if not isinstance(after, str) or not _EVENT_ID.fullmatch(after) or any(int(x) >= 2**64 for x in after.split("-")):
        raise BadRequest(f"event id {after!r} is malformed: pass an id from a previous event, or '0-0'")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise BadRequest(f"count must be an int >= 1 (events per call), got {count!r}")
    return after, count


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

    @abstractmethod
    def forget_shard(self, shard: str) -> int:
        """Removes one shard's entries (refunding them) and its membership, alive or not (the
        controller's verdict: its node is dead, or it cannot be reached); how many entries."""

    # ---------------------------------------------------------------- epoch
    # A token the controller writes once; the index without it has restarted empty (or was
    # flushed), and the controller re-applies the operator state it last saw.
    @abstractmethod
    def epoch(self) -> str | None: ...

    @abstractmethod
    def set_epoch(self, token: str) -> None: ...

    def reconcile(self, shard: str, held: Sequence[IndexEntry]) -> ReconcileResult:
        """Makes the index say exactly what ``shard`` holds: publishes what is missing, removes
        what it no longer has. Idempotent."""
        check_name("shard id", shard)
        held = check_entries(held)
        for e in held:
            if e.shard != shard:
                raise BadRequest(f"reconcile of shard {shard!r} got an entry of shard {e.shard!r}")
        have = self.shard_keys(shard)
        want = {e.key for e in held}
        removed = self.remove(sorted(have - want), shard=shard) if have - want else 0
        published, refused = self._republish([e for e in held if e.key not in have])
        return ReconcileResult(published, removed, tuple(refused))

    def _republish(self, missing: Sequence[IndexEntry]) -> tuple[int, list[IndexEntry]]:
        """Publishes a reconcile's missing entries: (how many were published, the refused ones)."""
        # NOTE: one tenant over its quota (or unknown) must not block the others' entries: publish
        # per tenant, and within a refused tenant what fits (oldest first); the rest is refused.
        by_tenant: dict[str, list[IndexEntry]] = {}
        for e in missing:
            by_tenant.setdefault(e.tenant, []).append(e)
        published, refused = 0, []
        for entries in by_tenant.values():
            try:
                published += sum(self.publish(entries))
                continue
            except (QuotaExceeded, UnknownTenant):
                pass
            ordered = sorted(entries, key=lambda e: e.created)
            for i, e in enumerate(ordered):
                try:
                    published += sum(self.publish([e]))
                except UnknownTenant:
                    refused += ordered[i:]
                    break
                except QuotaExceeded:
                    refused.append(e)
        return published, refused

    # ---------------------------------------------------------------- events
    @abstractmethod
    def events(self, after: str = "0-0", count: int = 1000) -> list[Event]:
        """Stored/removed events after the event id ``after`` (oldest first)."""

    def close(self) -> None:  # noqa: B027 - optional: a backend with nothing to release keeps it
        pass
