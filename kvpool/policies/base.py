"""What every eviction policy sees, and the one interface they implement.

The same policy objects run inside the chunk store (per tier) and inside the trace simulator
(`kvpool sim`), so a hit rate measured by the simulator is the hit rate of the code the pool
runs. A policy orders slots (pages); the shared ``Residency`` says which slots may be evicted at
all: a leased slot (being read, or part of a request in flight) never, a pinned slot never, and a
slot with resident children never before them (evicting a middle chunk orphans its suffix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

NO_PARENT = -1


@dataclass(slots=True)
class Access:
    """One request as a policy sees it."""

    request_id: int
    now: float  # seconds
    num_blocks: int  # chunks the request's prompt spans (the last may be partial)
    full_blocks: int  # whole chunks; only these can come back as a prefix of a later prompt
    hit_blocks: int = 0  # leading run already resident
    tenant: int = 0
    priority: int = 1  # 0 low, 1 normal, 2 high
    attention: list[float] | None = None  # per chunk attention mass in [0, 1], when the engine reports it


class Residency:
    """Prefix links, leases and pins of every slot of one cache (a tier, or a simulated cache).

    Plain Python lists: scalar access to them is several times faster than to numpy arrays, and
    they are allocated once.
    """

    __slots__ = (
        "capacity", "parent", "children", "leases", "pinned", "depth", "request", "tenant", "resident", "key",
        "first_child", "next_sib", "prev_sib", "last_child", "lease_skips", "guard",
    )

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.parent = [NO_PARENT] * capacity
        self.children = [0] * capacity
        self.leases = [0] * capacity
        self.pinned = [False] * capacity
        self.depth = [0] * capacity
        self.request = [0] * capacity
        self.tenant = [0] * capacity
        self.resident = [False] * capacity
        self.key: list[object] = [None] * capacity  # the chunk's key: policies with ghosts remember it
        # Children as an intrusive doubly linked list, oldest first, so that a cold prefix can be
        # emptied from its leaves up without scanning.
        self.first_child = [NO_PARENT] * capacity
        self.last_child = [NO_PARENT] * capacity
        self.next_sib = [NO_PARENT] * capacity
        self.prev_sib = [NO_PARENT] * capacity
        self.lease_skips = 0  # eviction candidates passed over because they were leased
        # Set by the owner while a write makes room: False for chunks it must not drop (another
        # tenant's guaranteed share).
        self.guard = None

    def add(self, slot: int, parent: int, depth: int, request: int, tenant: int, key: object = None) -> None:
        assert not self.resident[slot], slot
        self.resident[slot] = True
        self.parent[slot] = parent
        self.children[slot] = 0
        self.leases[slot] = 0
        self.pinned[slot] = False
        self.depth[slot] = depth
        self.request[slot] = request
        self.tenant[slot] = tenant
        self.key[slot] = key
        self.first_child[slot] = self.last_child[slot] = NO_PARENT
        self.next_sib[slot] = NO_PARENT
        if parent != NO_PARENT:
            self.children[parent] += 1
            last = self.last_child[parent]
            self.prev_sib[slot] = last
            if last == NO_PARENT:
                self.first_child[parent] = slot
            else:
                self.next_sib[last] = slot
            self.last_child[parent] = slot
        else:
            self.prev_sib[slot] = NO_PARENT

    def _unlink_from_parent(self, slot: int) -> None:
        p = self.parent[slot]
        if p == NO_PARENT:
            return
        self.children[p] -= 1
        prev, nxt = self.prev_sib[slot], self.next_sib[slot]
        if prev == NO_PARENT:
            self.first_child[p] = nxt
        else:
            self.next_sib[prev] = nxt
        if nxt == NO_PARENT:
            self.last_child[p] = prev
        else:
            self.prev_sib[nxt] = prev
        self.parent[slot] = NO_PARENT

    def remove(self, slot: int) -> None:
        assert self.resident[slot] and self.children[slot] == 0, (slot, self.children[slot])
        self.resident[slot] = False
        self._unlink_from_parent(slot)
        self.key[slot] = None

    def detach_children(self, slot: int) -> None:
        """Cuts every child of ``slot`` loose (when a parent must go anyway, e.g. a corrupted
        chunk: its suffix can no longer be reached and ages out as roots of their own)."""
        c = self.first_child[slot]
        while c != NO_PARENT:
            nxt = self.next_sib[c]
            self._unlink_from_parent(c)
            self.prev_sib[c] = self.next_sib[c] = NO_PARENT
            c = nxt
        assert self.children[slot] == 0

    def leaf_under(self, slot: int, limit: int = 4096) -> int | None:
        """An evictable leaf of ``slot``'s subtree (oldest branches first), or None. Visits at most
        ``limit`` nodes: a subtree that busy is not cold anyway. A leased or pinned chunk stays,
        but its suffixes may go (a chain being extended leases its parent, not the parent's other
        branches)."""
        stack = [slot]
        seen = 0
        while stack and seen < limit:
            s = stack.pop()
            seen += 1
            if self.children[s] == 0:
                if self.leases[s] or self.pinned[s] or (self.guard is not None and not self.guard(s)):
                    continue
                return s
            # push youngest first so the oldest child is explored first
            c = self.last_child[s]
            while c != NO_PARENT:
                stack.append(c)
                c = self.prev_sib[c]
        return None

    def evictable(self, slot: int) -> bool:
        """May be dropped: not leased, not pinned, and no resident suffix depends on it."""
        return self.children[slot] == 0 and self.leases[slot] == 0 and not self.pinned[slot]

    def movable(self, slot: int) -> bool:
        """May be demoted to a lower tier: a suffix stays reachable through a demoted prefix."""
        return self.leases[slot] == 0 and not self.pinned[slot]


class Policy(ABC):
    """An eviction (and admission) policy over the slots of one cache.

    Events, in the order the cache sends them for a request:
    ``admit`` then ``on_insert`` for each new chunk, root to leaf (the cache stops at the first
    chunk not admitted: a suffix without its prefix is unreachable); then ``on_access`` once with
    all of the request's resident slots, root to leaf (hits first). ``victims`` is asked whenever
    the cache needs a free slot; ``on_remove`` follows every removal, whoever decided it.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, capacity: int, residency: Residency) -> None:
        self.capacity = capacity
        self.res = residency
        # The cache sets this False for every tier but the last: victims there are demoted, not
        # dropped, so the prefix rule does not hold them back.
        self.drops = True

    def can_evict(self, slot: int) -> bool:
        res = self.res
        if res.leases[slot]:
            res.lease_skips += 1
            return False
        if not self.drops:
            return res.movable(slot)
        return res.evictable(slot) and (res.guard is None or res.guard(slot))

    def movable(self, slot: int) -> bool:
        """Leased or pinned chunks stay; a prefix of resident chunks may be named (the cache then
        evicts its suffix's leaves first)."""
        res = self.res
        if res.leases[slot]:
            res.lease_skips += 1
            return False
        if res.pinned[slot]:
            return False
        return not self.drops or res.guard is None or res.guard(slot)

    def admit(self, position: int, access: Access, parent: int, key: object) -> bool:
        """Whether to store the request's chunk at ``position`` (it was not resident), under the
        resident ``parent`` (NO_PARENT for a root) with ``key``."""
        return True

    @abstractmethod
    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        """A chunk arrived: stored by a request (``access``), or moved here from another tier
        (``access`` None)."""

    @abstractmethod
    def on_access(self, slots: list[int], access: Access) -> None: ...

    @abstractmethod
    def on_remove(self, slot: int) -> None: ...

    @abstractmethod
    def victims(self) -> list[int]:
        """Slots to evict now, leaf first; each ``can_evict`` when its turn comes (the cache stops at
        the first that is not). Empty when nothing can go (the cache then refuses the write)."""

    def chain_tail(self, chains) -> list[int]:
        """For group policies: the evictable end of the first chain that has one, leaf first.
        A chain is one request's chunks, root to leaf; the run starts at its deepest chunk that can
        go and stops at the first that cannot: leased, pinned, guarded, or with a child other than
        the one chosen below it (a suffix of another request, or one still being written). Chunks
        past a gap (one removed) are not each other's prefix. In a tier that demotes rather than
        drops, a chunk that cannot move is passed over: the chain stays reachable."""
        res = self.res
        drops, guard = self.drops, res.guard
        for chain in chains:
            out: list[int] = []
            for s in reversed(chain):
                if res.leases[s] or res.pinned[s]:
                    if out and drops:
                        break
                    continue
                if drops:
                    below = 1 if out and res.parent[out[-1]] == s else 0  # the child already chosen
                    if res.children[s] != below or (guard is not None and not guard(s)):
                        if out:
                            break
                        continue  # NOTE: a prefix of a chunk in use; a chunk above a gap may still go
                out.append(s)
            if out:
                return out
        return []

    def on_leaf(self, slot: int) -> None:  # noqa: B027 - optional hook, a no-op for scanning policies
        """``slot`` has no resident child any more (its last one left, from whichever tier, or a
        chunk being inserted under it found no room): a policy that set it aside while it had
        children takes it back now. Without this a prefix set aside is never offered again."""

    def skip(self, slot: int) -> None:  # noqa: B027 - optional hook, a no-op for scanning policies
        """The cache could not evict ``slot`` or anything under it just now (its suffix is in use):
        do not offer it first again. Queue policies rotate it; scanning ones need nothing."""

    def on_pin(self, slot: int) -> bool:
        """An operator asks to pin ``slot``; True if pinned. Only zoned policies pin."""
        return False

    def stats(self) -> dict:
        return {}
