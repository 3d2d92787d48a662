"""``importance``: evict the chunk whose reuse is worth least.

A chunk's score estimates what keeping it saves:

    score = (1 + hits) / (1 + age / tau)          how likely it comes back (frequency, recency)
          * (1 + depth * attention_cost)          what recomputing it costs (attention over its prefix)
          * (0.5 + attention)                     how much the model attends to it, when reported
          * (1 if prompt else generated_weight)   prefix chunks over generated ones

``age`` counts cache events since the chunk was last used; ``tau`` defaults to the capacity.
``attention_cost`` (1/48) is the attention-to-MLP FLOP ratio per 512-token chunk of a
4096-wide model, per chunk of depth. The lowest score of ``sample`` random candidates goes
(sampled eviction, as Redis does): no heap to keep in order on every hit.
"""

from __future__ import annotations

import random

from kvpool.policies.base import Access, Policy, Residency


class ImportancePolicy(Policy):
    name = "importance"
    description = "lowest score first: frequency x recency x recompute cost x attention mass"

    def __init__(self, capacity: int, residency: Residency, sample: int = 16, tau: float | None = None,
                 attention_cost: float = 1 / 48, generated_weight: float = 0.5, seed: int = 0) -> None:
        super().__init__(capacity, residency)
        self.sample = sample
        self.tau = float(tau or max(capacity, 1))
        self.attention_cost = attention_cost
        self.generated_weight = generated_weight
        self.rng = random.Random(seed)
        self.clock = 0
        self.hits = [0] * capacity
        self.last = [0] * capacity
        self.attention = [0.5] * capacity
        self.generated = [False] * capacity
        self.members: list[int] = []  # for O(1) uniform sampling
        self.pos = [-1] * capacity
        # Candidates the cache could not use (a prefix whose suffix is in use) since the last time
        # victims() found none: passed over, so the lowest score cannot stand in the way for ever.
        self.skipped: set[int] = set()

    def on_insert(self, slot: int, position: int, access: Access | None) -> None:
        self.clock += 1
        self.hits[slot] = 0
        self.last[slot] = self.clock
        if access is not None:
            att = access.attention
            self.attention[slot] = att[position] if att is not None and position < len(att) else 0.5
            self.generated[slot] = position >= access.full_blocks
        self.pos[slot] = len(self.members)
        self.members.append(slot)

    def on_access(self, slots: list[int], access: Access) -> None:
        self.clock += 1
        now = self.clock
        for s in slots[: access.hit_blocks]:
            self.hits[s] += 1
        for s in slots:
            self.last[s] = now

    def skip(self, slot: int) -> None:
        self.skipped.add(slot)

    def on_remove(self, slot: int) -> None:
        self.skipped.discard(slot)
        i = self.pos[slot]
        last = self.members.pop()
        if last != slot:
            self.members[i] = last
            self.pos[last] = i
        self.pos[slot] = -1

    def victims(self) -> list[int]:
        members, n = self.members, len(self.members)
        if n == 0:
            return []
        movable = self.movable
        # A cache no larger than the sample is scored whole: exact, and what the tests pin.
        if n <= self.sample:
            candidates = members
        else:
            rand = self.rng.random
            candidates = [members[int(rand() * n)] for _ in range(self.sample)]
        # score = (1 + hits) / (1 + age / tau) x (1 + depth x cost) x (0.5 + attention), x the
        # generated weight for generated chunks; inlined: this loop is the policy's hot path.
        clock, tau, hits, last, att, gen = self.clock, self.tau, self.hits, self.last, self.attention, self.generated
        depth, cost, gw = self.res.depth, self.attention_cost, self.generated_weight
        best, best_score = None, float("inf")
        skipped = self.skipped
        for s in candidates:
            sc = (1 + hits[s]) / (1 + (clock - last[s]) / tau) * (1 + depth[s] * cost) * (0.5 + att[s])
            if gen[s]:
                sc *= gw
            if sc < best_score and movable(s) and (not skipped or s not in skipped):
                best, best_score = s, sc
        if best is None:  # every sample leased, pinned or passed over: look at all
            best = next((s for s in members if movable(s) and s not in skipped), None)
        if best is None and skipped:  # every candidate passed over once: start over
            skipped.clear()
            best = next((s for s in members if movable(s)), None)
        return [] if best is None else [best]
