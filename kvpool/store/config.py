"""The store's configuration: the sizes of its tiers, their eviction policy and the watermarks of
background eviction."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

from kvpool.errors import BadRequest
from kvpool.policies import policy_class
from kvpool.spec import DEFAULT_HIGH_WATERMARK


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Sizes of the node's tiers and their eviction policy. ``page_bytes`` is the largest payload
    one chunk may have."""

    page_bytes: int
    dram_pages: int
    disk_pages: int = 0
    disk_dir: str | None = None
    pin_memory: bool | None = None  # None: pin when CUDA is present
    # Put the DRAM slab in a named file under this directory (e.g. /dev/shm) so that clients on
    # the same node map it and read and write pages directly (reserve/commit, lease_reads).
    dram_dir: str | None = None
    name: str = "store"
    policy: str = "default"
    policy_params: dict = field(default_factory=dict)
    # Background eviction: starts when a tier is fuller than high_watermark, stops at
    # low_watermark. None: the default of the storage format (DEFAULT_HIGH_WATERMARK), and 10
    # points below it.
    storage_format: str = "raw"
    high_watermark: float | None = None
    low_watermark: float | None = None
    background_eviction: bool = False
    # NOTE: read leases of other processes cost their tenant nothing, and a leased chunk cannot
    # be evicted: without a bound one tenant could lease the whole pool again and again and stop
    # every other tenant's writes. Beyond its share, a tenant's read is a miss; holds expire.
    max_read_hold_fraction: float = 0.5
    max_hold_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.disk_pages and not self.disk_dir:
            raise BadRequest("disk_pages > 0 needs disk_dir: the directory of the disk tier's file")
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,200}", self.name):
            raise BadRequest(
                f"store name {self.name!r} must be 1-200 letters, digits or _ . : @ - (it names slab files)"
            )
        if not isinstance(self.policy, str):
            raise BadRequest(f"policy must be a policy's name, got {type(self.policy).__name__}")
        cls = policy_class(self.policy)  # a clear error now rather than at the first eviction
        if not isinstance(self.policy_params, dict):
            raise BadRequest(
                f"policy_params must be a dict of keyword arguments, got {type(self.policy_params).__name__}"
            )
        try:
            inspect.signature(cls).bind(1, None, **self.policy_params)
        except TypeError:
            raise BadRequest(
                f"policy_params {sorted(self.policy_params)} do not fit policy {self.policy!r}: it takes "
                f"{list(inspect.signature(cls).parameters)[2:]}"
            ) from None
        if not isinstance(self.storage_format, str) or self.storage_format not in DEFAULT_HIGH_WATERMARK:
            raise BadRequest(f"storage_format {self.storage_format!r} is not one of {sorted(DEFAULT_HIGH_WATERMARK)}")
        for name in ("high_watermark", "low_watermark"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                raise BadRequest(f"{name} must be a fraction of a tier in (0, 1] or None, got {v!r}")
        f = self.max_read_hold_fraction
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
            raise BadRequest(f"max_read_hold_fraction must be a share of the pool in (0, 1], got {f!r}")
        t = self.max_hold_ttl_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
            raise BadRequest(f"max_hold_ttl_s must be a finite number of seconds > 0, got {t!r}")
        high, low = self.watermarks
        if not 0 < low < high <= 1:
            raise BadRequest(f"watermarks must satisfy 0 < low < high <= 1, got low={low}, high={high}")

    @property
    def watermarks(self) -> tuple[float, float]:
        high = self.high_watermark if self.high_watermark is not None else DEFAULT_HIGH_WATERMARK[self.storage_format]
        low = self.low_watermark if self.low_watermark is not None else round(high - 0.10, 4)
        return high, low
