"""A shard's writes (cluster/service.py has the rest of its operations): an engine's chunks into
this node's slab in one call (``put_staged``, from the connection's staging file) or two
(``reserve``, the engine's own copy, ``commit``); chunks sent with the call (``put``), stored
here or, when this node would have to evict to take them, on the shard with the most room
through its peer port (``peer_put``). Every commit is published to the index just after, off the
caller's path (cluster/publisher.py): bytes before index, the quota charged as it publishes.
"""

from __future__ import annotations

from kvpool.checksum import copy_with_checksum
from kvpool.cluster.node_caps import StageRoom
from kvpool.errors import BadRequest, KvPoolError, PoolFull, ReservationGone, Unavailable
from kvpool.node import messages as m
from kvpool.node.staging import Stage


class Writes:
    def __init__(self, service) -> None:
        self.s = service
        self.room = StageRoom(service.pool)  # the connections' staging files, per tenant

    def _writer(self, credential: str, raw, shared: bool):
        """The verified writer and its addresses; its 429 while the index refuses its writes here."""
        p, where = self.s.writer(credential, raw, shared)
        refused = self.s.publisher.refused(p.tenant)
        if refused is not None:
            raise refused  # over its quota across the pool
        return p, where

    def reserve(self, msg: m.Reserve) -> dict:
        """Pages of this node's slab for a write; ``full`` when this shard cannot take them (the
        engine then sends the bytes: ``put``)."""
        s = self.s
        if len(msg.sizes) != len(msg.keys):
            raise BadRequest("reserve takes one size per key")
        p, where = self._writer(msg.credential, msg.keys, msg.shared)
        if s.placement.spill(len(msg.sizes)) is not None:
            return {"full": True}  # this node would evict to take them while another has room
        raw = dict(zip(where, msg.keys))
        s.open_reservations.take(p.tenant)  # its tenant's cap first: a refused reserve holds nothing
        try:
            hid, places = s.store.reserve(where, list(msg.sizes), p.tenant, shared=msg.shared,
                                          first_position=msg.first_position,
                                          request=s.joined_request(msg.request_id, p.tenant))
        except PoolFull:
            s.open_reservations.give(p.tenant)
            return {"full": True}
        except BaseException:
            s.open_reservations.give(p.tenant)
            raise
        if not hid:  # nothing to copy (all stored already, or no room for its chain): nothing held
            s.open_reservations.give(p.tenant)
        else:
            s.reserved[hid] = (p.tenant, [pl.key for pl in places])  # what its commit publishes
        return {"hold": hid, "places": [[raw[pl.key], pl.offset, pl.nbytes] for pl in places]}

    def commit(self, msg: m.Commit) -> int:
        """The copies are done: the chunks are findable on this node now, listed in the index just after."""
        s = self.s
        tenant = s.who(msg.credential).tenant
        if not msg.hold and not msg.checksums:
            return 0  # a reservation of nothing (kvpool.store: hold 0)
        if s.store.hold_owner(msg.hold) != tenant:
            raise ReservationGone(f"no reservation {msg.hold} of this caller: it was committed, aborted or expired")
        n = s.store.commit(msg.hold, msg.checksums)
        s.publisher.enqueue(self._closed(msg.hold)[:n])
        return n

    def abort(self, msg: m.Abort) -> None:
        s = self.s
        if s.store.hold_owner(msg.hold) == s.who(msg.credential).tenant:
            s.store.abort(msg.hold)
            self._closed(msg.hold)

    def expire_reservations(self) -> None:
        for hid in [h for h in list(self.s.reserved) if self.s.store.hold_owner(h) is None]:
            self._closed(hid)  # expired uncommitted

    def _closed(self, hid: int) -> list:
        """A reservation ended (committed, aborted, expired): its tenant's count given back once;
        the addresses its commit publishes."""
        entry = self.s.reserved.pop(hid, None)
        if entry is None:
            return []
        self.s.open_reservations.give(entry[0])
        return entry[1]

    def stage(self, msg: m.Stage, conn: dict, directory: str, page_bytes: int) -> dict:
        """The connection's staging file (kvpool.node.staging), made on first ask for a verified
        caller and charged to its tenant until the connection closes (cluster/node_caps.py: the
        tenant's cap, 429; a run dir without room, 507)."""
        p = self.s.who(msg.credential)
        return self.room.open(conn, p.tenant, directory, page_bytes)

    def unstage(self, conn: dict) -> None:
        """The connection closed: its staging file goes, and its tenant's charge with it."""
        self.room.close(conn)

    def put_staged(self, msg: m.PutStaged, stage: Stage | None):
        """Small chunks in one call: reserved, copied from the connection's staging file with their
        checksums computed in the same pass, committed (published just after)."""
        s = self.s
        if stage is None:
            raise BadRequest("put_staged needs this connection's staging file: ask for it with 'stage' first")
        if not len(msg.offsets) == len(msg.sizes) == len(msg.keys):
            raise BadRequest("put_staged takes one offset and one size per key")
        p, where = self._writer(msg.credential, msg.keys, msg.shared)
        if s.placement.spill(len(msg.sizes)) is not None:
            return {"full": True}
        src = dict(zip(where, (stage.region(o, n) for o, n in zip(msg.offsets, msg.sizes))))  # checked first
        hid, places = s.store.reserve(where, list(msg.sizes), p.tenant, shared=msg.shared,
                                      first_position=msg.first_position,
                                      request=s.joined_request(msg.request_id, p.tenant))
        slab = s.store.slab("dram").buf
        try:
            sums = [copy_with_checksum(slab[pl.offset: pl.offset + pl.nbytes], src[pl.key]) for pl in places]
        except BaseException:
            s.store.abort(hid)
            raise
        n = s.store.commit(hid, sums)
        s.publisher.enqueue([pl.key for pl in places][:n])
        return n

    def put(self, msg: m.Put, payloads: list) -> int:
        """Chunks this node could not take without evicting: stored on the shard with the most room
        (through its peer port), else here after all."""
        s = self.s
        if len(payloads) != len(msg.keys):
            raise BadRequest(f"{len(msg.keys)} keys but {len(payloads)} payloads: one payload per key")
        p, where = self._writer(msg.credential, msg.keys, msg.shared)
        target = s.placement.spill(len(msg.keys))
        address = None if target is None else s.members.peer_address(target)
        if address is None:
            return self._store(p, where, msg, payloads)
        peer = m.PeerPut(s.links.credential, msg.credential, msg.keys, msg.shared, msg.first_position)
        try:
            return int(s.links.call(address, peer, payloads, deadline=s.peer_deadline()))
        except KvPoolError as e:
            if e.status in (401, 403, 429):
                raise
            raise Unavailable(f"spilling {len(payloads)} chunks to shard {target} failed ({e})") from None

    def peer_put(self, msg: m.PeerPut, payloads: list) -> int:
        """Chunks another shard spilled here."""
        self.s.peer(msg.pool, "storing chunks for another shard")
        if len(payloads) != len(msg.keys):
            raise BadRequest(f"{len(msg.keys)} keys but {len(payloads)} payloads: one payload per key")
        p, where = self._writer(msg.credential, msg.keys, msg.shared)
        return self._store(p, where, msg, payloads, at_once=True)

    def _store(self, p, where, msg, payloads: list, at_once: bool = False) -> int:
        """Stores the chunks here and publishes them: just after (the publisher), or before
        answering (``at_once``: a spill, whose writer already was answered by another shard)."""
        s = self.s
        stored = s.store.put_many(where, payloads, p.tenant, shared=msg.shared, first_position=msg.first_position,
                                  request=s.joined_request(msg.request_id, p.tenant))
        done = [a for a, ok in zip(where, stored) if ok]
        if at_once:
            s.publish(done)
        else:
            s.publisher.enqueue(done)
        return sum(stored)

