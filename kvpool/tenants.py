"""Tenants: who owns a chunk, what namespace its keys live in, and how many bytes it may hold.

A tenant's salt enters every one of its keys (kvpool.keys.Namespace), so two tenants sending the
same prompt derive different keys and never meet in the pool. A prefix that should be shared on
purpose (a public system prompt) is keyed under ``SHARED_SALT`` and stored with ``shared=True``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import numpy as np

from kvpool.errors import BadRequest, QuotaExceeded, UnknownTenant
from kvpool.spec import STORAGE_FORMATS

SHARED_SALT = b"kvpool/shared"
UNLIMITED = 2**62

PRIORITY_CLASSES = ("low", "normal", "high")
# NOTE: the index's rule for names (kvpool.index.base.check_name): a tenant valid in one process
# is valid in a cluster's index too.
_TENANT_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant of the pool. ``salt`` defaults to the tenant id; set a secret one for isolation
    that holds even against someone who knows the tenant's name and prompts."""

    id: str
    salt: bytes = b""
    quota_bytes: int = UNLIMITED
    priority: str = "normal"
    # Instead of bytes, a share of the pool (a large customer 0.3, a small one 0.005).
    quota_fraction: float | None = None
    # Bytes no other tenant's writes can evict (a share of the pool, like quota_fraction).
    guaranteed_fraction: float = 0.0
    # Zero the tenant's pages when they are freed (evicted, removed, demoted away): no residue of
    # its KV stays in memory for the page's next owner. Costs a memset per freed chunk.
    scrub: bool = False
    # Seal the tenant's payloads (AES-256-GCM, kvpool.seal) with a key only its credential gives:
    # the pool holds ciphertext only. Needs a secured pool; costs a pass of AES-GCM per save and load.
    encrypt: bool = False
    # How this tenant's chunks are stored, overriding the connector's storage_format: "" (the
    # connector's), "raw", or a LOSSY, opt-in format (fp8, int8, int4-kivi, int2-kivi; see
    # kvpool.codec). The format is in the tenant's keys, so its chunks never meet another format's.
    storage_format: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _TENANT_ID.fullmatch(self.id):
            raise BadRequest(
                f"tenant id must be 1-128 characters of letters, digits and _ . : @ -, got {self.id!r}"
            )
        if not isinstance(self.salt, bytes):
            raise BadRequest(
                f"tenant {self.id!r}: salt must be bytes (b'' for the default), got {type(self.salt).__name__}"
            )
        if not isinstance(self.quota_bytes, int) or isinstance(self.quota_bytes, bool) or self.quota_bytes < 0:
            raise BadRequest(f"tenant {self.id!r}: quota_bytes must be an int >= 0, got {self.quota_bytes!r}")
        if self.priority not in PRIORITY_CLASSES:
            raise BadRequest(f"tenant {self.id!r}: priority must be one of {PRIORITY_CLASSES}, got {self.priority!r}")
        for name in ("quota_fraction", "guaranteed_fraction"):
            v = getattr(self, name)
            if (v is not None or name == "guaranteed_fraction") and not (
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
            ):
                raise BadRequest(f"tenant {self.id!r}: {name} must be a fraction of the pool in [0, 1], got {v!r}")
        if not isinstance(self.scrub, bool):
            raise BadRequest(f"tenant {self.id!r}: scrub must be true or false, got {self.scrub!r}")
        if not isinstance(self.encrypt, bool):
            raise BadRequest(f"tenant {self.id!r}: encrypt must be true or false, got {self.encrypt!r}")
        if self.storage_format and self.storage_format not in STORAGE_FORMATS:
            raise BadRequest(f"tenant {self.id!r}: storage_format {self.storage_format!r} is not one of "
                             f"{STORAGE_FORMATS} ('' for the connector's)")
        if self.salt == SHARED_SALT:
            raise BadRequest(f"tenant {self.id!r}: the shared salt is reserved; pick another salt")
        if not self.salt:
            object.__setattr__(self, "salt", b"tenant/" + self.id.encode())


def priority_rank(priority: str) -> int:
    return PRIORITY_CLASSES.index(priority)


class TenantRegistry:
    """Registered tenants and their byte usage, indexed by a small int for the hot path."""

    def __init__(self, tenants: list[Tenant] | tuple[Tenant, ...] = ()) -> None:
        self._lock = threading.Lock()
        self.pool_bytes = 0  # set by the store: what quota and guarantee fractions are of
        self._by_id: dict[str, int] = {}
        self._tenants: list[Tenant] = []
        self._usage = np.zeros(16, dtype=np.int64)
        for t in tenants:
            self.add(t)

    def add(self, tenant: Tenant) -> int:
        """Registers (or updates the quota and priority of) a tenant; returns its index."""
        if not isinstance(tenant, Tenant):
            raise BadRequest(f"TenantRegistry.add takes a Tenant, got {type(tenant).__name__}: wrap ids as Tenant(id)")
        with self._lock:
            idx = self._by_id.get(tenant.id)
            if idx is not None:
                if self._tenants[idx].salt != tenant.salt:
                    raise BadRequest(
                        f"tenant {tenant.id!r} is registered with another salt; a salt cannot change "
                        "while the tenant has chunks (its keys would change)"
                    )
                self._tenants[idx] = tenant
                return idx
            idx = len(self._tenants)
            if idx == self._usage.shape[0]:
                self._usage = np.concatenate([self._usage, np.zeros_like(self._usage)])
            self._tenants.append(tenant)
            self._by_id[tenant.id] = idx
            return idx

    def index(self, tenant_id: str) -> int:
        try:
            idx = self._by_id.get(tenant_id)
        except TypeError:  # unhashable
            idx = None
        if idx is None:
            if not isinstance(tenant_id, str):
                raise BadRequest(f"a tenant id is a string, got {type(tenant_id).__name__}")
            raise UnknownTenant(tenant_id)
        return idx

    def get(self, tenant_id: str) -> Tenant:
        return self._tenants[self.index(tenant_id)]

    def by_index(self, idx: int) -> Tenant:
        return self._tenants[idx]

    def __iter__(self):
        return iter(list(self._tenants))

    def __len__(self) -> int:
        return len(self._tenants)

    def usage(self, tenant_id: str) -> int:
        return int(self._usage[self.index(tenant_id)])

    def limit(self, idx: int) -> int:
        t = self._tenants[idx]
        if t.quota_fraction is not None:
            return int(t.quota_fraction * self.pool_bytes)
        return t.quota_bytes

    def guarantee(self, idx: int) -> int:
        return int(self._tenants[idx].guaranteed_fraction * self.pool_bytes)

    @property
    def any_guarantee(self) -> bool:
        return any(t.guaranteed_fraction for t in self._tenants)

    def usage_of(self, idx: int) -> int:
        return int(self._usage[idx])

    def charge(self, idx: int, nbytes: int) -> None:
        """Adds ``nbytes`` to a tenant's usage, or raises QuotaExceeded (429) and changes nothing."""
        with self._lock:
            t = self._tenants[idx]
            used = int(self._usage[idx])
            limit = self.limit(idx)
            if used + nbytes > limit:
                raise QuotaExceeded(t.id, used, limit, nbytes)
            self._usage[idx] = used + nbytes

    def refund(self, idx: int, nbytes: int) -> None:
        with self._lock:
            self._usage[idx] -= nbytes
            assert self._usage[idx] >= 0, (self._tenants[idx].id, int(self._usage[idx]))
