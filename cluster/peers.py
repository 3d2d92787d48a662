"""Bytes between nodes: one shard reading another's chunks, directly, for the engines of its node.

Chosen by measurement (docs/benchmarks.md, "Moving bytes between nodes"): on this machine kind
(TCP only, no RDMA), a stream on a TCP connection between two shards moved a 256 KiB chunk in
0.08-0.12 ms and 32 MiB at 1.1-2.8 GB/s, against 0.20-0.24 ms and 0.4-1.8 GB/s for Mooncake's
Transfer Engine over TCP (kvpool.node.te), 0.56-0.62 GB/s for Ray with NIXL and 0.2-0.3 GB/s for
Ray's object store. So ``stream`` carries the bytes here; the interface (``fetch`` the leading run
of a tenant's keys from one shard in one round trip) is what a one-sided RDMA read (Mooncake's
engine on an RDMA NIC) implements next, and Ray's object store stays the fallback for a shard
that publishes no peer address.

The serving side (``serve_peer_get``) verifies the tenant's credential itself and computes the
addresses from it, leases the chunks while their pages go out straight from its slab, and sends
each chunk's checksum, which the reading side verifies after the bytes land.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from kvpool.checksum import checksum
from kvpool.errors import KvPoolError, Unavailable
from kvpool.node import wire


class PeerLinks:
    """Connections to other shards' peer ports, kept open (one idle list per peer)."""

    def __init__(self, pool_credential: str) -> None:
        self.credential = pool_credential
        self._idle: dict[str, list[wire.Channel]] = {}
        self._lock = threading.Lock()
        self.fetched = 0
        self.failed = 0

    def _dial(self, address: str, deadline: float) -> wire.Channel:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.01))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return wire.Channel(s)

    def fetch(self, address: str, credential: str, keys: list[bytes], shared: bool, deadline: float,
              into=None) -> list[np.ndarray]:
        """The leading run of ``keys`` (a tenant's, by its ``credential``) the peer at ``address``
        holds, each verified; a failure raises (the caller counts the rest as misses). ``into(lens)``
        may give the buffers the bytes land in (None: new arrays)."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            ch = idle.pop() if idle else None
        try:
            if ch is None:
                ch = self._dial(address, deadline)
            ch.send(["peer_get", {"pool": self.credential, "credential": credential, "keys": keys, "shared": shared,
                                  "timeout_s": max(deadline - time.monotonic(), 0.01)}], deadline=deadline)
            reply = ch.recv_header(deadline=deadline)
            if not (isinstance(reply, list) and len(reply) == 3):
                raise Unavailable("a peer shard answered with a malformed reply")
            ok, result, lens = reply
            lens = lens or []
            arrays = ch.recv_payloads(lens, into(lens) if into is not None and ok and lens else None, deadline=deadline)
        except (OSError, KvPoolError) as e:
            if ch is not None:
                ch.close()
            self.failed += 1
            if isinstance(e, OSError):
                raise Unavailable(f"peer shard {address} did not answer ({type(e).__name__})") from None
            raise
        with self._lock:
            self._idle.setdefault(address, []).append(ch)
        if not ok:
            raise wire.decode_error(result)
        out = []
        for a, cs in zip(arrays, result["checksums"]):
            if checksum(a) != cs:  # torn or corrupted on the way: the run ends (a miss)
                break
            out.append(a)
        self.fetched += len(out)
        return out

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for chans in idle.values():
            for ch in chans:
                ch.close()


def serve_peer_get(shard, pool: str, credential: str, keys: list, shared: bool):
    """A peer shard's read of the leading run of a tenant's chunks held here: (result, payloads)
    and a callback that ends the lease once the payloads are sent."""
    shard.auth.require(pool, "reading chunks for another shard", "pool")
    from kvpool.cluster.shard_access import where, who

    p = who(shard, credential)
    hold, places = shard.store.lease_reads(where(p, keys, shared), p.tenant)
    buf = shard.store.slab("dram").buf
    payloads = [buf[pl.offset : pl.offset + pl.nbytes] for pl in places if pl is not None]
    sums = [int(pl.checksum) for pl in places if pl is not None]
    return {"checksums": sums}, payloads, lambda: shard.store.release(hold, [])
