"""The shard's operations, written once: who may act, where the chunks are, the store, publish.

Every operation a shard answers is a method here taking its typed message (kvpool.node.messages)
and starting with one check of the caller's credential; the node's Unix socket and the peer port
(cluster/node_server.py) decode frames and dispatch to it, and the Ray actor (cluster/shard.py)
builds it, keeps its membership and answers the control plane. Reads are here; writes are
:class:`kvpool.cluster.service_writes.Writes`.

- A lookup asks the pool's index (one round trip) and remembers where it found the chunks for a
  few seconds (cluster/locations.py): the engine's load usually follows, and needs no second one.
- A get reads the leading run from this shard's own store (a chunk on its disk tier: same-node
  DRAM hits never reach the shard, kvpool.node.table), and from other shards straight from their
  peer port (cluster/peers.py), each chunk verified by its checksum.
- Requests in flight lease their chunks on every shard that holds some (here directly, on the
  others through the peer port), until they end or ``request_ttl_s`` passes.
"""

from __future__ import annotations

import logging
import threading
import time

from kvpool.auth import Principal, scope_tag, scoped
from kvpool.cluster import node_caps as caps
from kvpool.cluster.locations import Locations
from kvpool.cluster.node_caps import EngineNames
from kvpool.cluster.peers import StreamTransport
from kvpool.cluster.placement import Placement
from kvpool.cluster.publisher import Publisher
from kvpool.cluster.service_writes import Writes
from kvpool.errors import Forbidden, KvPoolError, Unavailable, UnknownTenant
from kvpool.keys import ChunkKey, SharedKey
from kvpool.node import messages as m

log = logging.getLogger("kvpool.shard")
PEER_TIMEOUT_S = 5.0  # at most, for a call to another shard


def addresses_of(p: Principal, raw, shared: bool) -> list[ChunkKey]:
    """The store's addresses of a caller's keys: its own scope, or the shared one (kvpool.auth)."""
    kind = SharedKey if shared else ChunkKey
    return scoped([kind(bytes(k)) for k in raw], scope_tag(None if shared else p.tenant))


class ShardService:
    def __init__(self, shard_id: str, pool: str, store, auth, index, members, request_ttl_s: float = 600.0) -> None:
        self.shard_id, self.pool = shard_id, pool
        self.store, self.auth, self.index = store, auth, index
        self.members = members  # cluster.members.Members: the other shards, the controller
        self.request_ttl_s = request_ttl_s
        self.fenced = False  # set by the actor when the controller dropped this shard
        self.stall_s = 0.0  # a drill: every data-path call answers this late
        self.observe_get = lambda ms: None  # the shard's metrics (cluster/metrics.py) hook in here
        self.answer_by = threading.local()  # ``t``: when the caller of this thread's operation gives up
        # request id -> (ActiveRequest, deadline, the chunks its begin asked to lease here)
        self.requests: dict[int, tuple[object, float, int]] = {}
        self.reserved: dict[int, tuple[str, list[ChunkKey]]] = {}  # reservation id -> (tenant, what it publishes)
        # What a tenant keeps open here, capped per tenant (cluster/node_caps.py): 429 past a cap.
        self.open_requests = caps.OpenCap("requests in flight", caps.REQUESTS_ENV, caps.REQUESTS_PER_TENANT,
                                          "end the requests it no longer serves (each ends at its end, or after "
                                          "request_ttl_s)")
        self.open_leases = caps.OpenCap("chunks leased by its requests", caps.LEASES_ENV, caps.LEASES_PER_TENANT,
                                        "end the requests it no longer serves")
        self.open_reservations = caps.OpenCap("reservations not yet committed", caps.RESERVATIONS_ENV,
                                              caps.RESERVATIONS_PER_TENANT,
                                              "commit or abort them (each ends by itself within its ttl)")
        self.publisher = Publisher(self)
        self.placement = Placement(self)
        self.locations = Locations()
        self.links = StreamTransport(auth.pool_credential())  # the peer transport (cluster/peers.py)
        self.writes = Writes(self)
        self.engines = EngineNames()  # the engines reporting through this shard, per tenant

    # ---------------------------------------------------------------- who and where
    def who(self, credential: str) -> Principal:
        """The verified caller (401 without a credential of this pool's secret; 404 for a tenant
        this shard does not serve); 503 while the shard is fenced or drilled to stall."""
        if self.fenced:
            raise Unavailable(f"shard {self.shard_id} was dropped from the pool (fenced)")
        if self.stall_s:
            time.sleep(self.stall_s)
        p = self.auth.verify(credential)
        self.store.tenants.index(p.tenant)
        return p

    def prove(self, msg: m.Prove) -> dict:
        """Proof that this shard holds the pool secret, before a client sends it a credential of
        ``msg.role`` for ``msg.tenant`` (kvpool.node.trust). Nothing is kept."""
        return {"proof": self.auth.prove_to(msg.role, msg.tenant, msg.nonce)}

    def check(self, msg: m.Check) -> dict:
        """An engine's credential at its start (kvpool.connectors.pool_start): its tenant, and
        whether this shard serves it (else the tenants it serves, to name in the engine's error)."""
        try:
            return {"tenant": self.who(msg.credential).tenant, "served": True}
        except UnknownTenant:  # the credential verified (who checks it first): the pool secret issued it
            tenants = sorted(t.id for t in self.store.tenants)
            return {"tenant": self.auth.verify(msg.credential).tenant, "served": False, "tenants": tenants[:64]}

    def writer(self, credential: str, raw, shared: bool) -> tuple[Principal, list[ChunkKey]]:
        """The verified writer and its addresses (only an operator writes the shared namespace)."""
        p = self.who(credential)
        if shared and not p.operator:
            raise Forbidden(f"only an operator writes the shared namespace; {p.tenant!r} presented a {p.role} credential")
        return p, addresses_of(p, raw, shared)

    def peer_deadline(self) -> float:
        """The deadline of a call to another shard: before this operation's caller gives up (its
        answer can still reach it: a peer that is slow costs the rest of the run, not the call)."""
        return min(time.monotonic() + PEER_TIMEOUT_S, getattr(self.answer_by, "t", float("inf")))

    def may_send(self, msg: m.Message) -> None:
        """Whether the caller of a request with payloads (``Put``, ``PeerPut``) may send them: its
        credentials checked before the shard reads a byte of them (its operation checks again)."""
        if isinstance(msg, m.PeerPut):
            self.peer(msg.pool, "storing chunks for another shard")
        self.who(msg.credential)

    def peer(self, pool_credential: str, what: str) -> None:
        """Only the pool's own shards call the peer operations."""
        self.auth.require(pool_credential, what, "pool")

    def held(self, p: Principal, where: list[ChunkKey]) -> tuple[list[str], str | None]:
        """Where the leading run of ``where`` is: this shard's own store first (what it just
        stored may not be listed yet: its publisher is a moment behind), the index for the rest;
        one shard id per chunk of the run, and the index's error, if it failed."""
        here = self.store.contains_many(where, p.tenant)
        n = here.index(False) if False in here else len(here)
        if n == len(where):
            return [self.shard_id] * n, None
        hit = self.index.lookup(where)
        return [self.shard_id] * n + list(hit.shards[n: hit.count]), hit.error

    # ---------------------------------------------------------------- lookups and reads
    def lookup(self, msg: m.Lookup) -> dict:
        """The leading run the pool holds for the verified caller (here, then the index)."""
        p = self.who(msg.credential)
        where = addresses_of(p, msg.keys, msg.shared)
        shards, error = self.held(p, where)
        self.locations.remember(where[: len(shards)], shards)
        return {"count": len(shards), "shards": shards, "error": error}

    def get(self, msg: m.Get, into=None) -> list:
        """The leading run of the caller's chunks from wherever they are; ``into(lens)`` may give
        the buffers peers' bytes land in (the connection's staging file)."""
        t0 = time.perf_counter()
        p = self.who(msg.credential)
        where = addresses_of(p, msg.keys, msg.shared)
        recalled = False
        if msg.shards:
            located = msg.shards[: len(where)]
        else:
            located = self.locations.recall(where)
            recalled = len(located) == len(where)
            if not recalled:
                located = self.held(p, where)[0]
        out: list = []
        i = 0
        while i < len(located):
            sid, j = located[i], i
            while j < len(located) and located[j] == sid:
                j += 1
            try:
                got = self._read_run(p, sid, msg, where[i:j], msg.keys[i:j], into)
            except KvPoolError as e:
                if e.status in (401, 403):
                    raise
                log.warning("shard %s: reading %d chunks from shard %s failed (%s): a miss", self.shard_id, j - i,
                            sid, e)
                break
            out.extend(got)
            if len(got) < j - i:
                break
            i = j
        if recalled and len(out) < len(located):
            self.locations.forget(where[len(out):])  # moved or evicted: asked anew next time
        if len(out) < len(where):  # the engine read its node's share itself; the rest is a miss
            self.store.metrics.misses_chunks.inc(len(where) - len(out), p.tenant)
        self.observe_get((time.perf_counter() - t0) * 1e3)
        return out

    def _read_run(self, p: Principal, sid: str, msg: m.Get, where, raw, into) -> list:
        if sid == self.shard_id:
            got = []
            for a in self.store.get_many(where, p.tenant):
                if a is None:
                    break
                got.append(a)
            return got
        address = self.members.peer_address(sid)
        if address is None:
            return []  # not a member (dropped, or this shard has not heard of it yet): a miss
        return self.links.fetch(address, m.PeerGet(self.links.credential, msg.credential, list(raw), msg.shared),
                                self.peer_deadline(), into=into)

    def peer_get(self, msg: m.PeerGet):
        """Another shard's read of a tenant's chunks held here: (result, payloads, release)."""
        self.peer(msg.pool, "reading chunks for another shard")
        p = self.who(msg.credential)
        hold, places = self.store.lease_reads(addresses_of(p, msg.keys, msg.shared), p.tenant)
        buf = self.store.slab("dram").buf
        payloads = [buf[pl.offset: pl.offset + pl.nbytes] for pl in places if pl is not None]
        sums = [int(pl.checksum) for pl in places if pl is not None]
        return {"checksums": sums}, payloads, lambda: self.store.release(hold)

    def verify(self, msg: m.Verify) -> int:
        """Chunks an engine found corrupt here: each read and checked again by the store, which
        drops the ones that fail (and the index forgets them); good ones stay."""
        p = self.who(msg.credential)
        where = addresses_of(p, msg.keys, msg.shared)
        held = self.store.contains_many(where, p.tenant)
        got = self.store.get_many(where, p.tenant, touch=False)
        self.forget_gone()
        return sum(h and g is None for h, g in zip(held, got))

    def touch(self, msg: m.Touch) -> int:
        """Same-node hits an engine read from the slab itself (kvpool.node.touches)."""
        p = self.who(msg.credential)
        return self.store.touch(addresses_of(p, msg.keys, msg.shared), p.tenant)

    # ---------------------------------------------------------------- requests in flight
    def begin(self, msg: m.Begin) -> dict:
        """Leases the caller's cached leading run on every shard that holds some until ``end``, and
        begins the request on this shard in any case (the chunks it writes here join it). Best
        effort: a shard that does not answer leaves its chunks unleased (a later miss)."""
        p = self.who(msg.credential)
        if not msg.keys:  # no chunk to lease and none its writes could add: nothing is kept anywhere
            return {"requests": {}, "count": 0}
        where = addresses_of(p, msg.keys, msg.shared)
        located = self.held(p, where)[0]
        by_shard: dict[str, list[int]] = {self.shard_id: []}  # begun here always: the request's writes join it
        for i, sid in enumerate(located):
            by_shard.setdefault(sid, []).append(i)
        ids = {}
        for sid, idx in by_shard.items():
            raw = [msg.keys[i] for i in idx]
            try:
                if sid == self.shard_id:
                    ids[sid] = self._begin_here(p, [where[i] for i in idx], msg.priority)
                elif (address := self.members.peer_address(sid)) is not None:
                    ids[sid] = int(self.links.call(address, m.PeerBegin(self.links.credential, msg.credential, raw,
                                                                        msg.shared, msg.priority), (),
                                                   self.peer_deadline()))
            except KvPoolError as e:
                if e.status in (401, 403, 404) or sid == self.shard_id:  # here first: a 429 here begins nothing
                    raise
                log.warning("shard %s: leasing on shard %s failed (%s)", self.shard_id, sid, e)
        return {"requests": ids, "count": len(located)}

    def _begin_here(self, p: Principal, where, priority: str | None) -> int:
        """A request of ``p`` in flight here, leasing the leading run of ``where`` (its tenant's caps
        checked first: a refused begin keeps nothing)."""
        self.open_requests.take(p.tenant)
        try:
            self.open_leases.take(p.tenant, len(where))
        except KvPoolError:
            self.open_requests.give(p.tenant)
            raise
        try:
            req = self.store.begin(p.tenant, where, priority)
        except BaseException:
            self.open_requests.give(p.tenant)
            self.open_leases.give(p.tenant, len(where))
            raise
        self.requests[req.id] = (req, time.monotonic() + self.request_ttl_s, len(where))
        return req.id

    def peer_begin(self, msg: m.PeerBegin) -> int:
        self.peer(msg.pool, "leasing chunks for another shard's request")
        p = self.who(msg.credential)
        return self._begin_here(p, addresses_of(p, msg.keys, msg.shared), msg.priority)

    def end(self, msg: m.End) -> None:
        p = self.who(msg.credential)
        for sid, rid in msg.requests.items():
            if sid == self.shard_id:
                self.end_here(rid, p.tenant)
            elif (address := self.members.peer_address(sid)) is not None:
                try:
                    self.links.call(address, m.PeerEnd(self.links.credential, msg.credential, rid), (),
                                    self.peer_deadline())
                except KvPoolError as e:  # the lease expires on its own
                    log.debug("shard %s: ending request %d on %s failed (%s)", self.shard_id, rid, sid, e)

    def peer_end(self, msg: m.PeerEnd) -> bool:
        self.peer(msg.pool, "ending another shard's request")
        return self.end_here(msg.request_id, self.who(msg.credential).tenant)

    def end_here(self, request_id: int, tenant: str | None) -> bool:
        """Ends a request of ``tenant`` (None: whoever's, the shard's own housekeeping); False when
        unknown (expired, begun before a restart) or another tenant's."""
        entry = self.requests.get(request_id)
        if entry is None or (tenant is not None and entry[0].tenant != tenant):
            return False
        if self.requests.pop(request_id, None) is not None:  # once, though two calls race
            self.open_requests.give(entry[0].tenant)
            self.open_leases.give(entry[0].tenant, entry[2])
        self.store.end(entry[0])
        return True

    def joined_request(self, request_id: int | None, tenant: str):
        """The request in flight a write joins (its chunks stay leased until it ends); None for one
        this shard does not know or another tenant's: the write goes on, unleased."""
        entry = self.requests.get(request_id) if request_id is not None else None
        return None if entry is None or entry[0].cancelled or entry[0].tenant != tenant else entry[0]

    def expire_requests(self) -> None:
        now = time.monotonic()
        for rid, (req, deadline, _) in list(self.requests.items()):
            if deadline < now or req.cancelled:
                log.warning("shard %s: request %d %s", self.shard_id, rid, "cancelled" if req.cancelled else "expired")
                self.end_here(rid, None)

    # ---------------------------------------------------------------- pins, stats, reports
    def pin(self, msg: m.Pin) -> int:
        """Pins the leading run on the shards that hold it (an operator's warm-up)."""
        p = self.auth.require(msg.credential, "pinning (warm-up)")
        where = addresses_of(p, msg.keys, msg.shared)
        located = self.held(p, where)[0]
        pinned = 0
        for sid in dict.fromkeys(located):
            idx = [i for i, x in enumerate(located) if x == sid]
            try:
                if sid == self.shard_id:
                    pinned += self.store.pin([where[i] for i in idx], p.tenant)
                elif (address := self.members.peer_address(sid)) is not None:
                    pinned += int(self.links.call(address, m.PeerPin(self.links.credential, msg.credential,
                                                                     [msg.keys[i] for i in idx], msg.shared), (),
                                                  self.peer_deadline()))
            except KvPoolError as e:
                if e.status in (401, 403):
                    raise
                log.warning("shard %s: pinning on shard %s failed (%s)", self.shard_id, sid, e)
        return pinned

    def peer_pin(self, msg: m.PeerPin) -> int:
        self.peer(msg.pool, "pinning chunks for another shard")
        p = self.auth.require(msg.credential, "pinning (warm-up)")
        return self.store.pin(addresses_of(p, msg.keys, msg.shared), p.tenant)

    def report(self, msg: m.Report) -> None:
        """An engine's figures to the controller, only with a credential of this pool (any: the
        engine's), shown with its tenant; a tenant's engines on this shard are capped (429)."""
        p = self.auth.verify(msg.credential)
        self.engines.admit(p.tenant, msg.name, msg.figures)
        self.members.report(msg.name, {**msg.figures, "tenant": p.tenant})

    def open_stats(self) -> dict:
        """Per kind, what each tenant keeps open here (requests, their leases, reservations), the
        cap and how many asks it refused."""
        return {"requests": self.open_requests.stats(), "leases": self.open_leases.stats(),
                "reservations": self.open_reservations.stats()}

    def free_pages(self) -> int:
        """Of this shard's DRAM tier (placement: a node without room spills to one with room)."""
        c = self.store._cache
        return c.tier_pages[0] - c.tier_used(0)

    # ---------------------------------------------------------------- publishing
    def publish(self, addresses: list[ChunkKey]) -> None:
        """Lists the committed chunks among ``addresses`` in the index (bytes are in place) and
        drops what the store lost; a tenant the index refuses (over its quota across the pool)
        has those chunks removed here, and the 429 raised (kvpool.cluster.publisher)."""
        from kvpool.errors import QuotaExceeded

        entries = self.store.index_entries(self.shard_id, addresses)
        if entries and self.fenced:
            raise Unavailable(f"shard {self.shard_id} was dropped from the pool (fenced): its chunks are not listed")
        if entries:
            try:
                self.index.publish(entries)
            except QuotaExceeded:
                for tenant in {e.tenant for e in entries}:
                    self.store.remove_many([e.key for e in entries if e.tenant == tenant], tenant)
                raise
        self.forget_gone()

    def forget_gone(self) -> None:
        gone = self.store.take_gone()
        if gone:
            self.index.remove(gone, shard=self.shard_id)

    def close(self) -> None:
        self.publisher.flush(2.0)
        self.publisher.close()
        self.links.close()

