"""Bytes between nodes: the one place a transport goes.

A shard reaches another through :class:`PeerTransport`: ``fetch`` (the leading run of a tenant's
chunks another shard holds, each verified by its checksum after it lands) and ``call`` (any other
peer operation of kvpool.node.messages: a spill, a lease, a pin). :class:`StreamTransport` is the
implementation here, one request and its payloads on a kept-open TCP connection to the other
shard's peer port (cluster/node_server.py). Chosen by measurement (docs/benchmarks.md, "Moving
bytes between nodes"): on this machine kind (TCP only, no RDMA) a stream moved a 256 KiB chunk in
0.08-0.12 ms against 0.20-0.24 ms for Mooncake's Transfer Engine over TCP. A one-sided RDMA read
(Mooncake's Transfer Engine or NIXL on an RDMA NIC) implements the same two methods: the serving
shard would lease the pages and answer their places and checksums instead of the bytes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvpool.checksum import checksum
from kvpool.errors import KvPoolError, Unavailable
from kvpool.node import messages as m
from kvpool.node import wire

CALL_TIMEOUT_S = 5.0


class PeerTransport(Protocol):
    credential: str  # the pool's own credential, which every peer operation carries

    def fetch(self, address: str, msg: m.PeerGet, deadline: float,
              into: Callable[[list], list | None] | None = None) -> list[np.ndarray]: ...

    def call(self, address: str, msg: m.Message, payloads: Sequence[np.ndarray] = (),
             deadline: float | None = None) -> object: ...

    def close(self) -> None: ...


class StreamTransport:
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
        try:
            return wire.open_peer(s, self.credential, deadline=deadline)
        except (OSError, KvPoolError):
            s.close()
            raise

    def _request(self, address: str, msg: m.Message, payloads, deadline: float, into=None):
        with self._lock:
            idle = self._idle.setdefault(address, [])
            ch = idle.pop() if idle else None
        try:
            if ch is None:
                ch = self._dial(address, deadline)
            ok, result, got = ch.request(msg, payloads, None, deadline=deadline,
                                         timeout_s=max(deadline - time.monotonic(), 0.01)) if into is None else \
                self._request_into(ch, msg, deadline, into)
        except (OSError, KvPoolError) as e:
            if ch is not None:
                ch.close()
            self.failed += 1
            if isinstance(e, OSError):
                raise Unavailable(f"peer shard {address} did not answer {msg.OP} ({type(e).__name__})") from None
            raise
        with self._lock:
            self._idle.setdefault(address, []).append(ch)
        if not ok:
            raise wire.decode_error(result)
        return result, got

    @staticmethod
    def _request_into(ch: wire.Channel, msg: m.Message, deadline: float, into):
        """A request whose reply's payloads land where ``into(lens)`` says (once their lengths are known)."""
        ch.send([msg.OP, m.WIRE_VERSION, msg.encode(), max(deadline - time.monotonic(), 0.01), []], deadline=deadline)
        reply = ch.recv_header(deadline=deadline)
        if not (isinstance(reply, list) and len(reply) == 3):
            raise Unavailable(f"a peer shard answered {msg.OP} with a malformed reply")
        ok, result, lens = reply
        lens = lens or []
        return ok, result, ch.recv_payloads(lens, into(lens) if ok and lens else None, deadline=deadline)

    def fetch(self, address: str, msg: m.PeerGet, deadline: float, into=None) -> list[np.ndarray]:
        """The leading run of ``msg.keys`` the peer at ``address`` holds, each verified; a failure
        raises (the caller counts the rest as misses). ``into(lens)`` may give the buffers the
        bytes land in (None: new arrays)."""
        result, arrays = self._request(address, msg, (), deadline, into)
        out = []
        for a, cs in zip(arrays, result["checksums"]):
            if checksum(a) != cs:  # torn or corrupted on the way: the run ends (a miss)
                break
            out.append(a)
        self.fetched += len(out)
        return out

    def call(self, address: str, msg: m.Message, payloads: Sequence[np.ndarray] = (),
             deadline: float | None = None) -> object:
        """Another peer operation's result."""
        deadline = time.monotonic() + CALL_TIMEOUT_S if deadline is None else deadline
        return self._request(address, msg, payloads, deadline)[0]

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for chans in idle.values():
            for ch in chans:
                ch.close()
