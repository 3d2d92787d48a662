"""The node's front door: engines on this node talk to its shard through a Unix socket and shared
memory, never through Ray (kvpool.node.client is their side).

- Same-node hits cost no call at all: the shard lists its DRAM chunks in a shared-memory page
  table (kvpool.node.table) that engines read and validate themselves.
- A write is two calls on the socket (reserve, commit) around one copy into the slab; the shard
  publishes to the index at the commit, as before (bytes before index, quota charged there).
- Everything else (a pool-wide lookup, chunks on other nodes, leases of requests in flight on
  other shards, writes this node cannot take) the shard does for the engine, as a Ray client of
  the pool (a ``PoolClient`` living in the shard's process).
- ``kvpool-<pool>-<shard>.node`` (JSON, beside the socket) says where the socket, the slab and the
  table are: what an engine reads to find its node's shard.

Each connection is served by its own thread; every reply is sent within the engine's deadline or
not at all (the engine has given up and closed the connection by then).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from kvpool.cluster.messages import Reserve, Write
from kvpool.cluster.publisher import Publisher
from kvpool.errors import BadRequest, KvPoolError, PoolFull
from kvpool.keys import ChunkKey, SharedKey
from kvpool.node import wire
from kvpool.node.table import PageTable

log = logging.getLogger("kvpool.node")
RUN_DIR_ENV = "KVPOOL_RUN_DIR"


def run_dir() -> str | None:
    d = os.environ.get(RUN_DIR_ENV) or "/dev/shm"
    return d if os.path.isdir(d) else None


def node_paths(directory: str, pool: str, shard_id: str) -> dict[str, str]:
    base = os.path.join(directory, f"kvpool-{pool}-{shard_id}")
    return {"socket": base + ".sock", "table": base + ".kvtable", "node": base + ".node"}


class NodeServer:
    """Serves the engines of this node for ``shard`` (a ShardActor instance, in its own process)."""

    def __init__(self, shard, directory: str, namespace: str | None, index_url: str | None) -> None:
        self.shard = shard
        self.namespace = namespace
        self.index_url = index_url
        self.paths = node_paths(directory, shard.pool, shard.shard_id)
        slab = shard.store.slab("dram")
        self.table = PageTable.create(self.paths["table"], slab.page_bytes, slab.num_pages)
        shard.store.attach_table(self.table)
        self.publisher = Publisher(shard)
        self._client = None
        self._client_lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self.op_time: dict[str, float] = {}  # seconds spent in each operation's handler
        path = self.paths["socket"]
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(64)
        self.info = {"wire": wire.NODE_WIRE, "pool": shard.pool, "shard": shard.shard_id, "socket": path,
                     "table": self.paths["table"], "slab": slab.path, "page_bytes": slab.page_bytes,
                     "dram_pages": slab.num_pages, "incarnation": shard.incarnation, "pid": os.getpid(),
                     "secured": shard.auth.secured}
        tmp = self.paths["node"] + f".{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(self.info, f)
        os.replace(tmp, self.paths["node"])
        self._accept = threading.Thread(target=self._serve, daemon=True, name="kvpool-node")
        self._accept.start()

    def close(self) -> None:
        self._stop.set()
        self.publisher.flush(2.0)
        self.publisher.close()
        for p in (self.paths["node"], self.paths["socket"]):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass

    # ---------------------------------------------------------------- connections
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True, name="kvpool-node-conn").start()

    def _connection(self, sock: socket.socket) -> None:
        conn = wire.Channel(sock)
        with sock:
            while not self._stop.is_set():
                try:
                    header = conn.recv_header(deadline=time.monotonic() + 3600 * 24)
                except (OSError, KvPoolError):
                    return
                if not (isinstance(header, list) and len(header) == 2 and isinstance(header[0], str)
                        and isinstance(header[1], dict)):
                    return  # not a kvpool engine: hang up
                op, args = header
                deadline = time.monotonic() + min(max(float(args.pop("timeout_s", 5.0)), 0.01), 120.0)
                payloads = []
                try:
                    lens = args.pop("lens", None)
                    if lens:
                        args["payloads"] = conn.recv_payloads(lens, deadline=deadline)
                    handler = getattr(self, "op_" + op, None)
                    if handler is None:
                        raise BadRequest(f"unknown node operation {op!r}: is the engine's kvpool the shard's release?")
                    t0 = time.perf_counter()
                    result = handler(deadline=deadline, **args)
                    self.op_time[op] = self.op_time.get(op, 0.0) + time.perf_counter() - t0
                    if isinstance(result, tuple):
                        result, payloads = result
                    reply = [True, result, [int(p.nbytes) for p in payloads]]
                except KvPoolError as e:
                    reply, payloads = [False, wire.encode_error(e), []], []
                except TypeError as e:  # wrong arguments for the op
                    reply, payloads = [False, wire.encode_error(BadRequest(f"{op}: {e}")), []], []
                except Exception as e:  # noqa: BLE001 - the engine gets a 500, the shard keeps serving
                    log.exception("node: %s failed", op)
                    reply, payloads = [False, wire.encode_error(KvPoolError(f"{op} failed: {type(e).__name__}")), []], []
                self.served += 1
                try:
                    conn.send(reply, payloads, deadline=max(deadline, time.monotonic() + 1.0))
                except (OSError, KvPoolError):
                    return

    # ---------------------------------------------------------------- the pool beyond this shard
    def _pool(self):
        """A PoolClient of the whole pool, in this process (the shard is a Ray actor)."""
        with self._client_lock:
            if self._client is None:
                from kvpool.cluster.client import PoolClient

                self._client = PoolClient(pool=self.shard.pool, index_url=self.index_url, namespace=self.namespace,
                                          timeout_s=2.0)
            return self._client

    @staticmethod
    def _keys(raw, shared: bool = False) -> list[ChunkKey]:
        if not isinstance(raw, list) or not all(isinstance(k, bytes) and len(k) == 16 for k in raw):
            raise BadRequest("keys are a list of 16-byte chunk keys")
        if not isinstance(shared, bool):
            raise BadRequest(f"shared must be True or False, got {shared!r}")
        kind = SharedKey if shared else ChunkKey
        return [kind(k) for k in raw]

    # ---------------------------------------------------------------- operations
    def op_hello(self, deadline: float) -> dict:
        return dict(self.info)

    def op_lookup(self, credential: str, keys: list, deadline: float, shared: bool = False) -> dict:
        """The leading run the pool's index lists for the caller (verified here)."""
        self.shard._who(credential)
        hit = self._pool().lookup(credential, self._keys(keys, shared))
        return {"count": hit.count, "shards": list(hit.shards), "error": hit.error}

    def op_reserve(self, credential: str, keys: list, sizes: list, deadline: float, shared: bool = False,
                   first_position: int = 0, request_id: int | None = None) -> dict:
        """Pages of this node's slab for a write; ``full`` when this shard cannot take them (the
        engine then sends the bytes and this shard places them elsewhere: ``op_put``)."""
        refused = self.publisher.refused(self.shard._who(credential).tenant)
        if refused is not None:
            raise refused  # the index refused this tenant's last writes here: over its quota
        write = Write(list(keys), credential, shared, first_position, request_id)
        try:
            r = self.shard.reserve(Reserve(write, list(sizes)))
        except PoolFull:
            return {"full": True}
        return {"hold": r.hold_id, "places": [[p.key, p.offset, p.nbytes] for p in r.places]}

    def op_commit(self, credential: str, hold: int, keys: list, checksums: list, deadline: float) -> int:
        """The copies are done: the chunks are findable on this node now, and published to the
        index just after (cluster/publisher.py), off the engine's path."""
        shard = self.shard
        if not isinstance(hold, int) or not shard._own_hold(hold, credential):
            raise BadRequest(f"no reservation {hold} of this caller: it was committed, aborted or expired")
        n = shard.store.commit(hold, checksums)
        self.publisher.enqueue(shard._reserved.pop(hold, [])[:n])
        return n

    def op_abort(self, credential: str, hold: int, deadline: float) -> None:
        self.shard.abort(hold, credential)

    def op_put(self, credential: str, keys: list, payloads: list, deadline: float, shared: bool = False,
               first_position: int = 0) -> int:
        """Chunks this node could not take, placed on the rest of the pool (bytes over Ray)."""
        self.shard._who(credential)
        return self._pool().put(credential, self._keys(keys, shared), payloads, shared=shared,
                                first_position=first_position)

    def op_get(self, credential: str, keys: list, deadline: float, shared: bool = False) -> tuple[int, list]:
        """The leading run of ``keys`` from wherever the index lists them (this shard's disk tier,
        other nodes); bytes come back as the reply's payloads."""
        self.shard._who(credential)
        arrays = self._pool().get(credential, self._keys(keys, shared))
        return len(arrays), arrays

    def op_begin(self, credential: str, keys: list, deadline: float, priority: str | None = None,
                 shared: bool = False) -> dict:
        self.shard._who(credential)
        req = self._pool().begin(credential, self._keys(keys, shared), priority)
        return {"requests": dict(req.shard_requests), "count": req.hit_chunks}

    def op_end(self, credential: str, requests: dict, deadline: float) -> None:
        from kvpool.cluster.client_state import ClusterRequest

        self.shard._who(credential)
        self._pool().end(ClusterRequest(credential, {str(k): int(v) for k, v in requests.items()}, 0))

    def op_pin(self, credential: str, keys: list, deadline: float, shared: bool = False) -> int:
        self.shard._who(credential)
        return self._pool().pin(credential, self._keys(keys, shared))

    def op_report(self, name: str, figures: dict, deadline: float) -> None:
        self._pool().controller.report.remote(str(name), dict(figures))

    def op_stats(self, deadline: float) -> dict:
        return {**self.shard.stats(), "node_op_s": dict(self.op_time)}
