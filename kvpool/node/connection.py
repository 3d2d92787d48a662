"""The connection of an engine process to its node's shard: finding it (its node file in the run
dir, kvpool.node.paths), mapping its slab and page table (kvpool.node.attach), greeting it, and
calls on its Unix socket, each within ``timeout_s`` (with the connection's staging file for small
chunks, kvpool.node.staging). A shard that does not answer is tried again at most every
``retry_s``; it restarting (a new node file, table or slab) is noticed within ``RECHECK_S``.
:class:`kvpool.node.client.NodeClient` is the pool's surface on top of it.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from kvpool import auth
from kvpool.errors import BadRequest, KvPoolError, Unauthorized, Unavailable
from kvpool.node import messages as m
from kvpool.node import wire
from kvpool.node.attach import Attached as _Attached
from kvpool.node.attach import node_stat as _stat
from kvpool.node.paths import node_files, run_dir
from kvpool.node.staging import Stage
from kvpool.node.touches import Touches
from kvpool.node.trust import UntrustedRunDir, check_file, check_peer, check_run_dir

log = logging.getLogger("kvpool.node")
SHARD_ENV = "KVPOOL_SHARD"
RECHECK_S = 1.0  # how often reads look whether the shard behind the mapped table changed
STAGE_RETRY_S = 30.0  # a connection the shard gave no staging file asks again after this long


class NodeConnection:
    def __init__(self, pool: str = "default", shard: str | None = None, directory: str | None = None,
                 timeout_s: float = 2.0, retry_s: float = 1.0) -> None:
        self.pool = pool
        self.shard = shard or os.environ.get(SHARD_ENV) or None
        self.directory = run_dir(directory)
        check_run_dir(self.directory)  # a run dir others can write in is refused at start, with the fix
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.counts: Counter[str] = Counter()
        self._vouched: set[tuple[str, str]] = set()  # (credential, shard incarnation) the shard accepted
        self._proven: set[tuple[str, str]] = set()  # (credential, shard incarnation) the shard proved it holds
        self.untrusted: str | None = None  # why the latest file or process found in the run dir was not used
        self.last_credential: str | None = None  # the latest the shard accepted (what reports go with)
        self._stage_warned = False
        self.touches = Touches(self)  # same-node hits, told to the shard in the background
        self._lock = threading.Lock()
        self._idle: list[wire.Channel] = []
        self._at: _Attached | None = None
        self._next_try = 0.0
        self._connect()  # best effort: a pool that is down now is a miss now, found later

    # ---------------------------------------------------------------- finding the node's shard
    def node_files(self) -> list[str]:
        """The node files this client looks for its shard in (kvpool.node.paths)."""
        return node_files(self.directory, self.pool, self.shard)

    def _connect(self) -> _Attached | None:
        """Finds, maps and greets the node's shard; None when there is none now (tried again after
        ``retry_s``)."""
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.retry_s
        live = []
        for path in self.node_files():
            try:
                check_file(path, "the node file")
                with open(path) as f:
                    info = json.load(f)
                if info.get("wire") != m.WIRE_VERSION:
                    self.counts["wire_mismatch"] += 1
                    log.warning("kvpool: the shard of %s speaks kvpool wire version %r and this engine %d: not used "
                                "(run the same kvpool release in the engines and the shards)", path, info.get("wire"),
                                m.WIRE_VERSION)
                    continue
                sock = self._dial(info["socket"], time.monotonic() + min(self.timeout_s, 0.5))
                live.append((path, info, sock))
            except UntrustedRunDir as e:
                self._distrust(e)
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
        except UntrustedRunDir as e:
            sock.close()
            self._distrust(e)
            return None
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

    def _distrust(self, e: UntrustedRunDir) -> None:
        """A file or process in the run dir that is not this user's: not used, counted, logged once."""
        self.counts["untrusted"] += 1
        if self.untrusted != e.message:
            log.warning("kvpool: %s", e.message)
        self.untrusted = e.message

    def _dial(self, path: str, deadline: float) -> wire.Channel:
        """A connection to the shard's socket: this user's socket file, and a process of this user
        behind it (kvpool.node.trust), else UntrustedRunDir."""
        check_file(path, "the shard's socket", "socket")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            s.connect(path)
            check_peer(s, path)
            return wire.Channel(s)
        except (OSError, UntrustedRunDir):
            s.close()
            raise

    def _prove(self, sock: wire.Channel, at: _Attached, credential: str, deadline: float) -> None:
        """Before ``credential`` first goes to this incarnation of the shard: the shard proves it
        holds the pool secret that issued it (kvpool.auth.shard_proof over a fresh nonce), else 401
        and the credential is never sent. Bare tenant ids (an open pool) have nothing to hide."""
        seen = (credential, at.info.get("incarnation"))
        if seen in self._proven or not auth.is_credential(credential):
            return
        role, tenant, _, _ = auth.parse(credential)
        nonce = os.urandom(16)
        ok, r, _ = sock.request(m.Prove(role, tenant, nonce), deadline=deadline, timeout_s=self.timeout_s)
        if not ok:
            raise wire.decode_error(r)
        proof = r.get("proof") if isinstance(r, dict) else None
        if not isinstance(proof, str) or not hmac.compare_digest(proof, auth.shard_proof(credential, nonce)):
            self.counts["unproven"] += 1
            why = ("it runs an open pool (no pool secret): give it tenant ids, not credentials" if proof == "" else
                   "the credential was issued from another pool secret than the shard's, or the process is not "
                   "the pool's shard")
            raise Unauthorized(f"the node's shard ({at.info.get('socket')}) did not prove it holds the pool secret "
                               f"that issued {tenant!r}'s credential, so the credential was not sent: {why}. Issue "
                               f"the engine's credentials from the running pool's secret (`kvpool connect`)")
        if len(self._proven) >= 4096:
            self._proven.clear()
        self._proven.add(seen)

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
    def call(self, msg: m.Message, payloads: Sequence[np.ndarray] = (),
             outs: Sequence[np.ndarray | None] | None = None, prepare=None, after=None):
        """(result, payloads) of one call, within ``timeout_s``. A failure of the shard or the socket
        raises Unavailable; the shard's typed errors keep their type. ``prepare(channel, msg,
        deadline)`` runs on the channel the call goes out on and returns the message to send;
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
            credential = getattr(msg, "credential", None)
            if credential is not None:
                self._prove(sock, at, credential, deadline)
            if prepare is not None:
                msg = prepare(sock, msg, deadline)
            ok, result, got = sock.request(msg, payloads, outs, deadline=deadline, timeout_s=self.timeout_s)
            if ok and after is not None:
                got = after(sock, result, got)
        except (OSError, KvPoolError) as e:
            if sock is not None:
                _close(sock)
            if isinstance(e, UntrustedRunDir):
                self._distrust(e)
                raise Unavailable(f"the node's shard was not used: {e.message}") from None
            if isinstance(e, OSError):
                self._next_try = time.monotonic() + self.retry_s
                with self._lock:
                    if self._at is at:
                        self._at = None  # greeted again (and re-mapped) at the next try
                raise Unavailable(f"the node's shard did not answer {msg.OP} ({type(e).__name__})") from None
            raise
        with self._lock:
            self._idle.append(sock)
        if not ok:
            raise wire.decode_error(result)
        if credential is not None:  # every operation that takes one verifies it first (cluster/service.py)
            if len(self._vouched) >= 4096:
                self._vouched.clear()
            self._vouched.add((credential, at.info.get("incarnation")))
            self.last_credential = credential
        return result, got

    def shard_stats(self, pool: bool = False) -> dict:
        """This node's shard's stats (kvpool.cluster.shard_core), asked on its socket; ``pool``:
        the whole pool's, as `kvpool stats` shows them (cluster.pool_stats)."""
        return self.call(m.Stats(pool))[0]

    def _stage(self, sock: wire.Channel, deadline: float, credential: str) -> Stage | None:
        """The channel's staging file, asked for once per connection with the caller's credential;
        None when the shard has no room for it (its run dir is full, 507, or the tenant holds its
        cap of them, 429): logged once with the shard's fix, counted ``stage_refused``, and the
        call goes without one (asked again after ``STAGE_RETRY_S``)."""
        stage = getattr(sock, "stage", None)
        if stage is None and time.monotonic() >= getattr(sock, "unstaged_until", 0.0):
            ok, r, _ = sock.request(m.Stage(credential), deadline=deadline, timeout_s=self.timeout_s)
            if not ok:
                e = wire.decode_error(r)
                if e.status not in (429, 507):
                    raise e
                self._stage_refused(e)
                sock.unstaged_until = time.monotonic() + STAGE_RETRY_S
                return None
            stage = sock.stage = Stage.attach(r["path"], r["nbytes"])
        return stage

    def _stage_refused(self, e: KvPoolError) -> None:
        self.counts["stage_refused"] += 1
        if not self._stage_warned:
            self._stage_warned = True
            log.warning("kvpool: the node's shard gives this engine no staging file: %s. Its small writes take one "
                        "call more and its reads of other nodes' chunks come over the socket until it has room "
                        "(counted: stage_refused; logged once)", e)

    def _staged(self, arrays: Sequence[np.ndarray]):
        """``prepare`` for ``put_staged``: the channel's staging file filled with ``arrays``;
        their offsets go with the call. Without one, the write is a ``reserve`` (then the copy
        into the slab and ``commit``)."""
        def prepare(sock: wire.Channel, msg: m.PutStaged, deadline: float) -> m.PutStaged | m.Reserve:
            stage = self._stage(sock, deadline, msg.credential)
            if stage is None:
                return m.Reserve(msg.credential, msg.keys, msg.shared, msg.first_position, msg.request_id, msg.sizes)
            offsets = stage.layout(arrays)
            assert offsets is not None, "the caller checked that the chunks fit STAGE_BYTES"
            stage.fill(arrays, offsets)
            return dataclasses.replace(msg, offsets=offsets)
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

    @property
    def shards(self) -> dict:
        """This node's shard (its page size), or nothing while none answers."""
        at = self._attached()
        return {} if at is None else {at.info["shard"]: {"page_bytes": at.info["page_bytes"]}}

    @property
    def secured(self) -> bool:
        at = self._at
        return bool(at is not None and at.info.get("secured"))

    def close(self) -> None:
        self.touches.close()
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
