"""NodeClient: an engine's side of the pool, without Ray. It talks only to its node's shard.

- **Same-node hits cost no call.** The shard lists its DRAM chunks in a shared-memory page table
  (kvpool.node.table); a read finds a chunk there, copies it out of the shard's slab (mapped here)
  and validates the copy (the table slot's sequence number, then the checksum). A chunk evicted
  mid-copy is a miss, never wrong bytes.
- **Writes** reserve pages on the socket, copy into the slab (hashing in the same pass) and commit
  (the shard publishes to the index and charges the quota there). When this node cannot take them,
  the bytes go over the socket and the shard places them on the rest of the pool.
- **Everything else** (a pool-wide lookup, chunks held on other nodes, leases of a request in
  flight) is one call on the socket; the shard does it as a client of the pool.
- **A dead pool is a miss.** A shard, Ray head or Redis that is down or restarting never stops,
  hangs or slows the engine beyond one call's deadline: reads are misses, writes store nothing,
  and a failed connection is retried at most every ``retry_s``. A connector checks at start that
  the shard answers (kvpool.node.probe; ``"degraded": true`` starts without it).

The surface is PoolClient's (``lookup``, ``begin``/``end``, ``put``, ``get``, ``pin``), so
ClusterPool runs over either. Found through ``kvpool-<pool>-<shard>.node`` in ``$KVPOOL_RUN_DIR``
(/dev/shm by default); with several shards of one pool on a machine, name the shard.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.auth import claimed_tenant, scope_tag, scoped
from kvpool.buffers import as_byte_array
from kvpool.checksum import copy_with_checksum
from kvpool.errors import BadRequest, ChunkTooLarge, KvPoolError, Unavailable
from kvpool.index.base import MISS, PrefixHit
from kvpool.keys import ChunkKey, is_shared
from kvpool.node import wire
from kvpool.node.attach import Attached as _Attached
from kvpool.node.attach import node_stat as _stat
from kvpool.node.checks import RAISED, check_put, expired
from kvpool.node.staging import STAGE_BYTES, Stage

log = logging.getLogger("kvpool.node")
RUN_DIR_ENV = "KVPOOL_RUN_DIR"
SHARD_ENV = "KVPOOL_SHARD"
RECHECK_S = 1.0  # how often reads look whether the shard behind the mapped table changed


@dataclass
class NodeRequest:
    """A request in flight: the request id each shard gave its leases (the node's shard began them)."""

    credential: str
    shard_requests: dict[str, int]
    hit_chunks: int

    @property
    def tenant(self) -> str:
        return claimed_tenant(self.credential)


class NodeClient:
    def __init__(self, pool: str = "default", shard: str | None = None, directory: str | None = None,
                 timeout_s: float = 2.0, retry_s: float = 1.0) -> None:
        self.pool = pool
        self.shard = shard or os.environ.get(SHARD_ENV) or None
        self.directory = directory or os.environ.get(RUN_DIR_ENV) or "/dev/shm"
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._idle: list[wire.Channel] = []
        self._at: _Attached | None = None
        self._next_try = 0.0
        self._connect()  # best effort: a pool that is down now is a miss now, found later

    # ---------------------------------------------------------------- finding the node's shard
    def _node_files(self) -> list[str]:
        if self.shard:
            return [os.path.join(self.directory, f"kvpool-{self.pool}-{self.shard}.node")]
        return sorted(glob.glob(os.path.join(glob.escape(self.directory), f"kvpool-{glob.escape(self.pool)}-*.node")))

    def _connect(self) -> _Attached | None:
        """Finds, maps and greets the node's shard; None when there is none now (tried again after
        ``retry_s``)."""
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.retry_s
        live = []
        for path in self._node_files():
            try:
                with open(path) as f:
                    info = json.load(f)
                sock = self._dial(info["socket"], time.monotonic() + min(self.timeout_s, 0.5))
                live.append((path, info, sock))
            except (OSError, ValueError, KeyError, KvPoolError):
                continue
        if len(live) > 1:
            for _, _, s in live:
                s.close()
            raise BadRequest(f"{len(live)} shards of pool {self.pool!r} answer on this machine: name this node's "
                             f"with shard= (or ${SHARD_ENV}); found {[i['shard'] for _, i, _ in live]}")
        if not live:
            self.counts["connect_failed"] += 1
            return None
        path, info, sock = live[0]
        try:
            at = _Attached(info, path)
        except (KvPoolError, OSError, KeyError, ValueError) as e:  # a stale or foreign node file: not a shard
            sock.close()
            log.warning("kvpool: cannot map the node's shard (%s); reads are misses", e)
            return None
        with self._lock:
            old, self._at = self._at, at
            idle, self._idle = self._idle, [sock]
        for s in idle:
            _close(s)
        if old is not None:
            old.close()
        self._next_try = 0.0
        return at

    def _dial(self, path: str, deadline: float) -> wire.Channel:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            s.connect(path)
            return wire.Channel(s)
        except OSError:
            s.close()
            raise

    def _attached(self) -> _Attached | None:
        """The mapped shard, re-mapped when its node file changed (the shard restarted: a new
        table and slab); None when there is none."""
        at = self._at
        if at is None:
            return self._connect()
        now = time.monotonic()
        if now - at.checked >= RECHECK_S:
            at.checked = now
            if _stat(at.node_path) != at.stat or at.table.epoch != at.epoch or not at.alive():
                self._next_try = 0.0
                return self._connect() or self._detach(at)
        return at

    def _detach(self, at: _Attached) -> None:
        with self._lock:
            if self._at is at:
                self._at = None
        return None

    # ---------------------------------------------------------------- calls on the socket
    def _call(self, op: str, args: dict, payloads: Sequence[np.ndarray] = (),
              outs: Sequence[np.ndarray | None] | None = None, prepare=None, after=None):
        """(result, payloads) of one call, within ``timeout_s``. A failure of the shard or the socket
        raises Unavailable; the shard's typed errors keep their type. ``prepare(channel, args,
        deadline)`` runs on the channel the call goes out on and returns its arguments;
        ``after(channel, result, payloads)`` runs on a good reply before the channel is free again
        and returns the payloads."""
        at = self._attached()
        if at is None:
            raise Unavailable(f"no shard of pool {self.pool!r} answers on this node")
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        try:
            if sock is None:
                sock = self._dial(at.info["socket"], deadline)
            if prepare is not None:
                args = prepare(sock, args, deadline)
            ok, result, got = self._exchange(sock, op, args, payloads, outs, deadline)
            if ok and after is not None:
                got = after(sock, result, got)
        except (OSError, KvPoolError) as e:
            if sock is not None:
                _close(sock)
            if isinstance(e, OSError):
                self._next_try = time.monotonic() + self.retry_s
                with self._lock:
                    if self._at is at:
                        self._at = None  # greeted again (and re-mapped) at the next try
                raise Unavailable(f"the node's shard did not answer {op} ({type(e).__name__})") from None
            raise
        with self._lock:
            self._idle.append(sock)
        if not ok:
            raise wire.decode_error(result)
        return result, got

    def _exchange(self, sock: wire.Channel, op: str, args: dict, payloads, outs, deadline: float):
        args = dict(args, timeout_s=self.timeout_s)
        if payloads:
            args["lens"] = [int(p.nbytes) for p in payloads]
        sock.send([op, args], payloads, deadline=deadline)
        reply = sock.recv_header(deadline=deadline)
        if not (isinstance(reply, list) and len(reply) == 3):
            raise Unavailable(f"the shard answered {op} with a malformed reply")
        ok, result, lens = reply
        return ok, result, sock.recv_payloads(lens or [], outs, deadline=deadline)

    def _stage(self, sock: wire.Channel, deadline: float) -> Stage:
        """The channel's staging file, asked for once per connection."""
        stage = getattr(sock, "stage", None)
        if stage is None:
            ok, r, _ = self._exchange(sock, "stage", {}, (), None, deadline)
            if not ok:
                raise wire.decode_error(r)
            stage = sock.stage = Stage.attach(r["path"], r["nbytes"])
        return stage

    def _staged(self, arrays: Sequence[np.ndarray]):
        """``prepare`` for ``put_staged``: the channel's staging file filled with ``arrays``;
        their offsets go with the call."""
        def prepare(sock: wire.Channel, args: dict, deadline: float) -> dict:
            stage = self._stage(sock, deadline)
            offsets = stage.layout(arrays)
            assert offsets is not None, "the caller checked that the chunks fit STAGE_BYTES"
            stage.fill(arrays, offsets)
            return dict(args, offsets=offsets)
        return prepare

    def _unstage(self, dsts: Sequence[np.ndarray] | None):
        """``after`` for ``get``: chunks the shard left in the channel's staging file, copied out
        (into ``dsts`` when given) before another call can reuse it."""
        def after(sock: wire.Channel, result: dict, got: list) -> list:
            places = result.get("staged")
            if not places:
                return got
            stage, out = sock.stage, []
            for i, (off, n) in enumerate(places):
                src = stage.region(off, n)
                dst = dsts[i][:n] if dsts is not None and i < len(dsts) and dsts[i].shape[0] >= n else np.empty(
                    n, dtype=np.uint8)
                np.copyto(dst, src)
                out.append(dst)
            return out
        return after

    # ---------------------------------------------------------------- the PoolClient surface
    @property
    def shards(self) -> dict:
        """This node's shard (its page size), or nothing while none answers."""
        at = self._attached()
        return {} if at is None else {at.info["shard"]: {"page_bytes": at.info["page_bytes"]}}

    @property
    def secured(self) -> bool:
        at = self._at
        return bool(at is not None and at.info.get("secured"))

    @staticmethod
    def addresses(credential: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Where the pool keeps a caller's chunks (kvpool.auth: scopes), as PoolClient computes them."""
        return scoped(keys, scope_tag(None if is_shared(keys) else claimed_tenant(credential)))

    def _local_run(self, at: _Attached | None, credential: str, keys: Sequence[ChunkKey]) -> int:
        if at is None:
            return 0
        n = 0
        for a in self.addresses(credential, keys):
            if at.table.find(bytes(a)) is None:
                break
            n += 1
        return n

    def lookup(self, credential: str, keys: Sequence[ChunkKey]) -> PrefixHit:
        """The leading run of ``keys`` held in the pool: this node's table first (no call when it
        holds them all), then the pool's index through the shard."""
        at = self._attached()
        local = self._local_run(at, credential, keys)
        sid = at.info["shard"] if at is not None else ""
        if local == len(keys):
            return PrefixHit(local, (sid,) * local)
        try:
            r, _ = self._call("lookup", {"credential": credential, "keys": [bytes(k) for k in keys],
                                         "shared": is_shared(keys)})
        except KvPoolError as e:
            if e.status in RAISED:
                raise
            return PrefixHit(local, (sid,) * local, error=str(e)) if local else MISS
        count = int(r["count"])
        if count <= local:
            return PrefixHit(local, (sid,) * local)
        return PrefixHit(count, (sid,) * local + tuple(r["shards"][local:count]))

    def begin(self, credential: str, keys: Sequence[ChunkKey], priority: str | None = None,
              hit: PrefixHit | None = None) -> NodeRequest:
        """Leases the leading run of a request's cached chunks on their shards until ``end``. Best
        effort: a shard that does not answer leaves them unleased (a later miss at worst)."""
        try:
            r, _ = self._call("begin", {"credential": credential, "keys": [bytes(k) for k in keys],
                                        "priority": priority, "shared": is_shared(keys)})
        except KvPoolError as e:
            if e.status in RAISED:
                raise
            self.counts["begin_failed"] += 1
            return NodeRequest(credential, {}, 0)
        return NodeRequest(credential, {str(k): int(v) for k, v in r["requests"].items()}, int(r["count"]))

    def end(self, request: NodeRequest | None) -> None:
        if request is None or not request.shard_requests:
            return
        try:
            self._call("end", {"credential": request.credential, "requests": request.shard_requests})
        except KvPoolError:
            self.counts["end_failed"] += 1  # the leases expire on their own
        request.shard_requests = {}

    def pin(self, credential: str, keys: Sequence[ChunkKey]) -> int:
        r, _ = self._call("pin", {"credential": credential, "keys": [bytes(k) for k in keys],
                                  "shared": is_shared(keys)})
        return int(r)

    def report(self, name: str, figures: dict) -> None:
        """Sends a connector's figures to the pool (fire and forget: an engine's scheduler calls
        this, and must not wait on a slow shard)."""
        def send() -> None:
            try:
                self._call("report", {"name": name, "figures": figures})
            except KvPoolError:
                pass

        threading.Thread(target=send, daemon=True, name="kvpool-report").start()

    # ---------------------------------------------------------------- writes
    def put(self, credential: str, keys: Sequence[ChunkKey], payloads: Sequence[object], *, shared: bool = False,
            first_position: int = 0, request: NodeRequest | None = None) -> int:
        """Stores the chunks (this node's slab when it has room, else the rest of the pool); how
        many were stored. Bad input, a refused credential and the tenant's 429 raise; a shard that
        is down or slow stores nothing (counted: ``put_failed``)."""
        arrays = [as_byte_array(p) for p in payloads]
        raw = check_put(keys, arrays, shared)
        at = self._attached()
        if at is not None:
            big = [a.nbytes for a in arrays if a.nbytes > at.info["page_bytes"]]
            if big:
                raise ChunkTooLarge(f"a payload of {big[0]} B does not fit the pool's pages of "
                                    f"{at.info['page_bytes']} B: split it, or start the pool with a larger page")
        if not raw:
            return 0
        rid = None if request is None or at is None else request.shard_requests.get(at.info["shard"])
        sizes = [a.nbytes for a in arrays]
        args = {"credential": credential, "keys": raw, "sizes": sizes, "shared": shared,
                "first_position": first_position, "request_id": rid}
        try:
            if sum(-(-n // 64) * 64 for n in sizes) <= STAGE_BYTES // 2:  # small: one call (kvpool.node.staging)
                r, _ = self._call("put_staged", args, prepare=self._staged(arrays))
            else:
                r, _ = self._call("reserve", args)
            if isinstance(r, int):
                self.counts["put_staged"] += 1
                return r
            if r.get("full"):
                stored, _ = self._call("put", {"credential": credential, "keys": raw, "shared": shared,
                                               "first_position": first_position}, arrays)
                self.counts["put_forwarded"] += 1
                return int(stored)
            buf = self._at.slab.buf if self._at is not None else None
            if buf is None:
                raise Unavailable("the node's shard went away between reserve and copy")
            by_key = dict(zip(raw, arrays))
            keys_done, sums = [], []
            for key, offset, nbytes in r["places"]:
                sums.append(copy_with_checksum(buf[offset : offset + nbytes], by_key[key]))
                keys_done.append(key)
            stored, _ = self._call("commit", {"credential": credential, "hold": r["hold"], "keys": keys_done,
                                              "checksums": sums})
            self.counts["put_shm"] += 1
            return int(stored)
        except KvPoolError as e:
            if e.status in RAISED and not expired(e):
                raise
            self.counts["put_failed"] += 1
            if self.counts["put_failed"] & (self.counts["put_failed"] - 1) == 0:  # the 1st, 2nd, 4th, 8th...
                log.warning("kvpool: put failed (%s); the chunks are not stored (%d failed puts so far)",
                            e, self.counts["put_failed"])
            return 0

    # ---------------------------------------------------------------- reads
    reads_in_place = True  # ClusterPool.load_views reads this node's chunks one at a time

    def get(self, credential: str, keys: Sequence[ChunkKey], hit: PrefixHit | None = None,
            outs: Sequence[object] | None = None, local_only: bool = False) -> list[np.ndarray]:
        """The leading run of chunks, each verified: this node's slab first (no call), the rest
        through the shard (not with ``local_only``). Never raises on a failure of the pool: the run
        just ends there."""
        at = self._attached()
        out: list[np.ndarray] = []
        dsts = None if outs is None else [as_byte_array(o, writable=True) for o in outs]
        if at is not None:
            table, buf = at.table, at.slab.buf
            for i, a in enumerate(self.addresses(credential, keys)):
                got = table.read(bytes(a), buf, None if dsts is None else dsts[i])
                if got is None:
                    break
                out.append(got)
            if out:
                self.counts["get_shm"] += 1
        n = len(out)
        if n == len(keys) or local_only or (hit is not None and hit.count <= n):
            return out
        try:
            rest = None if dsts is None else dsts[n:]
            args = {"credential": credential, "keys": [bytes(k) for k in keys[n:]], "shared": is_shared(keys)}
            if hit is not None and hit.count > n:
                args["shards"] = list(hit.shards[n : hit.count])  # where the caller's lookup found them
            r, got = self._call("get", args, outs=rest, prepare=lambda ch, a, d: (self._stage(ch, d), a)[1],
                                after=self._unstage(rest))
            count = int(r["count"])
            out.extend(got[:count])
            if count:
                self.counts["get_remote"] += 1
        except KvPoolError as e:
            if e.status in (401, 403):
                raise
            self.counts["get_failed"] += 1
        return out

    def close(self) -> None:
        with self._lock:
            at, self._at = self._at, None
            idle, self._idle = self._idle, []
        for s in idle:
            _close(s)
        if at is not None:
            at.close()


def _close(sock: wire.Channel) -> None:
    stage = getattr(sock, "stage", None)
    if stage is not None:
        stage.close()
    sock.close()
