"""``density``: evict the chunk with the fewest expected hits per slot and per unit of time.

LHD's ranking (Beckmann et al., NSDI'18), learned online from what the pool itself sees, over
classes that only a prefix pool knows:

- the chunk's *turn*: whether its conversation has come back. A chunk stored under a leaf that an
  earlier request stored extends that chain: one turn deeper than its parent. A chunk stored under
  a prefix that already has a continuation (a shared system prompt, a document) starts a new
  conversation at turn 0. A request's chunks all take the turn of its deepest one. On Mooncake's
  conversation trace a conversation comes back after its first turn 31% of the time, after its
  second 42%, from its sixth on 75%; finer turn classes (0, 1, 2, 3+) measured no better;
- its *reuse count*: how often it was found already resident (0, 1, 2+).

Per class, a histogram of the age (blocks accessed since the chunk's last use) at which chunks
were used again, and of the age at which they were given up on, gives for each age ``a`` the
*hit density*: the chance of one more use given the chunk reached ``a``, over the slots x time it
will hold until then. Evicted and declined chunks are remembered (ghosts, 4x the capacity): one
that comes back is a use at its true age; one that leaves is recorded at once as given up at the
age its ghost will be forgotten, and that record is taken back if it returns first. So the
histograms measure the workload, not only what the policy already keeps, and stay balanced while
they decay.

Chunks of a class sit in one queue in order of last use. Eviction looks at the oldest chunk of
each queue and, among those within ``margin`` (25%) of the lowest density, drops the least
recently used: a density estimate that small a step apart may be noise, and LRU's order is the
better guess then (docs/eviction.md measures both). A prefix named while its suffix is resident waits outside its queue until its last
child goes. A prompt's trailing partial chunk is never stored (a later prompt reuses it only by
repeating the prompt exactly). Before the histograms have data every class has the same
density, falling with age: the policy starts as LRU. The histograms decay, so the ranking
follows the workload.

``density-admit`` adds admission control: when the cache is full, a request whose chunks' class
is worth less at age 0 than the chunk that would be evicted for them is not stored (its first
chunk is remembered as a ghost, so the class keeps being measured). More hits on the conversation
trace, but below LRU in a tiny cache of large chunks (docs/eviction.md): opt-in.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.policies.base import NO_PARENT, Access, Policy, Residency
from kvpool.policies.links import SlotLists

TURNS = 2  # turn classes: a new conversation (0), one that came back (1+)
COUNTS = 3  # reuse-count classes: 0, 1, 2+
CLASSES = TURNS * COUNTS
BUCKETS = 256  # age buckets; the last holds everything older, ranked below everything


def class_of(turn: int, count: int) -> int:
    return (turn if turn < TURNS else TURNS - 1) * COUNTS + (count if count < COUNTS else COUNTS - 1)


class DensityPolicy(Policy):
    name = "density"
    description = ("hit density per slot and time (LHD) learned online over conversation-turn and reuse-count "
                   "classes; skips partial chunks")

    def __init__(self, capacity: int, residency: Residency, width: float = 0.25, decay: float = 0.9,
                 period: float = 1.0, ghosts: float = 4.0, admission: float = 0.0,
                 prior: float = 32.0, margin: float = 0.25) -> None:
        super().__init__(capacity, residency)
        self.lists = SlotLists(capacity, CLASSES)
        self.cls = [-1] * capacity
        self.last = [0] * capacity
        self.turn = [0] * capacity
        self.count = [0] * capacity
        # A prefix named for eviction while its suffix is resident leaves its queue until its last
        # child goes, then rejoins at the head (its suffix ranked lower than anything else).
        self.parked = [False] * capacity
        self.size = 0
        self.clock = 0  # blocks accessed
        self.width = max(1, int(width * capacity))  # clock ticks per age bucket
        self.hits = [[0.0] * BUCKETS for _ in range(CLASSES)]
        self.ends = [[0.0] * BUCKETS for _ in range(CLASSES)]
        self.decay = decay
        self.period = max(64, int(period * capacity))
        self.next_update = self.period
        # Until there is data: LRU (the same for every class, falling with age).
        self.density = [[1.0 / (a + 1) for a in range(BUCKETS)] for _ in range(CLASSES)]
        # key -> (class, last use, turn, count, bucket of its end, clock when remembered) of chunks
        # evicted or declined
        self.ghost: OrderedDict[object, tuple[int, int, int, int, int, int]] = OrderedDict()
        self.span = float(capacity)  # clock ticks a ghost is kept (measured)
        self.ghost_cap = max(16, int(ghosts * capacity))
        self.admission = admission
        self.prior = prior
        self.margin = margin
        self._admit_for = (-1, True)  # (request id, decision): one decision per request
        self.declined = 0

    def _age(self, slot_last: int) -> int:
        a = (self.clock - slot_last) // self.width
        return a if a < BUCKETS else BUCKETS - 1

    # ------------------------------------------------------------------ events

    def _new_turn(self, parent: int, access: Access, key: object, linked: int) -> tuple[int, int]:
        """Turn and reuse count of a chunk about to be stored under ``parent``; ``linked`` is 1
        when the chunk is already one of the parent's children (on insert), 0 before (on admit)."""
        res = self.res
        turn = 0
        if parent != NO_PARENT and self.cls[parent] >= 0:
            if res.request[parent] == access.request_id:
                turn = self.turn[parent]
            elif res.children[parent] == linked:  # the parent was a leaf: this extends its chain
                turn = self.turn[parent] + 1
        g = self.ghost.get(key)
        if g is not None:
            return max(turn, g[2] + 1), g[3] + 1
        return turn, 0

    def admit(self, position: int, access: Access, parent: int, key: object) -> bool:
        if position >= access.full_blocks:
            return False
        if not self.admission or self.size < self.capacity:
            return True
        rid, ok = self._admit_for
        if rid == access.request_id:
            return ok
        turn, count = self._new_turn(parent, access, key, 0)
        c = class_of(turn, count)
        ok = self.density[c][0] >= self.admission * self._lowest()
        self._admit_for = (access.request_id, ok)
        if not ok:
            self.declined += 1
            self._remember(key, c, self.clock, turn, count)
        return ok

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        self.parked[slot] = False
        self.size += 1
        key = self.res.key[slot]
        if access is None:  # moved here from another tier
            g = self.ghost.pop(key, None)
            turn, count = (g[2], g[3]) if g is not None else (0, 1)
        else:
            turn, count = self._new_turn(self.res.parent[slot], access, key, 1)
            g = self.ghost.pop(key, None)
        if g is not None:  # given up on too early: a use at its true age, not an end
            ends = self.ends[g[0]]
            ends[g[4]] = max(0.0, ends[g[4]] - 1.0)
            self.hits[g[0]][self._age(g[1])] += 1.0
        self.turn[slot] = turn
        self.count[slot] = count
        self.last[slot] = self.clock
        c = class_of(turn, count)
        self.cls[slot] = c
        self.lists.push_tail(c, slot)

    def on_access(self, slots: list[int], access: Access) -> None:
        if not slots:
            return
        lists, cls, last, count, hits, parked = self.lists, self.cls, self.last, self.count, self.hits, self.parked
        turns = self.turn
        turn = turns[slots[-1]]  # the deepest chunk was stored last: the conversation's turn
        clock = self.clock
        width = self.width
        fresh = self.res.request
        rid = access.request_id
        for s in reversed(slots):  # leaf first: within a queue a leaf is older than its prefix
            c = cls[s]
            if fresh[s] != rid:  # not stored by this very request: a use
                a = (clock - last[s]) // width
                hits[c][a if a < BUCKETS else BUCKETS - 1] += 1.0
                count[s] += 1
            lists.remove(s)
            parked[s] = False
            turns[s] = turn
            last[s] = clock
            c = class_of(turn, count[s])
            cls[s] = c
            lists.push_tail(c, s)
        self.clock = clock + len(slots)
        if self.clock >= self.next_update:
            self._update()

    def on_remove(self, slot: int) -> None:
        c = self.cls[slot]
        assert c >= 0, slot
        self.lists.remove(slot)
        self.size -= 1
        self._remember(self.res.key[slot], c, self.last[slot], self.turn[slot], self.count[slot])
        self.cls[slot] = -1
        self.parked[slot] = False

    def on_leaf(self, slot: int) -> None:
        if self.parked[slot]:  # its suffix is gone: ranked at the head, below everything else
            self.parked[slot] = False
            self.lists.push_head(self.cls[slot], slot)

    def _remember(self, key: object, c: int, last: int, turn: int, count: int) -> None:
        """A chunk leaves (or is not admitted): it ends at the age its ghost will be forgotten,
        unless it comes back before (recorded now, not then: the histograms decay meanwhile)."""
        ghost, clock = self.ghost, self.clock
        b = (clock + int(self.span) - last) // self.width
        b = b if b < BUCKETS - 1 else BUCKETS - 2
        self.ends[c][b] += 1.0
        ghost[key] = (c, last, turn, count, b, clock)
        if len(ghost) > self.ghost_cap:
            g = ghost.popitem(last=False)[1]
            self.span += 0.01 * ((clock - g[5]) - self.span)

    def skip(self, slot: int) -> None:
        c = self.cls[slot]
        if c >= 0 and not self.parked[slot]:
            self.lists.move_to_tail(c, slot)

    # ------------------------------------------------------------------ ranking

    def _update(self) -> None:
        """Densities from the histograms (suffix sums), then the histograms decay. Each class's
        histograms are pulled toward all classes' together by ``prior`` observations, so a class
        seen a few times ranks like the average chunk, not like its few samples."""
        self.next_update = self.clock + self.period
        d = self.decay
        all_hits = [sum(h[a] for h in self.hits) for a in range(BUCKETS)]
        all_ends = [sum(e[a] for e in self.ends) for a in range(BUCKETS)]
        total = sum(all_hits) + sum(all_ends)
        if total < 8:
            return
        w = self.prior / total
        for c in range(CLASSES):
            hits, ends = self.hits[c], self.ends[c]
            out = self.density[c]
            s_hits = s_all = s_age = 0.0
            for a in range(BUCKETS - 1, -1, -1):
                h = hits[a] + w * all_hits[a]
                t = h + ends[a] + w * all_ends[a]
                s_hits += h
                s_all += t
                s_age += t * a
                life = s_age - (a - 1) * s_all  # sum over x >= a of (x - a + 1), in buckets
                out[a] = s_hits / life if life > 0 and a < BUCKETS - 1 else 0.0
                hits[a] *= d
                ends[a] *= d

    def _lowest(self) -> float:
        """Density of the best eviction candidate now (+inf when there is none)."""
        lists, density, last, clock, width = self.lists, self.density, self.last, self.clock, self.width
        low = float("inf")
        for c in range(CLASSES):
            s = lists.head(c)
            if s is not None:
                a = (clock - last[s]) // width
                dv = density[c][a if a < BUCKETS else BUCKETS - 1]
                if dv < low:
                    low = dv
        return low

    def victims(self) -> list[int]:
        lists, density, last, clock, width = self.lists, self.density, self.last, self.clock, self.width
        res = self.res
        turned = [0] * CLASSES  # chunks sent round again per queue in this call
        slack = 1.0 + self.margin
        for _ in range(self.capacity + CLASSES):
            heads = []
            low = float("inf")
            for c in range(CLASSES):
                s = lists.head(c)
                if s is None or turned[c] >= lists.sizes[c]:
                    continue
                a = (clock - last[s]) // width
                dv = density[c][a if a < BUCKETS else BUCKETS - 1]
                heads.append((dv, s))
                if dv < low:
                    low = dv
            if not heads:
                return []
            # Among the heads within the margin of the lowest density, the least recently used.
            best, oldest = NO_PARENT, 0
            for dv, s in heads:
                if dv <= low * slack and (best == NO_PARENT or last[s] < oldest):
                    best, oldest = s, last[s]
            if self.drops and res.children[best] and not res.leases[best] and not res.pinned[best]:
                lists.remove(best)
                self.parked[best] = True
                continue
            if not self.can_evict(best):
                # NOTE: leased, pinned or guarded: it goes round again (its age is kept, so it ranks
                # where it should when it is next at the head).
                turned[self.cls[best]] += 1
                lists.move_to_tail(self.cls[best], best)
                continue
            return [best]
        return []

    def stats(self) -> dict:
        return {"declined_requests": self.declined,
                "chunks_by_class": {f"turn{c // COUNTS}-uses{c % COUNTS}": self.lists.size(c)
                                    for c in range(CLASSES) if self.lists.size(c)}}


class DensityAdmitPolicy(DensityPolicy):
    name = "density-admit"
    description = ("density with admission control: a request whose chunks rank below the next victim is not "
                   "stored; more hits on conversation traces, below LRU in tiny caches of large chunks")

    def __init__(self, capacity: int, residency: Residency, **params) -> None:
        params.setdefault("admission", 1.0)
        params.setdefault("prior", 128.0)
        super().__init__(capacity, residency, **params)
