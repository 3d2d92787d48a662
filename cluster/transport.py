"""How chunk bytes travel between a client and a shard on another node.

A transport starts a batched send (``Put``) or fetch (``Get``) to a shard and returns a future;
the client waits on it with its timeout (and its call's ``deadline``, a ``time.monotonic()``
instant that every round trip of the wait shares: a same-node write's reserve and commit together
take no longer than the call's timeout) and gets the count stored, or a ``Got`` holding the
leading run of the asked chunks. Two are built in: ``SharedMemoryTransport`` for the shard on the
client's own node (the client maps its DRAM slab and copies the bytes itself, one verified copy;
the shard only says where and hears when done) and ``RayObjectTransport`` for the others (bytes
ride Ray's object store). Another one (an RDMA engine such as NIXL or Mooncake's transfer engine)
plugs in by implementing the same three methods and registering in ``TRANSPORTS``.

NOTE: Ray's direct tensor transport (RDT, ``@ray.method(tensor_transport="gloo")``) was tried on
this machine kind (Ray 2.60, CPU, two raylets on loopback): the transfer of a 32 MiB tensor
between two actors never completed (Ray's RDT timeout fired and killed both actors), so the
object store stays the transport; ``kvpool bench datapath --rdt`` repeats the probe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import ray

from kvpool.buffers import as_byte_array
from kvpool.checksum import copy_with_checksum
from kvpool.cluster.messages import Commit, Get, Got, LeaseReads, Put, Reserve, check_version
from kvpool.errors import BadRequest, Unavailable

# What a round trip may still get once the deadline has passed: an answer already there.
_MIN_WAIT_S = 0.01


def _left(timeout_s: float, deadline: float | None) -> float:
    """The seconds the next round trip may take: what is left before ``deadline`` (all of
    ``timeout_s`` without one)."""
    if deadline is None:
        return timeout_s
    return max(_MIN_WAIT_S, min(timeout_s, deadline - time.monotonic()))


class Transport(Protocol):
    name: str

    def send(self, shard, put: Put): ...

    def fetch(self, shard, get: Get): ...

    def wait(self, future, timeout_s: float, *, deadline: float | None = None): ...


class SharedMemoryTransport:
    """The shard on this node: bytes are copied straight into and out of its shared-memory slab.

    A write reserves pages (one call), copies each chunk in computing its xxh3-64 in the same
    pass, and commits (a second call, which publishes). A read leases the chunks it may need (for
    every key asked, misses allowed, so the lease can go out at the same time as the index
    lookup), copies and verifies the positions the index places here (``want``), and releases
    the lease (fire and forget; it also expires), naming a chunk that failed its checksum."""

    name = "shm"

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf

    def send(self, shard, put: Put) -> "_Write":
        sizes = [int(np.asarray(p).shape[0]) for p in put.payloads]
        return _Write(shard, put, shard.reserve.remote(Reserve(put.write, sizes)))

    def fetch(self, shard, get: Get, outs: Sequence[object] | None = None) -> "_Read":
        return _Read(shard, get, shard.lease_reads.remote(LeaseReads(get.keys, get.credential, False, get.shared)), outs)

    def wait(self, future, timeout_s: float, *, deadline: float | None = None):
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        if isinstance(future, _Write):
            return self._write(future, timeout_s, deadline)
        return self._read(future, timeout_s, deadline)

    def _write(self, w: "_Write", timeout_s: float, deadline: float) -> int:
        reserved = ray.get(w.reserve, timeout=_left(timeout_s, deadline))
        check_version(reserved, "this client")
        by_key = dict(zip(w.put.write.keys, w.put.payloads))
        sums, committed = [], []
        for p in reserved.places:
            sums.append(copy_with_checksum(self.buf[p.offset : p.offset + p.nbytes], by_key[p.key]))
            committed.append(p.key)
        commit = w.shard.commit.remote(Commit(reserved.hold_id, committed, sums, w.put.write.credential))
        try:
            return ray.get(commit, timeout=_left(timeout_s, deadline))
        except BadRequest as e:
            # NOTE: the reservation expired (or the shard restarted) between reserve and commit:
            # not the caller's input, a failed write (a future miss).
            raise Unavailable(f"the shard dropped the reservation before its commit ({e})") from None

    def _read(self, r: "_Read", timeout_s: float, deadline: float) -> Got:
        leased = ray.get(r.lease, timeout=_left(timeout_s, deadline))
        check_version(leased, "this client")
        out: list[np.ndarray] = []
        bad: list[bytes] = []
        for i in r.wanted:
            p = leased.places[i]
            if p is None:  # listed by the index, not held here: the run ends (the index is stale)
                break
            dst = np.empty(p.nbytes, dtype=np.uint8) if r.outs is None else \
                as_byte_array(r.outs[i], writable=True)[: p.nbytes]
            if dst.shape[0] != p.nbytes:  # a payload larger than the caller's buffer: not its chunk, a miss
                break
            if copy_with_checksum(dst, self.buf[p.offset : p.offset + p.nbytes]) != p.checksum:
                bad.append(r.get.keys[i])
                break
            out.append(dst)
        # fire and forget: the lease also expires on its own
        r.shard.release.remote(leased.hold_id, bad, r.get.credential, r.get.shared)
        return Got(out, corrupt=bool(bad))


class _Write:
    __slots__ = ("shard", "put", "reserve")

    def __init__(self, shard, put: Put, reserve) -> None:
        self.shard, self.put, self.reserve = shard, put, reserve


class _Read:
    """A read lease on the way; ``want(positions)`` says which of the asked keys to copy."""

    __slots__ = ("shard", "get", "lease", "outs", "wanted")

    def __init__(self, shard, get: Get, lease, outs) -> None:
        self.shard, self.get, self.lease, self.outs, self.wanted = shard, get, lease, outs, []

    def want(self, positions: list[int]) -> "_Read":
        self.wanted = positions
        return self


class RayObjectTransport:
    """Bytes ride Ray's object store: arguments of a shard's ``put``, results of its ``get``."""

    name = "ray"

    def send(self, shard, put: Put):
        return shard.put.remote(put)

    def fetch(self, shard, get: Get):
        return shard.get.remote(get)

    def wait(self, future, timeout_s: float, *, deadline: float | None = None):
        return ray.get(future, timeout=_left(timeout_s, deadline))


TRANSPORTS: dict[str, type] = {"ray": RayObjectTransport}
