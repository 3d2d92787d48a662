"""What an engine and its node's shard say over the local socket (and shards to each other).

One frame: a 4-byte big-endian length, a msgpack header, then the raw payloads the header
announces (``lens``), sent from and received into numpy buffers without an extra copy.

- request header: ``[op, version, fields, timeout_s, lens]``: a typed message of
  kvpool.node.messages (its operation, wire version and fields), how long the caller waits, and the
  byte lengths of the payloads that follow;
- reply header: ``[ok, result, lens]``; when not ok, ``result`` is ``{"type", "fields"}`` of a
  typed error (kvpool.errors), rebuilt as the same class on the other side.

Every send and receive runs against a deadline (``socket.settimeout`` with what is left); a
connection that failed mid-frame is in an unknown state and is closed by its owner.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Sequence

import msgpack
import numpy as np

from kvpool.errors import BadRequest, KvPoolError, Unavailable
from kvpool.node import messages

MAX_HEADER = 1 << 20  # a header this large is a bug or an attack (2048 keys take 40 KiB)
PEER_MAGIC = b"KVP5"  # a peer port's opening (open_peer): magic and nonces, then HMACs, before any frame
PEER_NONCE = 16
PEER_MAC = 32
MAX_PAYLOAD = 1 << 36
_LEN = struct.Struct(">I")


class Timeout(Unavailable):
    """The peer did not answer within the call's deadline."""


class PeerUnproven(Unavailable):
    """A peer port that could not prove it holds the pool's credential: to a shard, no peer at all."""


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Timeout("the call's deadline passed")
    return left


def send(sock: socket.socket, header: object, payloads: Sequence[np.ndarray] = (), *, deadline: float) -> None:
    """Sends one frame: ``header`` and then each payload's bytes (contiguous uint8 arrays)."""
    body = msgpack.packb(header, use_bin_type=True)
    sock.settimeout(_left(deadline))
    sock.sendall(_LEN.pack(len(body)) + body)
    for p in payloads:
        sock.settimeout(_left(deadline))
        sock.sendall(memoryview(p).cast("B"))


def _peer_mac(key: str, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key.encode(), PEER_MAGIC + side + first + second, hashlib.sha256).digest()


def open_peer(sock: socket.socket, key: str, *, deadline: float) -> "Channel":
    """A shard opening another shard's peer port: both prove they hold the pool's credential
    (``key``) over the other's fresh nonce, before any frame. The dialer sends ``magic, nonce``;
    the port answers its own nonce and an HMAC over both; the dialer checks it (a port that cannot
    make it is not the pool's, and is sent nothing more: Unauthorized) and answers its HMAC. Fresh
    nonces on both sides: a captured opening replays nowhere. The channel, ready for frames."""
    mine = os.urandom(PEER_NONCE)
    send_raw(sock, PEER_MAGIC + mine, deadline=deadline)
    ch = Channel(sock)
    got = bytearray(PEER_NONCE + PEER_MAC)
    ch.recv_exact(memoryview(got), deadline=deadline)
    theirs, mac = bytes(got[:PEER_NONCE]), bytes(got[PEER_NONCE:])
    if not hmac.compare_digest(mac, _peer_mac(key, b"port", mine, theirs)):
        raise PeerUnproven("the peer port did not prove it holds the pool's credential: not one of the pool's "
                           "shards, sent nothing")
    send_raw(sock, _peer_mac(key, b"dialer", theirs, mine), deadline=deadline)
    return ch


def answer_peer(ch: "Channel", key: str, *, deadline: float) -> bool:
    """The peer port's side of :func:`open_peer`: whether the dialer proved it holds ``key``
    (nothing but fixed-size openings is read before that)."""
    hello = bytearray(len(PEER_MAGIC) + PEER_NONCE)
    ch.recv_exact(memoryview(hello), deadline=deadline)
    if bytes(hello[: len(PEER_MAGIC)]) != PEER_MAGIC:
        return False
    theirs, mine = bytes(hello[len(PEER_MAGIC):]), os.urandom(PEER_NONCE)
    send_raw(ch.sock, mine + _peer_mac(key, b"port", theirs, mine), deadline=deadline)
    mac = bytearray(PEER_MAC)
    ch.recv_exact(memoryview(mac), deadline=deadline)
    return hmac.compare_digest(bytes(mac), _peer_mac(key, b"dialer", mine, theirs))


def send_raw(sock: socket.socket, data: bytes, *, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    sock.sendall(data)


class Channel:
    """A stream socket with a receive buffer: a small frame (header and all) usually arrives in
    one ``recv``; payload bytes beyond what the buffer holds go straight into their destination."""

    BUFFER = 1 << 16

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(self.BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def close(self) -> None:
        self.sock.close()

    def send(self, header: object, payloads: Sequence[np.ndarray] = (), *, deadline: float) -> None:
        send(self.sock, header, payloads, deadline=deadline)

    def request(self, msg: messages.Message, payloads: Sequence[np.ndarray] = (),
                outs: Sequence[np.ndarray | None] | None = None, *, deadline: float, timeout_s: float):
        """One call: ``msg`` (and its payloads) out, ``(ok, result, payloads)`` back; the reply's
        payloads land in ``outs[i]`` where given and large enough."""
        self.send([msg.OP, messages.WIRE_VERSION, msg.encode(), timeout_s, [int(p.nbytes) for p in payloads]],
                  payloads, deadline=deadline)
        reply = self.recv_header(deadline=deadline)
        if not (isinstance(reply, list) and len(reply) == 3):
            raise Unavailable(f"the shard answered {msg.OP} with a malformed reply")
        ok, result, lens = reply
        return ok, result, self.recv_payloads(lens or [], outs if ok else None, deadline=deadline)

    def _fill(self, need: int, deadline: float) -> None:
        """At least ``need`` (<= BUFFER) bytes buffered."""
        if self._end - self._start >= need:
            return
        if self._start:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        sock = self.sock
        while self._end < need:
            sock.settimeout(_left(deadline))
            k = sock.recv_into(self._view[self._end :])
            if k == 0:
                raise Unavailable("the peer closed the connection")
            self._end += k

    def recv_exact(self, out: memoryview, *, deadline: float) -> None:
        n = len(out)
        have = min(self._end - self._start, n)
        if have:
            out[:have] = self._view[self._start : self._start + have]
            self._start += have
        got = have
        while got < n:
            self.sock.settimeout(_left(deadline))
            k = self.sock.recv_into(out[got:], n - got)
            if k == 0:
                raise Unavailable("the peer closed the connection mid-frame")
            got += k

    def recv_header(self, *, deadline: float) -> object:
        self._fill(4, deadline)
        (n,) = _LEN.unpack_from(self._buf, self._start)
        if n > MAX_HEADER:
            raise BadRequest(f"a frame header of {n} B is over the {MAX_HEADER} B limit: not a kvpool peer?")
        self._start += 4
        if n <= self.BUFFER:
            self._fill(n, deadline)
            body = self._view[self._start : self._start + n]
            self._start += n
        else:
            body = bytearray(n)
            self.recv_exact(memoryview(body), deadline=deadline)
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise BadRequest(f"a malformed frame header ({type(e).__name__}): not a kvpool peer?") from None

    def recv_payloads(self, lens: Sequence[int], outs: Sequence[np.ndarray | None] | None = None, *,
                      deadline: float) -> list[np.ndarray]:
        """The payloads a header announced, each into ``outs[i]`` when given (and large enough),
        else into a new array."""
        got = []
        for i, n in enumerate(lens):
            if not isinstance(n, int) or not 0 <= n <= MAX_PAYLOAD:
                raise BadRequest(f"a payload length of {n!r} B: not a kvpool peer?")
            dst = outs[i] if outs is not None and i < len(outs) and outs[i] is not None else None
            buf = dst[:n] if dst is not None and dst.shape[0] >= n else np.empty(n, dtype=np.uint8)
            self.recv_exact(memoryview(buf).cast("B"), deadline=deadline)
            got.append(buf)
        return got


def read_request(header: object, allowed: frozenset[str], max_payload: int):
    """``(message, timeout_s, lens)`` of a request header, every field checked (a BadRequest
    names what is wrong); None for a header that is not a kvpool request at all (hang up)."""
    if not (isinstance(header, list) and len(header) == 5 and isinstance(header[0], str)):
        return None
    name, version, fields, timeout_s, lens = header
    if not isinstance(lens, list) or len(lens) > messages.MAX_KEYS or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= max_payload for n in lens):
        return None  # payloads no page holds: hang up before reading them
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool):
        raise BadRequest("a request's timeout_s must be a number of seconds")
    cls = messages.OPS.get(name) if name in allowed else None
    if cls is None:
        raise BadRequest(f"unknown operation {name[:64]!r} here: is the caller's kvpool the shard's release?")
    if bool(lens) != cls.PAYLOADS:
        raise BadRequest(f"{name} {'takes' if cls.PAYLOADS else 'takes no'} payloads")
    return cls.decode(version, fields), min(max(float(timeout_s), 0.01), 120.0), lens


# ---------------------------------------------------------------- typed errors across the wire
def _error_classes() -> dict[str, type[KvPoolError]]:
    out, todo = {}, [KvPoolError]
    while todo:
        cls = todo.pop()
        out[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return out


def encode_error(e: KvPoolError) -> dict:
    fields = {k: v for k, v in e.__dict__.items() if isinstance(v, (str, int, float, bool, type(None)))}
    return {"type": type(e).__name__, "status": e.status, "fields": fields}


def decode_error(d: object) -> KvPoolError:
    """The typed error a peer raised; an unknown type keeps its status and message."""
    if not isinstance(d, dict):
        return Unavailable(f"the peer answered a malformed error {d!r}")
    fields = d.get("fields") if isinstance(d.get("fields"), dict) else {}
    cls = _error_classes().get(d.get("type"))
    if cls is None:
        err = KvPoolError(str(fields.get("message", d)))
        err.status = int(d.get("status", 500))
        return err
    err = cls.__new__(cls)
    Exception.__init__(err, fields.get("message", ""))
    err.__dict__.update(fields)
    return err
