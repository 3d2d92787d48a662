"""Requests in flight: their chunks stay leased until they end, or until the store cancels the
lowest-priority one to make room."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.errors import BadRequest, RequestCancelled
from kvpool.keys import ChunkKey, as_keys
from kvpool.tenants import PRIORITY_CLASSES, priority_rank


@dataclass(slots=True)
class ActiveRequest:
    """A request in flight: its chunks are leased until it ends, or until the pool cancels it."""

    id: int
    tenant: str
    priority: int
    started: float
    nodes: list[int] = field(default_factory=list)
    cancelled: bool = False

    def check(self) -> None:
        if self.cancelled:
            raise RequestCancelled(self.id, self.tenant, self.priority)


class RequestsMixin:
    # ------------------------------------------------------------------ requests in flight

    def begin(self, tenant: str, keys: Sequence[ChunkKey] = (), priority: str | None = None) -> ActiveRequest:
        """Registers a request in flight and leases the leading run of its chunks that the tenant
        can see; they stay until ``end``. ``priority`` defaults to the tenant's class."""
        t_idx = self.tenants.index(tenant)
        if priority is not None and (not isinstance(priority, str) or priority not in PRIORITY_CLASSES):
            raise BadRequest(f"priority must be one of {PRIORITY_CLASSES} or None (the tenant's), got {priority!r}")
        rank = priority_rank(priority or self.tenants.by_index(t_idx).priority)
        keys = as_keys(keys)
        with self._lock:
            req = ActiveRequest(next(self._requests), tenant, rank, time.monotonic())
            for k in keys:
                node = self._visible(self._cache.index.get(k), t_idx)
                if node is None:
                    break
                self._cache.res.leases[node] += 1
                req.nodes.append(node)
            self._active[req.id] = req
        return req

    def end(self, request: ActiveRequest) -> None:
        """The request finished (or gave up): its chunks may be evicted again."""
        if not isinstance(request, ActiveRequest):
            raise BadRequest(f"end takes the request begin() returned, got {type(request).__name__}")
        with self._lock:
            if self._active.pop(request.id, None) is not None:
                for n in request.nodes:
                    self._unlease(n)
            request.nodes = []
            self._maybe_wake_evictor()

    def active_requests(self) -> list[ActiveRequest]:
        with self._lock:
            return list(self._active.values())

    def _lowest_priority_request(self) -> ActiveRequest | None:
        """The request to cancel when nothing else can be freed: the lowest priority class, and in
        it the youngest (it has done the least work). Only requests that hold pages count."""
        holding = [r for r in self._active.values() if r.nodes]
        if not holding:
            return None
        return min(holding, key=lambda r: (r.priority, -r.started, -r.id))

    def _cancel(self, request: ActiveRequest) -> None:
        request.cancelled = True
        del self._active[request.id]
        for n in request.nodes:
            self._unlease(n)
        request.nodes = []
        self.metrics.cancelled_requests.inc(1, request.tenant)
