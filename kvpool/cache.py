"""TieredCache: which chunk lives where. Keys, tiers, prefix links, leases, pins and policies.

This is the metadata half of a chunk store, with no bytes: the store (kvpool.store) drives it
and moves payloads through its hooks, and the trace simulator (kvpool.sim) drives the very same
object with no payloads at all. So the eviction decisions the simulator measures are the ones
the pool makes.

Each resident chunk is a *node* (an id stable while it is resident, even when it moves between
tiers); a node lives on one *page* of one tier. Prefix links, leases and pins are per node
(``Residency``), and each tier's policy orders that tier's nodes. Room is made by asking the
tier's policy for victims: from every tier but the last a victim is demoted to the next tier,
from the last it is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvpool.allocator import PageAllocator
from kvpool.errors import PoolFull
from kvpool.policies.base import NO_PARENT, Access, Policy, Residency


class CacheHooks:
    """What the owner of the bytes does when the cache moves or drops a chunk. Defaults: nothing
    (the simulator)."""

    def move(self, node: int, src_tier: int, src_page: int, dst_tier: int, dst_page: int) -> bool:
        """Copies a chunk's bytes to another page; False if they failed verification."""
        return True

    def dropped(self, node: int, tier: int, page: int, reason: str) -> None:
        """The chunk on ``node`` is gone (``reason``: "evicted", "removed", "corrupt")."""


PolicyFactory = Callable[[int, Residency, int], Policy]  # (capacity, residency, tier) -> policy


class TieredCache:
    def __init__(self, tier_pages: list[int], make_policy: PolicyFactory, hooks: CacheHooks | None = None) -> None:
        assert tier_pages and all(n >= 0 for n in tier_pages), tier_pages
        total = sum(tier_pages)
        self.tier_pages = list(tier_pages)
        self.capacity = total
        self.res = Residency(total)
        self.hooks = hooks if hooks is not None else CacheHooks()
        self.nodes = PageAllocator(total)
        self.pages = [PageAllocator(n) for n in tier_pages]
        self.policies = [make_policy(total, self.res, t) for t in range(len(tier_pages))]
        for p in self.policies[:-1]:
            p.drops = False
        self.node_tier = [0] * total
        self.node_page = [0] * total
        self.node_key: list[Hashable | None] = [None] * total
        self.index: dict[Hashable, int] = {}
        self.counts = {"evicted": 0, "demoted": 0, "promoted": 0, "refused": 0, "not_admitted": 0}

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self.index)

    def find(self, key: Hashable) -> int | None:
        return self.index.get(key)

    def leading_run(self, keys: list) -> list[int]:
        """Nodes of the leading run of resident keys."""
        out = []
        index = self.index
        for k in keys:
            n = index.get(k)
            if n is None:
                break
            out.append(n)
        return out

    def tier_used(self, tier: int) -> int:
        return self.pages[tier].num_used

    # ------------------------------------------------------------------ requests

    def insert(self, key: Hashable, parent: int, position: int, access: Access, raise_full: bool = False,
               admit: bool = True) -> int | None:
        """Stores a new chunk in the top tier; its node, or None when the policy does not admit it
        or nothing can be evicted (the caller stops storing this request: a suffix without its
        prefix is unreachable; with ``raise_full`` the latter raises PoolFull). The new node is
        leased (its bytes are not in place yet); the caller releases it when they are."""
        assert key not in self.index, key
        policy = self.policies[0]
        if admit and not policy.admit(position, access, parent, key):
            self.counts["not_admitted"] += 1
            return None
        res = self.res
        if parent != NO_PARENT:
            res.children[parent] += 1  # making room must not drop the parent (moving it is fine)
        failed = True
        try:
            page = self._alloc_page(0)
            failed = False
        except PoolFull:
            self.counts["refused"] += 1
            if raise_full:
                raise
            return None
        finally:
            if parent != NO_PARENT:
                res.children[parent] -= 1
                if failed and not res.children[parent]:  # a leaf again (its child never came): a policy
                    self.policies[self.node_tier[parent]].on_leaf(parent)  # that set it aside takes it back
        node = self.nodes.alloc()
        assert node is not None
        self.node_tier[node] = 0
        self.node_page[node] = page
        self.node_key[node] = key
        self.index[key] = node
        self.res.add(node, parent, position, access.request_id, access.tenant, key)
        self.res.leases[node] += 1
        policy.on_insert(node, position, access)
        return node

    def access(self, nodes: list[int], access: Access) -> None:
        """One request touched these resident nodes (root to leaf); each tier's policy hears of
        its own."""
        if len(self.policies) == 1:
            self.policies[0].on_access(nodes, access)
            return
        by_tier: dict[int, list[int]] = {}
        for n in nodes:
            by_tier.setdefault(self.node_tier[n], []).append(n)
        for t, ns in by_tier.items():
            self.policies[t].on_access(ns, access)

    def serve(self, keys: list, access: Access, run: list[int] | None = None, *, hold: bool = False,
              keep: bool = True, transient: list[int] | None = None) -> list[int]:
        """Serves one request for ``keys`` (root to leaf); returns its resident nodes, root to leaf.

        The resident leading run ``run`` (default: ``leading_run(keys)``) is leased while the request
        is in flight and promoted to the top tier; the rest is inserted root to leaf, each chunk
        under the one before it (a chunk found resident past a gap is chained through as it is);
        then the policies hear of the whole request once (``access``).

        ``hold`` False, a request that is over at once (the simulator): the policy decides
        admission, storing stops at the first chunk it declines or that finds no room, and every
        lease is released before this returns.

        ``hold`` True, a request that stays in flight (an engine's active turn): every chunk needs
        a page, so PoolFull (nothing can be evicted) propagates, with this request's leases
        released. A new chunk the policy does not admit (any new chunk unless ``keep``; the policy
        is then not asked) is stored anyway and appended to ``transient`` for the caller to drop
        when the request ends. On return every node stays leased; ``release`` them at its end.

        The store's ``put_many`` runs its own loop (see the NOTE there).
        """
        if run is None:
            run = self.leading_run(keys)
        leases = self.res.leases
        for n in run:
            leases[n] += 1
        if len(self.pages) > 1:
            for n in run:
                self.promote(n)
        nodes = list(run)
        held = nodes if hold else list(run)  # what this call has leased
        parent = run[-1] if run else NO_PARENT
        index = self.index
        insert = self.insert
        admit = self.policies[0].admit
        try:
            for pos in range(len(run), len(keys)):
                key = keys[pos]
                n = index.get(key)
                if n is not None:  # resident past a gap: chain through it as it is
                    leases[n] += 1
                    if not hold:
                        held.append(n)
                elif not hold:
                    n = insert(key, parent, pos, access)
                    if n is None:
                        break
                    leases[n] -= 1  # written; the prefix rule holds it from now on
                else:
                    kept = keep and admit(pos, access, parent, key)
                    n = insert(key, parent, pos, access, raise_full=True, admit=False)
                    assert n is not None
                    if not kept:
                        assert transient is not None
                        transient.append(n)
                nodes.append(n)
                parent = n
        except PoolFull:
            self.release(held)
            raise
        self.access(nodes, access)
        if not hold:
            self.release(held)
        return nodes

    def release(self, nodes: list[int]) -> None:
        """Ends one lease on each of ``nodes``."""
        leases = self.res.leases
        for n in nodes:
            leases[n] -= 1

    def promote(self, node: int) -> bool:
        """Moves a node of a lower tier to the top tier (a hit there). False when it stays: the top
        tier cannot make room, or the bytes failed verification (then the node is dropped)."""
        t = self.node_tier[node]
        if t == 0:
            return True
        res = self.res
        res.leases[node] += 1  # making room above must not pick it
        try:
            page = self._alloc_page(0)
        except PoolFull:
            return False
        finally:
            res.leases[node] -= 1
        if not self.hooks.move(node, t, self.node_page[node], 0, page):
            self.pages[0].free(page)
            self.drop(node, "corrupt")
            return False
        self.policies[t].on_remove(node)
        self.pages[t].free(self.node_page[node])
        self.node_tier[node] = 0
        self.node_page[node] = page
        self.policies[0].on_insert(node, res.depth[node], None)
        self.counts["promoted"] += 1
        return True

    def hide(self, node: int) -> None:
        """Makes a node unfindable now; it keeps its page until ``drop`` (after its last lease)."""
        key = self.node_key[node]
        if key is not None and self.index.get(key) == node:
            del self.index[key]

    def drop(self, node: int, reason: str) -> None:
        """Removes a node now (it must not be leased). A non-leaf loses its suffix's links."""
        res = self.res
        assert res.leases[node] == 0, node
        if res.children[node]:
            res.detach_children(node)
        t, page = self.node_tier[node], self.node_page[node]
        self.policies[t].on_remove(node)
        parent = res.parent[node]
        res.remove(node)
        if parent != NO_PARENT and not res.children[parent]:
            self.policies[self.node_tier[parent]].on_leaf(parent)
        self.pages[t].free(page)
        self.hide(node)
        self.hooks.dropped(node, t, page, reason)
        self.node_key[node] = None
        self.nodes.free(node)

    def pin(self, node: int) -> bool:
        return self.policies[self.node_tier[node]].on_pin(node)

    # ------------------------------------------------------------------ room

    def _alloc_page(self, tier: int) -> int:
        alloc = self.pages[tier]
        page = alloc.alloc()
        while page is None:
            self._make_room(tier)
            page = alloc.alloc()
        return page

    def _make_room(self, tier: int) -> None:
        policy = self.policies[tier]
        res = self.res
        last = tier + 1 == len(self.pages)
        stuck = False  # the tier below could make no room: victims here go as from the last tier
        # Each failed attempt makes the policy skip one candidate, so one pass over the tier
        # finds anything that can go.
        for _ in range(self.tier_pages[tier] + 8):
            freed = False
            victims = policy.victims()
            if not victims:
                break  # nothing can go now (no attempt changes that)
            for v in victims:
                if self.node_tier[v] != tier:
                    break
                if not policy.can_evict(v):
                    # A cold prefix with resident suffixes: its suffixes are colder still (every
                    # use of them used it), so they go first, leaves up.
                    leaf = res.leaf_under(v) if last and res.movable(v) and res.children[v] else None
                    if leaf is None or self.node_tier[leaf] != tier:
                        policy.skip(v)
                        break
                    v = leaf
                if last:
                    self.counts["evicted"] += 1
                    self.drop(v, "evicted")
                else:
                    if not stuck:
                        moved = self._demote(v)
                        stuck = moved is None
                    if stuck and not self._drop_under(v):
                        policy.skip(v)
                        break
                freed = True
            if freed:
                return
        if stuck and self._drop_any(tier):
            return
        raise PoolFull(
            f"tier {tier} is full ({self.tier_pages[tier]} pages) and nothing in it can be evicted: "
            "every chunk is leased, pinned or a prefix of one that is"
        )

    def _drop_under(self, node: int) -> bool:
        """Drops ``node``, or for a prefix a leaf of its subtree, when the tier below cannot take
        it; False when neither can go.
        NOTE: the tier below is then full of chunks that cannot go (leased, or prefixes of this
        tier's chunks: a long prompt's head demoted under its tail); this tier's leaves go, as from
        the last tier. Without this such a pool made no room ever again."""
        res = self.res
        if res.pinned[node] or res.leases[node]:
            return False
        if res.children[node]:
            node = res.leaf_under(node)
            if node is None:
                return False
        self.counts["evicted"] += 1
        self.drop(node, "evicted")
        return True

    def _drop_any(self, tier: int) -> bool:
        """The last resort of a tier whose policy kept naming chunks that could not go while the
        tier below was stuck: any leaf of the tier that may be dropped (a scan: the slow path)."""
        res, guard = self.res, self.res.guard
        for n in range(self.capacity):
            if (self.node_key[n] is not None and self.node_tier[n] == tier and res.evictable(n)
                    and (guard is None or guard(n))):
                self.counts["evicted"] += 1
                self.drop(n, "evicted")
                return True
        return False

    def _demote(self, node: int) -> bool | None:
        """Moves a node one tier down; None when the tier below has no room."""
        t = self.node_tier[node]
        res = self.res
        res.leases[node] += 1
        try:
            page = self._alloc_page(t + 1)
        except PoolFull:
            res.leases[node] -= 1
            return None
        res.leases[node] -= 1
        if not self.hooks.move(node, t, self.node_page[node], t + 1, page):
            self.pages[t + 1].free(page)
            self.drop(node, "corrupt")
            return True
        self.policies[t].on_remove(node)
        self.pages[t].free(self.node_page[node])
        self.node_tier[node] = t + 1
        self.node_page[node] = page
        self.policies[t + 1].on_insert(node, res.depth[node], None)
        self.counts["demoted"] += 1
        return True
