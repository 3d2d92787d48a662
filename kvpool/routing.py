"""Prefix-aware routing: the engine instance where a request's time to first token is expected lowest.

A request's prompt is a chain of chunks (kvpool's keys: each names its whole prefix). On a given
instance each leading chunk is in one of four tiers, the cheapest that holds it:

- ``gpu``: the instance's own KV cache (vLLM's prefix cache, known from its KV events): free;
- ``node``: the pool's shard on the instance's node (shared memory);
- ``remote``: the pool's shard on another node (one network read);
- ``miss``: nowhere: this chunk and every later one are prefilled.

:class:`CostModel` turns the tokens of each tier into seconds (per-token load costs by tier and the
prefill cost per token: the figures the connectors measure for their load-or-recompute decision,
:mod:`kvpool.connectors.breakeven`), and a policy picks an instance from the chunk tiers and each
instance's backlog (the seconds of work queued ahead of a new request). The policies, side by side
in the simulator (:mod:`kvpool.sim.cluster`):

- ``round-robin``: the next instance, whatever it holds;
- ``least-loaded``: the smallest backlog;
- ``gpu-prefix``: backlog plus the prefill of what the instance's own GPU cache lacks (what KV-aware
  routers that see only engine caches do: llm-d's prefix scorer, Dynamo's KV router);
- ``tier-aware``: backlog plus the full expected cost: the GPU cache, then the node's shard, then
  the pool elsewhere, then prefill (kvpool's router).

Pure functions over plain data: no network, no engine; a tenant's chunks are looked up under its
own keys only, so a decision never depends on another tenant's prefixes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.errors import BadRequest

TIERS = ("gpu", "node", "remote", "miss")
POLICIES = ("round-robin", "least-loaded", "gpu-prefix", "tier-aware")


@dataclass(frozen=True)
class CostModel:
    """Seconds per token: of prefill, and of loading from each tier (a GPU-cache hit costs nothing)."""

    prefill_s: float
    node_s: float
    remote_s: float

    def __post_init__(self) -> None:
        if min(self.prefill_s, self.node_s, self.remote_s) < 0:
            raise BadRequest(f"CostModel: costs are seconds per token, never negative ({self})")

    def seconds(self, tokens: dict[str, int]) -> float:
        """The time to first token's work for ``tokens`` by tier (queueing not included)."""
        return (tokens.get("node", 0) * self.node_s + tokens.get("remote", 0) * self.remote_s
                + tokens.get("miss", 0) * self.prefill_s)


@dataclass(frozen=True)
class Instance:
    """An engine instance as the router sees it: its name, its node, and its backlog in seconds."""

    name: str
    node: str
    backlog_s: float = 0.0


def tiers(chunk_tokens: Sequence[int], in_gpu: Callable[[int], bool], pool_node: Callable[[int], str | None],
          node: str) -> dict[str, int]:
    """Tokens by tier of one request on an instance of ``node``: ``chunk_tokens[j]`` is chunk j's
    length; ``in_gpu(j)`` whether the instance's own cache holds chunk j, ``pool_node(j)`` the node
    whose shard holds it (None: not in the pool). A chunk nowhere is a miss, and so is every later
    one (each names its whole prefix)."""
    out = dict.fromkeys(TIERS, 0)
    for j, n in enumerate(chunk_tokens):
        if in_gpu(j):
            out["gpu"] += n
            continue
        at = pool_node(j)
        if at is None:
            out["miss"] += sum(chunk_tokens[j:])
            break
        out["node" if at == node else "remote"] += n
    return out


def gpu_only(t: dict[str, int]) -> dict[str, int]:
    """What a router that sees only engine caches expects: every token not in the GPU cache is prefilled."""
    return {"gpu": t["gpu"], "node": 0, "remote": 0, "miss": t["node"] + t["remote"] + t["miss"]}


class Router:
    """Picks an instance for each request under one policy; ``choose`` is all a caller needs.

    The two prefix policies route under a bound on load: an instance whose share of the work
    recently sent (its expected seconds, decayed over the last ~``memory`` requests per instance)
    is above ``balance`` times the mean plus one mean request (``mean_s``) is passed over, so that
    a popular prefix cannot pile its whole conversation tree onto the instances that hold it (as
    consistent hashing with bounded loads does for keys; SGLang's cache-aware router falls back to
    the shortest queue alike). Equal
    expectations go to the more local copy, then to the instance sent the least work lately."""

    def __init__(self, policy: str, cost: CostModel, balance: float = 1.25, memory: int = 64) -> None:
        if policy not in POLICIES:
            raise BadRequest(f"routing policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if balance < 1 or memory < 1:
            raise BadRequest(f"route: balance {balance} must be >= 1 and memory {memory} >= 1 request")
        self.policy, self.cost, self.balance, self.memory = policy, cost, balance, memory
        self._next = 0
        self.sent: list[float] = []  # recent expected work routed to each instance, seconds
        self.mean_s, self._routed = 0.0, 0  # a routed request's expected work (a moving mean), how many routed

    def choose(self, instances: Sequence[Instance], tokens: Sequence[dict[str, int]],
               usable: Sequence[bool] | None = None) -> int:
        """The index of the instance to send the request to; ``tokens[i]``: its tokens by tier on
        instance i (:func:`tiers`); ``usable[i]`` False: instance i is down or already failed this
        request (its balance memory is kept for when it is back). Round-robin and least-loaded take
        instances (least-loaded: its ties) in turn."""
        n = len(instances)
        if not instances or len(tokens) != n or (usable is not None and len(usable) != n):
            raise BadRequest(f"route: {n} instances and {len(tokens)} tier counts; need one per instance")
        ok = [i for i in range(n) if usable is None or usable[i]]
        if not ok:
            raise BadRequest("route: no usable instance to choose from")
        if self.policy == "round-robin":
            start = self._next
            i = min(ok, key=lambda i: (i - start) % n)
            self._next = (i + 1) % n
            return i
        if self.policy == "least-loaded":  # ties (idle instances) taken in turn
            start = self._next
            self._next = (self._next + 1) % n
            return min(ok, key=lambda i: (instances[i].backlog_s, (i - start) % n))
        view = gpu_only if self.policy == "gpu-prefix" else (lambda t: t)
        if len(self.sent) != n:
            self.sent = [0.0] * n
        # NOTE: the bound leaves room for one request more than ``balance`` times the mean (a mean
        # request's expected work): with few instances or few requests sent yet, one cold prefill
        # must not push a conversation off the instance that holds it
        cap = self.balance * sum(self.sent[i] for i in ok) / len(ok) + self.mean_s
        allowed = [i for i in ok if self.sent[i] <= cap] or ok
        expect = [self.cost.seconds(view(tokens[i])) for i in allowed]
        # NOTE: an equal expectation goes to the more local copy (a GPU hit, then the node's shard: a
        # tier measured at no cost is still never cheaper than the one before it), then to the
        # instance sent the least work lately (new prefixes spread out, so their continuations
        # need not move later)
        k = min(range(len(allowed)), key=lambda j: (instances[allowed[j]].backlog_s + expect[j],
                                                   tokens[allowed[j]].get("remote", 0), tokens[allowed[j]].get("node", 0),
                                                   self.sent[allowed[j]]))
        keep = 1 - 1 / (self.memory * n)
        self.sent = [x * keep for x in self.sent]
        self.sent[allowed[k]] += expect[k]
        self.mean_s += (expect[k] - self.mean_s) / min(self._routed + 1, self.memory)
        self._routed += 1
        return allowed[k]
