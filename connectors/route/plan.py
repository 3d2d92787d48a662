"""What the router knows of one request before it picks an instance: its tenant, its prompt's
tokens (rendered by :mod:`.render`), and where the pool holds each of the prompt's leading chunks.

The tenant comes from the request's ``cache_salt`` exactly as the engines' connector reads it
(:class:`kvpool.connectors.tenancy.Tenancy` over the same config: a salt that is no tenant's
secret is not cached, and is then routed on load alone). The chunk keys are made in that tenant's
namespace with the engines' spec (:mod:`kvpool.connectors.route.spec`), and the pool is asked with
the tenant's credential (one lookup, through the router's node's shard, which checks it): a
tenant's decision reads only its own prefixes. An index that does not answer leaves
``error`` set and the request is routed by load (least-loaded), never failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.connectors.route.gpu import GpuView, block_chain
from kvpool.routing import TIERS


@dataclass
class Plan:
    tenant: str | None = None  # the tenant's id; None: not cached (no secret of a tenant, or no tokens)
    tokens: list[int] | None = None
    chunk_tokens: int = 0
    where: list[frozenset[str]] = field(default_factory=list)  # shards holding each leading chunk's slices
    error: str | None = None  # the index could not answer
    _chains: dict[int, list[int]] = field(default_factory=dict)

    @property
    def whole(self) -> int:
        return len(self.tokens) // self.chunk_tokens if self.tokens and self.chunk_tokens else 0

    def chain(self, size: int) -> list[int]:
        if size not in self._chains:
            self._chains[size] = block_chain(self.tenant, self.tokens, size) if self.tenant and self.tokens else []
        return self._chains[size]

    def tiers_on(self, shard: str, view: GpuView | None) -> dict[str, int]:
        """The prompt's tokens by tier on an instance whose node's shard is ``shard`` and whose GPU
        cache is ``view``: its own cache's leading blocks, then the pool's leading chunks beyond them
        (a chunk whose every slice is on ``shard`` from the node, else from another node), the rest
        computed. As the engine does: it loads from the pool only what its own cache lacks."""
        n = len(self.tokens or ())
        out = {**dict.fromkeys(TIERS, 0), "miss": n}
        if not self.tenant or not n:
            return out
        pos = 0
        if view is not None and view.block_size:
            pos = min(n, view.leading(self.chain(view.block_size)) * view.block_size)
        out["gpu"] = pos
        ct = self.chunk_tokens
        for j, holders in enumerate(self.where):
            hi = (j + 1) * ct
            if hi > pos:
                out["node" if holders == {shard} else "remote"] += hi - max(j * ct, pos)
                pos = hi
        out["miss"] = n - pos
        return out


class Planner:
    """``pool``: a SlicedPool of the engines' spec over the router's node (None: no prefix lookups)."""

    def __init__(self, tenancy, pool=None, chunk_tokens: int = 256) -> None:
        self.tenancy, self.pool, self.chunk_tokens = tenancy, pool, chunk_tokens

    def route(self, body: dict):
        """The tenancy's route of the request's ``cache_salt`` (None: no tenant's, not cached)."""
        return self.tenancy.route(body.get("cache_salt"), request="(router)")

    def plan(self, route, tokens: list[int] | None, adapter: str = "") -> Plan:
        """Blocking (one pool lookup): run it off the event loop. ``route``: :meth:`route`'s."""
        p = Plan(chunk_tokens=self.chunk_tokens)
        if route is None or not tokens:
            return p
        p.tokens, p.tenant = tokens, route.tenant
        if self.pool is None or not p.whole:
            return p
        try:
            keys = self.pool.keys(route.pool_as, p.tokens[: p.whole * self.chunk_tokens], adapter_id=adapter)
            p.where, p.error = self.pool.locate(route.pool_as, keys)
        except Exception as e:  # noqa: BLE001 - a pool that cannot answer: routed on load
            p.where, p.error = [], str(e) or type(e).__name__
        return p
