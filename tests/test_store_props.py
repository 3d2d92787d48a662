"""Property test of the chunk store: random sequences of writes (over-long chains included),
reservations committed, aborted or expired, requests in flight, reads and leases, removals and
evictions, on small stores with and without a disk tier, under every eviction policy that evicts.
After every step the bookkeeping holds; once everything is released no page, lease or charge is
left over, every tenant can still write, and removing every chunk frees every page."""

import tempfile
import time

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import ChunkStore, PoolFull, StoreConfig, Tenant, TenantRegistry
from kvpool.errors import RequestCancelled
from kvpool.keys import ChunkKey
from kvpool.policies import registry

PAGE = 64
TENANTS = ("a", "b")
# reject never evicts (a full pool stays full); the default policy is drawn most often
POLICIES = ["density", "density"] + sorted(n for n in registry() if n != "reject")
EXTRA = [0, 1, 3, -1, -3, -8]  # chunks past the pool's pages: chains that just fit, outgrow it, or are short


def payload_of(key: ChunkKey, n: int) -> np.ndarray:
    seed = int.from_bytes(bytes(key)[:4], "little")
    return ((np.arange(n) * 13 + seed) % 251).astype(np.uint8)


class StoreMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(POLICIES), dram=st.integers(3, 8), disk=st.sampled_from([0, 0, 3, 6]),
                scrub=st.booleans())
    def start(self, policy, dram, disk, scrub):
        self.dir = tempfile.TemporaryDirectory()
        tenants = TenantRegistry([Tenant("a", scrub=scrub), Tenant("b")])
        self.s = ChunkStore(StoreConfig(PAGE, dram, disk, self.dir.name if disk else None, policy=policy,
                                        high_watermark=0.75, low_watermark=0.5), tenants)
        self.capacity = dram + disk
        self.next_key = 0
        self.sizes: dict[bytes, int] = {}  # every key ever written -> its payload's size
        self.chains = {t: [] for t in TENANTS}  # per tenant: the last key of each chain written
        self.leases: list = []  # Lease and ChunkView objects this test holds
        self.read_holds: list[int] = []  # lease_reads ids
        self.writes: list[tuple[int, int]] = []  # reservations not yet committed: (hold, placements)
        self.requests: list = []

    def keys(self, n):
        out = [ChunkKey(i.to_bytes(16, "little")) for i in range(self.next_key, self.next_key + n)]
        self.next_key += n
        return out

    def depth(self, key):
        """The resident chain ending at ``key``, in chunks."""
        res, n, depth = self.s._cache.res, self.s._cache.index.get(key), 0
        while n is not None and n >= 0:
            depth, n = depth + 1, res.parent[n]
        return depth

    def chain_end(self, tenant, data):
        """The end of one of the tenant's chains (the latest first), to write under; None: a new one."""
        ends = self.chains[tenant]
        return ends[-1 - data.draw(st.integers(0, len(ends) - 1))] if ends else None

    # ---------------------------------------------------------------- writes
    @rule(tenant=st.sampled_from(TENANTS), extra=st.sampled_from(EXTRA), chain=st.booleans(), data=st.data())
    def put(self, tenant, extra, chain, data):
        n = max(1, self.capacity + extra)  # from short writes to prompts longer than the pool
        keys = self.keys(n)
        sizes = [data.draw(st.integers(1, PAGE)) for _ in keys]
        parent = self.chain_end(tenant, data) if chain else None
        live = [r for r in self.requests if r.tenant == tenant and not r.cancelled]
        req = data.draw(st.sampled_from([None] + live)) if live else None
        res = self.s._cache.res
        free = not any(res.leases)  # nothing anywhere holds a page: this write must find room
        room = self.capacity - sum(res.pinned) - (self.depth(parent) if parent is not None else 0)
        if parent is not None and not self.s.contains(parent, tenant):
            room = 0  # nothing is stored under a prefix that is gone (it could never be reached)
        if req is not None:  # its chunks stay leased, so in the top tier, beside the parent the write leases
            room = min(room, self.s._cache.tier_pages[0] - sum(res.pinned) - (parent is not None))
        try:
            stored = self.s.put_many(keys, [payload_of(k, m) for k, m in zip(keys, sizes)], tenant,
                                     parent=parent, request=req)
        except (PoolFull, RequestCancelled):
            assert not free, "a write refused by a pool that holds no lease"
            stored = [self.s.contains(k, tenant) for k in keys]
        assert stored == sorted(stored, reverse=True), stored  # a leading run, never a gap
        assert room or not any(stored), "stored under a prefix that is gone"
        if free and self.s.config.policy != "density-admit":  # (it may decline a request on purpose)
            assert sum(stored) >= min(n, room), (sum(stored), n, room)  # what fits is stored
        self.sizes.update((bytes(k), m) for k, m in zip(keys, sizes))
        self.chains[tenant].append(keys[max(sum(stored) - 1, 0)])

    @rule(tenant=st.sampled_from(TENANTS), extra=st.sampled_from(EXTRA), data=st.data())
    def reserve(self, tenant, extra, data):
        n = max(1, self.capacity + extra)
        keys = self.keys(n)
        sizes = [data.draw(st.integers(1, PAGE)) for _ in keys]
        parent = self.chain_end(tenant, data)
        try:
            hid, places = self.s.reserve(keys, sizes, tenant, parent=parent)
        except (PoolFull, RequestCancelled):
            return
        self.sizes.update((bytes(k), m) for k, m in zip(keys, sizes))
        slab = self.s.slab("dram").buf
        for pl in places:  # the writer's own copy into the mapped slab
            slab[pl.offset: pl.offset + pl.nbytes] = payload_of(pl.key, pl.nbytes)
        self.writes.append((hid, places))
        if places:
            self.chains[tenant].append(places[-1].key)

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), how=st.sampled_from(["commit", "commit-part", "abort", "expire"]))
    def finish_write(self, data, how):
        from kvpool.checksum import checksum

        hid, places = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        if how == "abort":
            self.s.abort(hid)
        elif how == "expire":
            self.writes.append((hid, places))
            self.s.expire_holds(now=time.monotonic() + 3600)  # every hold's owner is gone
            self.writes.clear()
            self.read_holds.clear()
        else:
            done = places if how == "commit" else places[: len(places) // 2]
            assert self.s.commit(hid, [checksum(payload_of(pl.key, pl.nbytes)) for pl in done]) == len(done)

    # ---------------------------------------------------------------- requests, reads, leases
    @rule(tenant=st.sampled_from(TENANTS), data=st.data())
    def begin(self, tenant, data):
        chain = data.draw(st.sampled_from(self.chains[tenant])) if self.chains[tenant] else None
        self.requests.append(self.s.begin(tenant, [chain] if chain is not None else []))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def end(self, data):
        self.s.end(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    @precondition(lambda self: self.sizes)
    @rule(tenant=st.sampled_from(TENANTS), data=st.data(), how=st.sampled_from(["get", "read", "lease", "hold"]))
    def read(self, tenant, data, how):
        k = ChunkKey(data.draw(st.sampled_from(sorted(self.sizes))))
        if how == "get":
            got = self.s.get(k, tenant)
            assert got is None or np.array_equal(got, payload_of(k, self.sizes[bytes(k)]))
        elif how == "read":
            view = self.s.read(k, tenant)
            if view is not None:
                assert np.array_equal(view.data, payload_of(k, self.sizes[bytes(k)]))
                self.leases.append(view)
        elif how == "lease":
            self.leases.append(self.s.lease([k], tenant))
        else:
            self.read_holds.append(self.s.lease_reads([k], tenant)[0])

    @precondition(lambda self: self.leases or self.read_holds)
    @rule(data=st.data())
    def release(self, data):
        if self.leases and data.draw(st.booleans()):
            self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1))).release()
        elif self.read_holds:
            self.s.release(self.read_holds.pop())

    @precondition(lambda self: self.sizes)
    @rule(tenant=st.sampled_from(TENANTS), data=st.data())
    def remove(self, tenant, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.sizes)), max_size=4))
        self.s.remove_many([ChunkKey(k) for k in keys], tenant)

    @rule()
    def evict(self):
        self.s.evict_to_low_watermark()

    # ---------------------------------------------------------------- what must always hold
    @invariant()
    def bookkeeping_holds(self):
        if not hasattr(self, "s"):
            return
        held = sum(len(x) for x in self.leases)
        check_store(self.s, held)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        for x in self.leases:
            x.release()
        for h in self.read_holds:
            s.release(h)
        for hid, _ in self.writes:
            s.abort(hid)
        for r in self.requests:
            s.end(r)
        check_store(s, 0)
        c = s._cache
        assert not any(c.res.leases), "a lease outlived everything that held one"
        # every tenant keeps writing: a pool's worth of new chunks each, none refused
        for t in TENANTS:
            for k in self.keys(self.capacity):
                s.put(k, payload_of(k, PAGE), t)  # PoolFull here is the frozen store
        check_store(s, 0)
        for t in TENANTS:  # everything removed: every page free again, no charge left
            s.remove_many(list(c.index), t)
        assert [c.tier_used(t) for t in range(len(c.pages))] == [0] * len(c.pages)
        assert all(s.tenants.usage(t) == 0 for t in TENANTS)
        s.close()
        self.dir.cleanup()


def check_store(s, held_by_test: int) -> None:
    """The store's bookkeeping: pages used are resident chunks, leases are what holds them, every
    tenant's usage is its resident bytes plus its open reservations' charge, and prefix links
    count only resident children."""
    with s._lock:
        c, res = s._cache, s._cache.res
        resident = [n for n in range(c.capacity) if c.node_key[n] is not None]
        for t in range(len(c.pages)):
            assert c.tier_used(t) == sum(1 for n in resident if c.node_tier[n] == t), "a page without a chunk"
        assert all(c.index[c.node_key[n]] == n for n in resident if not s._doomed[n])
        kids = [0] * c.capacity
        for n in resident:
            if res.parent[n] >= 0:
                kids[res.parent[n]] += 1
        assert kids == list(res.children), "a prefix counts a child that is not resident"
        owed = sum(len(r.nodes) for r in s._active.values()) + sum(len(h.nodes) for h in s._holds.values())
        assert sum(res.leases) == owed + held_by_test, (sum(res.leases), owed, held_by_test)
        assert all(res.leases[n] for n in resident if s._doomed[n])
        for i, ten in enumerate(s.tenants):
            ready = sum(int(s._nbytes[n]) for n in resident if s._ready[n] and s._tenant[n] == i)
            pending = sum(h.charged for h in s._holds.values() if h.kind == "write" and h.t_idx == i)
            assert s.tenants.usage(ten.id) == ready + pending, (ten.id, s.tenants.usage(ten.id), ready, pending)


TestStore = StoreMachine.TestCase
TestStore.settings = settings(max_examples=200, stateful_step_count=25, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
