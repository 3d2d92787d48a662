"""What a PoolClient call works on: one consistent view of the ring and its shards, one deadline,
and the rules for which failures reach the caller.

- ``View``: the ring, the shards' info, their actor handles and the slabs of this node's shards,
  swapped as one object when the ring changes. A call reads ``client._view`` once and uses only
  that view, so a ring change mid-call never mixes two states (a shard gone from the ring is a
  miss on reads, a failed put on writes, never a KeyError).
- ``Deadline``: one per client call, whatever the number of round trips (reserve then commit,
  several shards, replicas): each wait gets the time left, never the full timeout again.
- ``RoundTrips``: what the client's round trips take, smoothed, so a call's timeout follows them
  on a loaded machine (within the client's ``timeout_s`` and ``max_timeout_s``).
- ``raise_own_429`` / ``raise_refused`` / ``raise_bad_write``: the typed errors that reach the
  caller; every other failure is a miss (reads) or a failed put (writes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import ray

from kvpool.auth import claimed_tenant
from kvpool.cluster.messages import WireMismatch
from kvpool.cluster.ring import HashRing
from kvpool.errors import BadRequest, ChunkTooLarge, KvPoolError
from kvpool.keys import KEY_BYTES
from kvpool.slab import Slab

RAY_FAIL = (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
            ray.exceptions.RayTaskError, ray.exceptions.ObjectLostError)

# What a wait may still get once its call's deadline has passed: enough to collect an answer
# that is already there, never enough to stall.
MIN_WAIT_S = 0.01


@dataclass(frozen=True)
class View:
    """The ring and its shards as one immutable snapshot (``_apply`` builds a new one)."""

    ring: HashRing
    shards: dict = field(default_factory=dict)
    handles: dict = field(default_factory=dict)
    slabs: dict[str, Slab] = field(default_factory=dict)
    secured: bool = False

    @property
    def page_bytes(self) -> int | None:
        """The smallest page of the shards (what any of them can take), None without shards."""
        pages = [int(info.get("page_bytes", 0)) for info in self.shards.values() if info.get("page_bytes")]
        return min(pages) if pages else None


class Deadline:
    """``time.monotonic() + timeout_s``; ``left()`` is what the next wait may take."""

    __slots__ = ("start", "at")

    def __init__(self, timeout_s: float) -> None:
        self.start = time.monotonic()
        self.at = self.start + timeout_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return max(MIN_WAIT_S, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at


class RoundTrips:
    """A smoothed round-trip time and its deviation (Jacobson/Karels, as TCP's retransmission
    timeout, RFC 6298: ``srtt += (s - srtt) / 8``, ``rttvar += (|srtt - s| - rttvar) / 4``),
    from the calls that succeeded (a failed call's time says nothing about the round trip).
    ``timeout(base, cap)`` = ``srtt + 4 x rttvar`` within [base, cap]: the configured timeout
    while round trips are short, longer (up to ``cap``) when a loaded machine makes every round
    trip slow, so that its calls are not all cut into misses."""

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            if self.srtt is None:
                self.srtt, self.rttvar = seconds, seconds / 2
            else:
                self.rttvar += (abs(self.srtt - seconds) - self.rttvar) / 4
                self.srtt += (seconds - self.srtt) / 8

    def timeout(self, base: float, cap: float) -> float:
        if self.srtt is None:
            return base
        return min(cap, max(base, self.srtt + 4 * self.rttvar))


@dataclass
class ClusterRequest:
    """A request in flight across shards: the request id each shard gave its leases."""

    credential: str
    shard_requests: dict[str, int]
    hit_chunks: int

    @property
    def tenant(self) -> str:
        return claimed_tenant(self.credential)


def cause(e: Exception) -> Exception:
    return getattr(e, "cause", e) if isinstance(e, ray.exceptions.RayTaskError) else e


def raise_refused(e: Exception) -> None:
    """A credential the shard refused (401, 403) reaches the caller on every path, reads included:
    it is the caller's error to fix, not a miss."""
    c = cause(e)
    if isinstance(c, KvPoolError) and c.status in (401, 403):
        raise c


def raise_own_429(e: Exception) -> None:
    """A tenant's own 429 (spent quota), a refused credential (401, 403) and a client and shard of
    different wire versions reach the caller, on every write path; every other failure of a write
    is a future miss."""
    c = cause(e)
    if isinstance(c, WireMismatch) or (isinstance(c, KvPoolError) and c.status == 429):
        raise c
    raise_refused(e)


def raise_bad_write(e: Exception, unknown_tenant) -> None:
    """What a write raises: the above, and the caller's bad input a shard refused: 413 (a payload
    larger than its page) and 404 (a tenant it does not serve; ``unknown_tenant()`` confirms it,
    since the shard's index also answers 404 for a tenant it lost in an outage, after the bytes
    were stored). A shard's 400 is not raised: the client checks the caller's input itself
    (``check_put``), and what else a shard answers 400 (an expired reservation, an index that
    forgot the shard) is an outage, a failed put."""
    raise_own_429(e)
    c = cause(e)
    if isinstance(c, KvPoolError) and (c.status == 413 or (c.status == 404 and unknown_tenant())):
        raise c


def check_put(keys: Sequence[object], arrays: Sequence, page_bytes: int | None, shared: object) -> list[bytes]:
    """The raw keys of a batch, every key and payload checked before anything is sent (bad input
    is a typed error and changes nothing, on any shard)."""
    if not isinstance(shared, bool):
        raise BadRequest(f"shared must be True or False, got {shared!r}")
    if len(keys) != len(arrays):
        raise BadRequest(f"{len(keys)} keys but {len(arrays)} payloads: one payload per key")
    raw = []
    for k in keys:
        if not isinstance(k, (bytes, bytearray, memoryview)):
            raise BadRequest(f"a chunk key is {KEY_BYTES} bytes, got {type(k).__name__}: use ChunkKey")
        b = bytes(k)
        if len(b) != KEY_BYTES:
            raise BadRequest(f"a chunk key is {KEY_BYTES} bytes, got {len(b)}: use ChunkKey.from_hex")
        raw.append(b)
    if page_bytes is not None:
        for a in arrays:
            if a.nbytes > page_bytes:
                raise ChunkTooLarge(f"a payload of {a.nbytes} B does not fit the pool's pages of {page_bytes} B: "
                                    "split it, or start the pool with a larger page (kvpool up --page-size)")
    return raw
