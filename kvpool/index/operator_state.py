"""The operator's quotas and priorities as a pool process last saw them in the index, re-applied
when the index comes back without them (a Redis restarted empty, a restarted index actor).

The pool's processes reach Redis as the ``shard`` user (kvpool.index.redis_acl), which may create a
tenant that does not exist yet (create-only) and never change a quota or priority: so a tenant must
be re-created with the operator's values from the start, since whoever re-creates it first fixes
them. Every pool process that creates tenants (each shard as it joins and rejoins, the controller on
Ray) keeps the values it last saw (:meth:`OperatorState.observe`, at every heartbeat or pass) and
re-creates each tenant with them (:meth:`OperatorState.wanted`): the operator's `kvpool tenants
set-quota` and `set-priority` as seen then, else the pool's own config as `kvpool up` got it, else
unlimited and normal. So they all write the same values, whichever comes first, and no role gains
a right: the shard user still cannot change a quota that exists.

Kept in the process's memory: a change the operator made within one heartbeat (a few seconds)
before the index restarted may be lost with it; a pool process that restarts sees the values again
from the index, or from its config.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvpool.index.base import TenantInfo
from kvpool.tenants import UNLIMITED


class OperatorState:
    """``{tenant: (quota, priority)}`` as last seen in the index."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def observe(self, tenants: Iterable[TenantInfo]) -> None:
        """What the index lists now. A tenant it no longer lists keeps its values here: an index
        that restarted empty lists none, and those values are what it gets back."""
        with self._lock:
            self._seen.update({t.id: (int(t.quota), str(t.priority)) for t in tenants})

    def wanted(self, tenant: str, config: dict | None = None) -> tuple[int, str]:
        """(quota, priority) that ``tenant`` is created with: as last seen in the index, else as
        ``config`` (its entry in the pool's config, as `kvpool up` got it) names them, else
        unlimited and normal."""
        with self._lock:
            seen = self._seen.get(tenant)
        if seen is not None:
            return seen
        config = config or {}
        return config.get("quota_bytes", UNLIMITED), config.get("priority", "normal")

    def seen(self) -> dict[str, tuple[int, str]]:
        with self._lock:
            return dict(self._seen)
