"""The write operations of a node's front door (cluster/node_server.py): an engine's chunks into
this node's slab, in one call (``put_staged``, from the connection's staging file) or two
(``reserve``, the engine's own copy, ``commit``), published to the index just after; or, when
this node has no room, placed on the rest of the pool (``put``)."""

from __future__ import annotations

import os
import time

from kvpool.checksum import copy_with_checksum
from kvpool.cluster.messages import Put, Write
from kvpool.cluster.shard_access import joined_request, who, writer
from kvpool.errors import BadRequest, KvPoolError, PoolFull, ReservationGone, Unavailable
from kvpool.node.staging import STAGE_BYTES, Stage


class NodeWrites:
    def op_reserve(self, credential: str, keys: list, sizes: list, deadline: float, shared: bool = False,
                   first_position: int = 0, request_id: int | None = None) -> dict:
        """Pages of this node's slab for a write; ``full`` when this shard cannot take them (the
        engine then sends the bytes and this shard places them elsewhere: ``op_put``)."""
        shard = self.shard
        p, addresses, _ = self._writer(credential, keys, shared)
        if self.placement.spill(len(sizes)) is not None:
            return {"full": True}  # this node would evict to take them while another has room
        raw = dict(zip(addresses, keys))
        try:
            hid, places = shard.store.reserve(addresses, list(sizes), p.tenant, shared=shared,
                                              first_position=first_position,
                                              request=joined_request(shard, request_id, p.tenant))
        except PoolFull:
            return {"full": True}
        shard._reserved[hid] = [pl.key for pl in places]  # what its commit publishes
        return {"hold": hid, "places": [[raw[pl.key], pl.offset, pl.nbytes] for pl in places]}

    def _writer(self, credential: str, keys: list, shared: bool):
        """The verified writer and its addresses; its 429 when the index refused its last writes
        here; 503 when this shard was dropped from the pool (fenced)."""
        if self.shard.fenced:
            raise Unavailable(f"shard {self.shard.shard_id} was dropped from the pool (fenced)")
        p, addresses, _ = writer(self.shard, credential, self._keys(keys), shared)
        refused = self.publisher.refused(p.tenant)
        if refused is not None:
            raise refused  # over its quota across the pool
        return p, addresses, None

    def op_stage(self, deadline: float, conn: dict) -> dict:
        """This connection's staging file (kvpool.node.staging), created on first ask."""
        if conn.get("stage") is None:
            nbytes = min(max(STAGE_BYTES, 2 * self.info["page_bytes"] + 4096), 1 << 30)  # two chunks at least
            conn["stage"] = Stage.create(os.path.dirname(self.paths["node"]), self.shard.pool, nbytes)
        return {"path": conn["stage"].path, "nbytes": conn["stage"].nbytes}

    def op_put_staged(self, credential: str, keys: list, sizes: list, offsets: list, deadline: float, conn: dict,
                      shared: bool = False, first_position: int = 0, request_id: int | None = None):
        """Small chunks in one call: reserved, copied from the connection's staging file with their
        checksums computed in the same pass, committed (published just after)."""
        shard, stage = self.shard, conn.get("stage")
        if stage is None:
            raise BadRequest("put_staged needs this connection's staging file: ask for it with 'stage' first")
        if not isinstance(offsets, list) or not isinstance(sizes, list) or len(offsets) != len(sizes) != len(keys):
            raise BadRequest("put_staged takes one offset and one size per key")
        p, addresses, _ = self._writer(credential, keys, shared)
        if self.placement.spill(len(sizes)) is not None:
            return {"full": True}
        src = dict(zip(addresses, (stage.region(o, n) for o, n in zip(offsets, sizes))))  # checked before anything
        hid, places = shard.store.reserve(addresses, list(sizes), p.tenant, shared=shared, first_position=first_position,
                                          request=joined_request(shard, request_id, p.tenant))
        slab = shard.store.slab("dram").buf
        try:
            sums = [copy_with_checksum(slab[pl.offset : pl.offset + pl.nbytes], src[pl.key]) for pl in places]
        except BaseException:
            shard.store.abort(hid)
            raise
        n = shard.store.commit(hid, sums)
        self.publisher.enqueue([pl.key for pl in places][:n])
        return n

    def op_commit(self, credential: str, hold: int, keys: list, checksums: list, deadline: float) -> int:
        """The copies are done: the chunks are findable on this node now, and published to the
        index just after (cluster/publisher.py), off the engine's path."""
        shard = self.shard
        if not isinstance(hold, int) or shard.store.hold_owner(hold) != who(shard, credential).tenant:
            raise ReservationGone(f"no reservation {hold} of this caller: it was committed, aborted or expired")
        n = shard.store.commit(hold, checksums)
        self.publisher.enqueue(shard._reserved.pop(hold, [])[:n])
        return n

    def op_abort(self, credential: str, hold: int, deadline: float) -> None:
        if isinstance(hold, int) and self.shard.store.hold_owner(hold) == who(self.shard, credential).tenant:
            self.shard.store.abort(hold)
            self.shard._reserved.pop(hold, None)

    def op_put(self, credential: str, keys: list, payloads: list, deadline: float, shared: bool = False,
               first_position: int = 0) -> int:
        """Chunks this node could not take without evicting: stored on the shard with the most room
        (bytes over Ray), else here after all."""
        import ray

        who(self.shard, credential)
        target = self.placement.spill(len(keys))
        if target is None:
            r = self.shard.put(Put(Write(list(keys), credential, shared, first_position), payloads))
            return int(r)
        handle = self._pool()._view.handles.get(target)
        if handle is None:
            return 0
        put = Put(Write(list(keys), credential, shared, first_position), payloads)
        try:
            return int(ray.get(handle.put.remote(put), timeout=max(deadline - time.monotonic(), 0.01)))
        except Exception as e:  # noqa: BLE001 - the shard's own typed error, else a failed put
            from kvpool.cluster.client_state import cause

            err = cause(e)
            raise err if isinstance(err, KvPoolError) else Unavailable(f"spilling to {target} failed") from None

