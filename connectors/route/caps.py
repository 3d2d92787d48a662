"""Per-tenant caps on what the router holds for requests in flight.

Each request the router holds is one tenant's (the tenant its ``cache_salt`` names; requests whose
salt is no tenant's share one bucket of their own) and costs it a request in flight and its body's
bytes, from its admission until its answer has been passed on. Past either cap the request is
refused, a 429 (:class:`CapReached`) that names the cap and the ``kvpool route`` flag raising it;
other tenants are not affected. What else the router keeps grows with the instances, not with the
requests: each instance's GPU cache view is bounded (:data:`~.gpu.MAX_BLOCKS`), its requests in
flight by these caps.
"""

from __future__ import annotations

from kvpool.errors import BadRequest, LimitExceeded

MIB = 1 << 20
NO_TENANT = "(requests whose cache_salt is no tenant's)"


class CapReached(LimitExceeded):
    """A tenant's cap in this router; ``cap``: which (``inflight``, ``body_bytes``)."""

    def __init__(self, cap: str, message: str) -> None:
        super().__init__(message)
        self.cap = cap


class _Admitted:
    def __init__(self, caps: "TenantCaps", key: str, nbytes: int) -> None:
        self.caps, self.key, self.nbytes = caps, key, nbytes

    def __enter__(self) -> "_Admitted":
        return self

    def __exit__(self, *exc) -> None:
        self.caps._release(self.key, self.nbytes)


class TenantCaps:
    def __init__(self, inflight: int = 256, body_mib: float = 256.0) -> None:
        if inflight < 1 or not body_mib > 0:
            raise BadRequest(f"--max-inflight-per-tenant {inflight}, --max-body-mib-per-tenant {body_mib}: at least "
                             "one request and a positive number of MiB")
        self.inflight, self.body_bytes = inflight, int(body_mib * MIB)
        self._held: dict[str, list[int]] = {}  # tenant -> [requests, body bytes]

    def admit(self, tenant: str | None, nbytes: int) -> _Admitted:
        """Holds one request of ``nbytes`` for ``tenant`` (None: no tenant's) until the returned
        context exits; CapReached (429) past a cap, holding nothing."""
        key = NO_TENANT if tenant is None else tenant
        held = self._held.get(key, [0, 0])
        who = key if tenant is None else f"tenant {tenant!r}"
        if held[0] + 1 > self.inflight:
            raise CapReached("inflight", f"{who} has {held[0]} requests in flight through this router, its cap: wait "
                             "for some to end, or raise the cap (kvpool route --max-inflight-per-tenant, now "
                             f"{self.inflight})")
        if held[1] + nbytes > self.body_bytes:
            raise CapReached("body_bytes", f"{who}'s requests in flight hold {held[1] / MIB:.1f} MiB of bodies in this "
                             f"router and this one {nbytes / MIB:.1f} MiB more would pass its cap of "
                             f"{self.body_bytes / MIB:g} MiB: wait for some to end, or raise the cap (kvpool route "
                             "--max-body-mib-per-tenant)")
        held[0] += 1
        held[1] += nbytes
        self._held[key] = held
        return _Admitted(self, key, nbytes)

    def _release(self, key: str, nbytes: int) -> None:
        held = self._held[key]
        held[0] -= 1
        held[1] -= nbytes
        assert held[0] >= 0 and held[1] >= 0, (key, held)
        if not held[0]:
            del self._held[key]  # no entry outlives its tenant's last request

    def figures(self) -> dict:
        return {"tenants_holding": len(self._held), "inflight_cap": self.inflight, "body_bytes_cap": self.body_bytes}
