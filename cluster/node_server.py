"""The shard's two doors: the node's Unix socket (its engines) and the peer port (other shards).

Both only decode requests (kvpool.node.wire, kvpool.node.messages) and dispatch them to the
shard's one service (cluster/service.py); the engines' operations are answered on the socket
only, the ``peer_*`` ones on the peer port only. Same-node hits never reach here: the shard lists
its DRAM chunks in a shared-memory page table (kvpool.node.table) that engines read themselves.
``kvpool-<pool>-<shard>.node`` (JSON, beside the socket) says where the socket, the slab, the
table and the peer port are: what an engine reads to find its node's shard.

Each connection is served by its own thread; every reply is sent within the caller's deadline or
not at all (the caller has given up and closed the connection by then).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from kvpool.errors import KvPoolError
from kvpool.node import messages as m
from kvpool.node import wire
from kvpool.node.paths import node_paths
from kvpool.node.staging import SUFFIX as STAGE_SUFFIX
from kvpool.node.table import PageTable

log = logging.getLogger("kvpool.node")
IDLE_S = 3600 * 24  # a connection may wait this long between two requests
DRAIN_S = 2.0  # at most this long reading (and dropping) the payloads of a refused request
_SCRATCH = bytearray(1 << 16)  # where they go: shared, never read back


def sweep_node_files(directory: str, pool: str, shard_id: str) -> None:
    """Removes the page tables and staging files of this pool's shard processes that are gone."""
    from kvpool.slab import sweep_orphans

    for suffix in (".kvtable", STAGE_SUFFIX):
        for path in sweep_orphans(directory, f"kvpool-{pool}-", suffix=suffix):
            log.warning("shard %s: removed %s of a shard that is gone", shard_id, path)


class NodeServer:
    """Serves ``service`` (a cluster.service.ShardService) on this node's socket and peer port."""

    def __init__(self, service, directory: str, incarnation: str, stats: Callable[[], dict],
                 host: str = "127.0.0.1", pool_stats: Callable[[], dict] | None = None) -> None:
        self.service = service
        self.directory = directory
        self._stats = stats
        self._pool_stats = pool_stats  # the whole pool's, for `kvpool stats`
        s = service
        self.paths = node_paths(directory, s.pool, s.shard_id)
        slab = s.store.slab("dram")
        self.page_bytes = slab.page_bytes
        self.table = PageTable.create(self.paths["table"], slab.page_bytes, slab.num_pages)
        s.store.attach_table(self.table)
        # NOTE: held while this process lives: an engine that can take a shared lock on the table
        # knows its shard died (SIGKILL leaves the files as they were) and lets go of its memory.
        self._alive = os.open(self.paths["table"], os.O_RDONLY)
        fcntl.flock(self._alive, fcntl.LOCK_EX)
        self._stop = threading.Event()
        self.served = 0
        self.refused_peers = 0  # peer-port connections that did not open with the pool's credential
        self.op_time: dict[str, float] = {}  # seconds spent in each operation
        path = self.paths["socket"]
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(64)
        self.peer_sock = socket.create_server((host, 0), backlog=64)
        self.peer_address = f"{host}:{self.peer_sock.getsockname()[1]}"
        self.info = {"wire": m.WIRE_VERSION, "pool": s.pool, "shard": s.shard_id, "socket": path,
                     "table": self.paths["table"], "slab": slab.path, "page_bytes": slab.page_bytes,
                     "dram_pages": slab.num_pages, "incarnation": incarnation, "pid": os.getpid(),
                     "secured": s.auth.secured, "peer": self.peer_address}
        tmp = self.paths["node"] + f".{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(self.info, f)
        os.replace(tmp, self.paths["node"])
        for listener, allowed in ((self.sock, m.ENGINE_OPS), (self.peer_sock, m.PEER_OPS)):
            threading.Thread(target=self._serve, args=(listener, allowed), daemon=True, name="kvpool-node").start()

    def close(self) -> None:
        self._stop.set()
        for p in (self.paths["node"], self.paths["socket"]):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        for listener in (self.sock, self.peer_sock):
            try:
                listener.close()
            except OSError:
                pass

    def stats(self) -> dict:
        links = self.service.links
        return {**self._stats(), "node_op_s": dict(self.op_time), "node_served": self.served,
                "peer_fetched": links.fetched, "peer_failed": links.failed,
                "peer_refused_connections": self.refused_peers}

    # ---------------------------------------------------------------- connections
    def _serve(self, listener: socket.socket, allowed: frozenset) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if listener is self.peer_sock:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._connection, args=(conn, allowed), daemon=True,
                             name="kvpool-node-conn").start()

    def _connection(self, sock: socket.socket, allowed: frozenset) -> None:
        state: dict = {}  # this connection's: its staging file
        try:
            with sock:
                ch = wire.Channel(sock)
                if allowed is m.PEER_OPS and not self._peer_opened(ch):
                    return  # not one of the pool's shards: hang up before reading a header
                self._requests(ch, allowed, state)
        finally:
            self.service.writes.unstage(state)  # its staging file, and its tenant's charge for it

    def _peer_opened(self, ch: wire.Channel) -> bool:
        """The peer port's opening (kvpool.node.wire.answer_peer), within a second: only a holder of
        the pool's credential, proven over a fresh nonce of this port's, gets a header read."""
        try:
            if wire.answer_peer(ch, self.service.links.credential, deadline=time.monotonic() + 1.0):
                return True
        except (OSError, KvPoolError):
            pass
        self.refused_peers += 1
        log.warning("node: a connection to the peer port without the pool's opening: closed unread")
        return False

    def _requests(self, ch: wire.Channel, allowed: frozenset, state: dict) -> None:
        while not self._stop.is_set():
            try:
                header = ch.recv_header(deadline=time.monotonic() + IDLE_S)
            except (OSError, KvPoolError):
                return
            deadline, payloads, after = time.monotonic() + 5.0, [], None
            try:
                req = wire.read_request(header, allowed, self.page_bytes)
                if req is None:
                    return  # not a kvpool caller: hang up
                msg, timeout_s, lens = req
                deadline = time.monotonic() + timeout_s
                if lens:  # who sends bytes is checked before a byte of them is kept
                    try:
                        self.service.may_send(msg)
                    except KvPoolError as e:
                        if not self._refuse(ch, e, sum(lens), min(deadline, time.monotonic() + DRAIN_S)):
                            return  # not drained in time: the stream is out of step, hang up
                        continue
                got = ch.recv_payloads(lens, deadline=deadline) if lens else []
                # calls to other shards end in time for the answer to reach the caller
                self.service.answer_by.t = deadline - min(0.2 * timeout_s, 0.25)
                t0 = time.perf_counter()
                result = self._dispatch(msg, got, state)
                self.op_time[msg.OP] = self.op_time.get(msg.OP, 0.0) + time.perf_counter() - t0
                if isinstance(result, tuple):
                    result, payloads, after = result if len(result) == 3 else (*result, None)
                reply = [True, result, [int(p.nbytes) for p in payloads]]
            except KvPoolError as e:
                reply, payloads = [False, wire.encode_error(e), []], []
            except Exception as e:  # noqa: BLE001 - the caller gets a 500, the shard keeps serving
                log.exception("node: %s failed", header[0] if isinstance(header, list) and header else "?")
                reply, payloads = [False, wire.encode_error(KvPoolError(f"the shard failed: {type(e).__name__}")), []], []
            self.served += 1
            try:
                ch.send(reply, payloads, deadline=max(deadline, time.monotonic() + 1.0))
            except (OSError, KvPoolError):
                return
            finally:
                if after is not None:
                    after()  # e.g. a lease on the pages just sent

    @staticmethod
    def _refuse(ch: wire.Channel, e: KvPoolError, nbytes: int, deadline: float) -> bool:
        """Answers a refused request with payloads and reads its ``nbytes`` into one scratch buffer
        (nothing kept, nothing allocated per request; closing with them unread would reset the
        connection before the caller reads the answer); whether the stream is in step again."""
        scratch = memoryview(_SCRATCH)
        try:
            while nbytes > 0:
                n = min(nbytes, len(scratch))
                ch.recv_exact(scratch[:n], deadline=deadline)
                nbytes -= n
            ch.send([False, wire.encode_error(e), []], deadline=max(deadline, time.monotonic() + 1.0))
            return True
        except (OSError, KvPoolError):
            return False

    # ---------------------------------------------------------------- dispatch
    def _dispatch(self, msg: m.Message, payloads: list, conn: dict):
        s, w = self.service, self.service.writes
        match msg:
            case m.Hello():
                return dict(self.info)
            case m.Stats():
                return self._pool_stats() if msg.pool and self._pool_stats else self.stats()
            case m.Stage():
                return w.stage(msg, conn, self.directory, self.page_bytes)
            case m.Get():
                return self._get(msg, conn)
            case m.PutStaged():
                return w.put_staged(msg, conn.get("stage"))
            case m.Put() | m.PeerPut():
                return getattr(w, msg.OP)(msg, payloads)
            case m.Reserve() | m.Commit() | m.Abort():
                return getattr(w, msg.OP)(msg)
        return getattr(s, msg.OP)(msg)  # lookup, begin, end, pin, report and the peer_* reads

    def _get(self, msg: m.Get, conn: dict):
        """A get whose chunks from other shards land in the connection's staging file when it has
        one and they fit (the reply says where: ``staged``), else come back as payloads."""
        stage, cursor, staged = conn.get("stage"), [0], []

        def into(lens: list) -> list | None:  # staging regions for the next payloads, if they fit
            if stage is None:
                return None
            offsets = stage.layout_from(cursor[0], lens)
            if offsets is None:
                return None
            cursor[0] = offsets[-1] + lens[-1] if lens else cursor[0]
            staged.extend([o, n] for o, n in zip(offsets, lens))
            return [stage.buf[o: o + n] for o, n in zip(offsets, lens)]

        out = self.service.get(msg, into)
        if staged and len(staged) >= len(out):
            return {"count": len(out), "staged": staged[: len(out)]}, []
        return {"count": len(out)}, out
