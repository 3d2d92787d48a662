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

import fcntl
import json
import logging
import os
import socket
import threading
import time

from kvpool.cluster.locations import Locations
from kvpool.cluster.node_writes import NodeWrites
from kvpool.cluster.peers import PeerLinks, serve_peer_get
from kvpool.cluster.placement import Placement
from kvpool.cluster.publisher import Publisher
from kvpool.cluster.shard_access import where, who
from kvpool.errors import BadRequest, KvPoolError
from kvpool.keys import ChunkKey, SharedKey
from kvpool.node import wire
from kvpool.node.paths import RUN_DIR_ENV, node_paths, run_dir
from kvpool.node.staging import SUFFIX as STAGE_SUFFIX
from kvpool.node.table import PageTable

log = logging.getLogger("kvpool.node")
PEER_OPS = frozenset({"peer_get"})
MAX_KEYS = 2048  # chunks in one call
CONNECTION_OPS = frozenset({"stage", "put_staged", "get"})


def serve_node(shard, index_url: str | None):
    """The node server of ``shard`` (a ShardActor, in its process), or None without a run dir."""
    import ray

    from kvpool.slab import sweep_orphans

    where = run_dir()
    if not os.path.isdir(where):
        log.warning("shard %s: no run dir (%s): engines of this node cannot reach it", shard.shard_id, RUN_DIR_ENV)
        return None
    for suffix in (".kvtable", STAGE_SUFFIX):
        for path in sweep_orphans(where, f"kvpool-{shard.pool}-", suffix=suffix):
            log.warning("shard %s: removed %s of a shard that is gone", shard.shard_id, path)
    return NodeServer(shard, where, ray.get_runtime_context().namespace, index_url,
                      host=ray.util.get_node_ip_address())


class NodeServer(NodeWrites):
    """Serves the engines of this node for ``shard`` (a ShardActor instance, in its own process)."""

    def __init__(self, shard, directory: str, namespace: str | None, index_url: str | None,
                 host: str = "127.0.0.1") -> None:
        self.shard = shard
        self.namespace = namespace
        self.index_url = index_url
        self.paths = node_paths(directory, shard.pool, shard.shard_id)
        slab = shard.store.slab("dram")
        self.table = PageTable.create(self.paths["table"], slab.page_bytes, slab.num_pages)
        shard.store.attach_table(self.table)
        # NOTE: held while this process lives: an engine that can take a shared lock on the table
        # knows its shard died (SIGKILL leaves the files as they were) and lets go of its memory.
        self._alive = os.open(self.paths["table"], os.O_RDONLY)
        fcntl.flock(self._alive, fcntl.LOCK_EX)
        self.publisher = Publisher(shard)
        self._client = None
        self._client_lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self.op_time: dict[str, float] = {}  # seconds spent in each operation's handler
        self.placement = Placement(shard, self._pool)
        self.locations = Locations()
        path = self.paths["socket"]
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(64)
        # Other shards read this one's chunks on this port (cluster/peers.py); only peer_get there.
        self.peer_sock = socket.create_server((host, 0), backlog=64)
        self.peer_address = f"{host}:{self.peer_sock.getsockname()[1]}"
        self.links = PeerLinks(shard.auth.pool_credential())
        self.info = {"wire": wire.NODE_WIRE, "pool": shard.pool, "shard": shard.shard_id, "socket": path,
                     "table": self.paths["table"], "slab": slab.path, "page_bytes": slab.page_bytes,
                     "dram_pages": slab.num_pages, "incarnation": shard.incarnation, "pid": os.getpid(),
                     "secured": shard.auth.secured, "peer": self.peer_address}
        tmp = self.paths["node"] + f".{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(self.info, f)
        os.replace(tmp, self.paths["node"])
        for listener, allowed in ((self.sock, None), (self.peer_sock, PEER_OPS)):
            threading.Thread(target=self._serve, args=(listener, allowed), daemon=True, name="kvpool-node").start()

    def close(self) -> None:
        self._stop.set()
        self.publisher.flush(2.0)
        self.publisher.close()
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
        self.links.close()

    # ---------------------------------------------------------------- connections
    def _serve(self, listener: socket.socket, allowed: frozenset | None) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if allowed is not None:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._connection, args=(conn, allowed), daemon=True,
                             name="kvpool-node-conn").start()

    def _connection(self, sock: socket.socket, allowed: frozenset | None = None) -> None:
        conn = wire.Channel(sock)
        state: dict = {}  # this connection's: its staging file
        try:
            self._serve_connection(conn, sock, allowed, state)
        finally:
            if state.get("stage") is not None:
                state["stage"].close()

    def _serve_connection(self, conn: wire.Channel, sock: socket.socket, allowed: frozenset | None,
                          state: dict) -> None:
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
                payloads, after = [], None
                try:
                    lens = args.pop("lens", None)
                    if lens is not None and (not isinstance(lens, list) or len(lens) > MAX_KEYS or not all(
                            isinstance(n, int) and 0 <= n <= self.info["page_bytes"] for n in lens)):
                        return  # payloads no page holds, or not a kvpool engine: hang up before reading them
                    if lens:
                        args["payloads"] = conn.recv_payloads(lens, deadline=deadline)
                    handler = getattr(self, "op_" + op, None) if allowed is None or op in allowed else None
                    if handler is None:
                        raise BadRequest(f"unknown node operation {op!r}: is the engine's kvpool the shard's release?")
                    t0 = time.perf_counter()
                    if op in CONNECTION_OPS:
                        args["conn"] = state
                    result = handler(deadline=deadline, **args)
                    self.op_time[op] = self.op_time.get(op, 0.0) + time.perf_counter() - t0
                    if isinstance(result, tuple):
                        result, payloads, after = result if len(result) == 3 else (*result, None)
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
                finally:
                    if after is not None:
                        after()  # e.g. a lease on the pages just sent

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
        """The leading run the pool's index lists for the caller (verified here). Where it found
        them is remembered a few seconds (cluster/locations.py): the engine's load usually follows
        its lookup, and then needs no second one."""
        who(self.shard, credential)
        pool = self._pool()
        addresses = pool.addresses(credential, self._keys(keys, shared))
        hit = pool.index.lookup(addresses)
        self.locations.remember(addresses[: hit.count], hit.shards[: hit.count])
        return {"count": hit.count, "shards": list(hit.shards), "error": hit.error}

    def op_get(self, credential: str, keys: list, deadline: float, conn: dict, shared: bool = False,
               shards: list | None = None):
        """The leading run of ``keys`` from wherever the index lists them (or ``shards`` says: the
        engine's own lookup): this shard's own store (a chunk on its disk tier), other shards
        straight from their peer port (cluster/peers.py), or through Ray for a shard that has none.
        The bytes land in the connection's staging file when it has one and they fit (the reply
        says where: ``staged``), else they come back as the reply's payloads."""
        p = who(self.shard, credential)
        pool = self._pool()
        ks = self._keys(keys, shared)
        addresses = pool.addresses(credential, ks)
        recalled = False
        if isinstance(shards, list) and shards and all(isinstance(x, str) for x in shards):
            count, located = min(len(shards), len(ks)), shards
        else:
            located = self.locations.recall(addresses)
            recalled = len(located) == len(ks)
            if not recalled:
                hit = pool.index.lookup(addresses)
                located = hit.shards[: hit.count]
            count = len(located)
        stage, cursor, staged = conn.get("stage"), [0], []

        def into(lens: list) -> list | None:  # staging regions for the next payloads, if they fit
            if stage is None:
                return None
            offsets = stage.layout_from(cursor[0], lens)
            if offsets is None:
                return None
            cursor[0] = offsets[-1] + lens[-1] if lens else cursor[0]
            staged.extend([o, n] for o, n in zip(offsets, lens))
            return [stage.buf[o : o + n] for o, n in zip(offsets, lens)]

        out: list = []
        i = 0
        peers = pool.shards
        while i < count:
            sid = located[i]
            j = i
            while j < count and located[j] == sid:
                j += 1
            run = ks[i:j]
            try:
                if sid == self.shard.shard_id:
                    got = []
                    for a in self.shard.store.get_many(where(p, run, shared), p.tenant):
                        if a is None:
                            break
                        got.append(a)
                elif peers.get(sid, {}).get("peer"):
                    got = self.links.fetch(peers[sid]["peer"], credential, [bytes(k) for k in run], shared, deadline,
                                           into=into)
                else:
                    got = pool.get(credential, run)
            except KvPoolError as e:
                if e.status in (401, 403):
                    raise
                log.warning("node: reading %d chunks from shard %s failed (%s): a miss", len(run), sid, e)
                break
            out.extend(got)
            if len(got) < len(run):
                break
            i = j
        if recalled and len(out) < count:
            self.locations.forget(addresses[len(out) :])  # remembered wrong (moved, evicted): asked anew next time
        if staged and len(staged) >= len(out):
            return {"count": len(out), "staged": staged[: len(out)]}, []
        return {"count": len(out)}, out

    def op_peer_get(self, pool: str, credential: str, keys: list, deadline: float, shared: bool = False):
        return serve_peer_get(self.shard, pool, credential, keys, shared)

    def op_begin(self, credential: str, keys: list, deadline: float, priority: str | None = None,
                 shared: bool = False) -> dict:
        who(self.shard, credential)
        req = self._pool().begin(credential, self._keys(keys, shared), priority)
        return {"requests": dict(req.shard_requests), "count": req.hit_chunks}

    def op_end(self, credential: str, requests: dict, deadline: float) -> None:
        from kvpool.cluster.client_state import ClusterRequest

        who(self.shard, credential)
        self._pool().end(ClusterRequest(credential, {str(k): int(v) for k, v in requests.items()}, 0))

    def op_pin(self, credential: str, keys: list, deadline: float, shared: bool = False) -> int:
        who(self.shard, credential)
        return self._pool().pin(credential, self._keys(keys, shared))

    def op_report(self, name: str, figures: dict, deadline: float) -> None:
        self._pool().controller.report.remote(str(name), dict(figures))

    def op_stats(self, deadline: float) -> dict:
        return {**self.shard.stats(), "node_op_s": dict(self.op_time), "peer_fetched": self.links.fetched,
                "peer_failed": self.links.failed}
