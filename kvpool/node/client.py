"""NodeClient: an engine's side of the pool, without Ray. It talks only to its node's shard.

- **Same-node hits cost no call.** The shard lists its DRAM chunks in a shared-memory page table
  (kvpool.node.table); a read finds a chunk there, copies it out of the shard's slab (mapped here)
  and validates the copy (the table slot's sequence number, then the checksum). A chunk evicted
  mid-copy is a miss, never wrong bytes.
- **Writes** reserve pages on the socket, copy into the slab (hashing in the same pass) and commit
  (the shard publishes to the index and charges the quota there). When this node cannot take them,
  the bytes go over the socket and the shard places them on the rest of the pool.
- **Everything else** (a pool-wide lookup, chunks held on other nodes, leases of a request in
  flight) is one call on the socket; the shard's service does it (kvpool.cluster.service).
- **A dead pool is a miss.** A shard, Ray head or Redis that is down or restarting never stops,
  hangs or slows the engine beyond one call's deadline: reads are misses, writes store nothing,
  and a failed connection is retried at most every ``retry_s``. A connector checks at start that
  the shard answers (kvpool.node.probe; ``"degraded": true`` starts without it).

:class:`kvpool.node.pool.NodePool` gives LocalPool's surface over it. Found through ``kvpool-<pool>-<shard>.node`` in ``$KVPOOL_RUN_DIR``
(/dev/shm by default); with several shards of one pool on a machine, name the shard.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.auth import CREDENTIAL_ENV, claimed_tenant, scope_tag, scoped
from kvpool.buffers import as_byte_array
from kvpool.checksum import copy_with_checksum
from kvpool.errors import ChunkTooLarge, KvPoolError, LimitExceeded, Unavailable
from kvpool.index.base import PrefixHit
from kvpool.keys import ChunkKey, is_shared
from kvpool.node import messages as m
from kvpool.node.attach import Attached as _Attached
from kvpool.node.checks import RAISED, check_put
from kvpool.node.connection import NodeConnection
from kvpool.node.staging import STAGE_BYTES

BATCH = m.MAX_KEYS  # keys one call carries; longer runs go in batches

log = logging.getLogger("kvpool.node")


def _raw(keys: Sequence[ChunkKey]) -> list[bytes]:
    return [bytes(k) for k in keys]


@dataclass
class NodeRequest:
    """A request in flight: the request id each shard gave its leases (the node's shard began them)."""

    credential: str
    shard_requests: dict[str, int]
    hit_chunks: int

    @property
    def tenant(self) -> str:
        return claimed_tenant(self.credential)


class NodeClient(NodeConnection):
    """The pool's surface over this node's shard (the connection: kvpool.node.connection)."""

    @staticmethod
    def addresses(credential: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Where the pool keeps a caller's chunks (kvpool.auth: scopes), as the shard computes them."""
        return scoped(keys, scope_tag(None if is_shared(keys) else claimed_tenant(credential)))

    def vouched(self, at: _Attached | None, credential: str) -> _Attached | None:
        """``at`` when the shard has verified ``credential`` (once per shard incarnation, one call),
        so this node's table serves only callers the shard would serve; None when it does not
        answer now (a miss). A refused credential raises, as the shard's refusal of any call."""
        if at is None or (credential, at.info.get("incarnation")) in self._vouched:
            return at
        try:
            self.call(m.Lookup(credential, []))  # vouched for when it answers (kvpool.node.connection)
        except KvPoolError as e:
            if e.status in RAISED:
                raise
            return None
        return at

    def check(self, credential: str) -> dict:
        """The shard's word on ``credential``, asked once when an engine starts: ``{"tenant",
        "served"}`` (plus ``"tenants"``, the pool's, when it does not serve it); 401 when it does not
        verify, Unavailable when the shard does not answer."""
        return self.call(m.Check(credential))[0]

    def _local_run(self, at: _Attached | None, credential: str, keys: Sequence[ChunkKey]) -> int:
        at = self.vouched(at, credential)
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
        holds them all), then the pool's index through the shard; a run longer than one call takes
        (``BATCH`` keys) is asked batch by batch while it lasts. ``error`` says when the shard or the
        index did not answer (the run is then what was found without them)."""
        if len(keys) > BATCH:
            count, shards = 0, ()
            for i in range(0, len(keys), BATCH):
                part = self.lookup(credential, keys[i : i + BATCH])
                count, shards = count + part.count, shards + tuple(part.shards)
                if part.count < len(keys[i : i + BATCH]) or part.error:
                    return PrefixHit(count, shards, error=part.error)
            return PrefixHit(count, shards)
        at = self._attached()
        local = self._local_run(at, credential, keys)
        sid = at.info["shard"] if at is not None else ""
        if local == len(keys):
            return PrefixHit(local, (sid,) * local)
        try:
            r, _ = self.call(m.Lookup(credential, _raw(keys), is_shared(keys)))
        except KvPoolError as e:
            if e.status in RAISED:
                raise
            return PrefixHit(local, (sid,) * local, error=str(e) or type(e).__name__)
        count, error = int(r["count"]), r.get("error")  # error: the pool's index did not answer the shard
        if count <= local:
            return PrefixHit(local, (sid,) * local, error=error)
        return PrefixHit(count, (sid,) * local + tuple(r["shards"][local:count]), error=error)

    def begin(self, credential: str, keys: Sequence[ChunkKey], priority: str | None = None,
              hit: PrefixHit | None = None) -> NodeRequest:
        """Leases the leading run of a request's cached chunks on their shards until ``end`` (at most
        ``BATCH`` of them). Best effort: a shard that does not answer leaves them unleased (a later
        miss at worst)."""
        keys = keys[:BATCH]
        try:
            r, _ = self.call(m.Begin(credential, _raw(keys), is_shared(keys), priority))
        except LimitExceeded as e:  # the tenant's cap of requests in flight on its node: served unleased
            self.counts["begin_refused"] += 1
            if self.counts["begin_refused"] & (self.counts["begin_refused"] - 1) == 0:  # the 1st, 2nd, 4th...
                log.warning("kvpool: %s (%d requests served without leases so far)", e, self.counts["begin_refused"])
            return NodeRequest(credential, {}, 0)
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
            self.call(m.End(request.credential, dict(request.shard_requests)))
        except KvPoolError:
            self.counts["end_failed"] += 1  # the leases expire on their own
        request.shard_requests = {}

    def pin(self, credential: str, keys: Sequence[ChunkKey]) -> int:
        pinned = 0
        for i in range(0, len(keys), BATCH):
            r, _ = self.call(m.Pin(credential, _raw(keys[i : i + BATCH]), is_shared(keys)))
            pinned += int(r)
        return pinned

    def report(self, name: str, figures: dict, credential: str | None = None) -> None:
        """Sends a connector's figures to the pool (fire and forget: an engine's scheduler calls
        this, and must not wait on a slow shard), with ``credential``: by default the latest one
        the shard accepted from this engine, else ``$KVPOOL_CREDENTIAL`` (a secured pool refuses
        a report without one: counted ``report_failed``)."""
        credential = credential or self.last_credential or os.environ.get(CREDENTIAL_ENV, "")

        def send() -> None:
            try:
                self.call(m.Report(credential, name, figures))
            except KvPoolError:
                self.counts["report_failed"] += 1

        threading.Thread(target=send, daemon=True, name="kvpool-report").start()

    # ---------------------------------------------------------------- writes
    def put(self, credential: str, keys: Sequence[ChunkKey], payloads: Sequence[object], *, shared: bool = False,
            first_position: int = 0, request: NodeRequest | None = None) -> int:
        """Stores the chunks (this node's slab when it has room, else the rest of the pool); how
        many were stored. Bad input, a refused credential and the tenant's 429 raise; a shard that
        is down or slow stores nothing (counted: ``put_failed``). More than one call takes
        (``BATCH``) go in batches, each after the one before."""
        if len(keys) > BATCH:
            if len(payloads) != len(keys):
                check_put(keys, [as_byte_array(p) for p in payloads], shared)  # the same error as one batch
            return sum(self.put(credential, keys[i : i + BATCH], payloads[i : i + BATCH], shared=shared,
                                first_position=first_position + i, request=request)
                       for i in range(0, len(keys), BATCH))
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
        sizes = [int(a.nbytes) for a in arrays]
        try:
            if sum(-(-n // 64) * 64 for n in sizes) <= STAGE_BYTES // 2:  # small: one call (kvpool.node.staging)
                r, _ = self.call(m.PutStaged(credential, raw, shared, first_position, rid, sizes),
                                 prepare=self._staged(arrays))
            else:
                r, _ = self.call(m.Reserve(credential, raw, shared, first_position, rid, sizes))
            if isinstance(r, int):
                self.counts["put_staged"] += 1
                return r
            if r.get("full"):
                stored, _ = self.call(m.Put(credential, raw, shared, first_position, rid), arrays)
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
            stored, _ = self.call(m.Commit(credential, r["hold"], keys_done, sums))
            self.counts["put_shm"] += 1
            return int(stored)
        except KvPoolError as e:
            if e.status in RAISED:
                raise
            self.counts["put_failed"] += 1
            if self.counts["put_failed"] & (self.counts["put_failed"] - 1) == 0:  # the 1st, 2nd, 4th, 8th...
                log.warning("kvpool: put failed (%s); the chunks are not stored (%d failed puts so far)",
                            e, self.counts["put_failed"])
            return 0

    def _suspect(self, credential: str, key: ChunkKey) -> None:
        """A chunk of this node's slab that failed its checksum here: the shard checks it itself
        and drops it when it is corrupt (else it was a tear, and stays)."""
        try:
            if self.call(m.Verify(credential, [bytes(key)], is_shared([key])))[0]:
                self.counts["corrupt_dropped"] += 1
        except KvPoolError as e:
            if e.status in (401, 403):
                raise

    # ---------------------------------------------------------------- reads
    def get(self, credential: str, keys: Sequence[ChunkKey], hit: PrefixHit | None = None,
            outs: Sequence[object] | None = None, local_only: bool = False) -> list[np.ndarray]:
        """The leading run of chunks, each verified: this node's slab first (no call), the rest
        through the shard (not with ``local_only``). Never raises on a failure of the pool: the run
        just ends there."""
        at = self.vouched(self._attached(), credential)
        out: list[np.ndarray] = []
        dsts = None if outs is None else [as_byte_array(o, writable=True) for o in outs]
        if at is not None:
            table, buf = at.table, at.slab.buf
            for i, a in enumerate(self.addresses(credential, keys)):
                got = table.read(bytes(a), buf, None if dsts is None else dsts[i])
                if got is None:
                    if table.find(bytes(a)) is not None:  # still listed: torn or corrupt, not evicted
                        self._suspect(credential, keys[i])
                    break
                out.append(got)
            if out:
                self.counts["get_shm"] += 1
                self.touches.add(credential, _raw(keys[: len(out)]), is_shared(keys))
        n = len(out)
        if n == len(keys) or local_only or (hit is not None and hit.count <= n):
            return out
        while n < len(keys):  # the rest through the shard, at most BATCH keys a call
            end = min(len(keys), n + BATCH)
            got = self._get_remote(credential, keys, n, end, hit, None if dsts is None else dsts[n:end])
            out.extend(got)
            if len(got) < end - n:
                break
            n = end
        return out

    def _get_remote(self, credential: str, keys: Sequence[ChunkKey], n: int, end: int, hit: PrefixHit | None,
                    rest) -> list[np.ndarray]:
        """``keys[n:end]``'s leading run through the shard (one call)."""
        try:
            shards = list(hit.shards[n: min(end, hit.count)]) if hit is not None and hit.count > n else None
            r, got = self.call(m.Get(credential, _raw(keys[n:end]), is_shared(keys), shards), outs=rest,
                               prepare=lambda ch, msg, d: (self._stage(ch, d, msg.credential), msg)[1], after=self._unstage(rest))
            count = int(r["count"])
            if count:
                self.counts["get_remote"] += 1
            return got[:count]
        except KvPoolError as e:
            if e.status in (401, 403):
                raise
            self.counts["get_failed"] += 1
            return []
