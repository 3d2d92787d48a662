"""The chunk store, assembled from its parts over the base that owns the state and the lock."""

from __future__ import annotations

from kvpool.store.base import StoreBase
from kvpool.store.evictor import EvictorMixin
from kvpool.store.holds import HoldsMixin
from kvpool.store.hooks import HooksMixin
from kvpool.store.inspection import InspectionMixin
from kvpool.store.leases import LeasesMixin
from kvpool.store.reads import ReadsMixin
from kvpool.store.requests import RequestsMixin
from kvpool.store.writes import WritesMixin


class ChunkStore(WritesMixin, HoldsMixin, RequestsMixin, EvictorMixin, ReadsMixin, LeasesMixin, InspectionMixin,
                 HooksMixin, StoreBase):
    """One node's chunk store (see the package's docstring for the rules it keeps)."""
