"""The shard's drills: fault injection and inspection for tests and staging, answered only when the
shard was started with KVPOOL_DRILLS=1 (a mixin of cluster.shard.ShardActor)."""

from __future__ import annotations

import os

from kvpool.errors import Forbidden
from kvpool.keys import ChunkKey

DRILLS_ENV = "KVPOOL_DRILLS"


class Drills:
    # ---------------------------------------------------------------- drills
    # NOTE: drills stall the data path and list or locate every tenant's chunks, so a shard
    # answers them only when it was started with KVPOOL_DRILLS=1 (tests, staging): in production
    # any process that can reach the actor could otherwise slow the pool or map its contents.
    def _drill(self, what: str, credential: str) -> None:
        self.auth.require(credential, what)
        if os.environ.get(DRILLS_ENV) != "1":
            raise Forbidden(f"{what} is a drill and drills are off on shard {self.shard_id}: start the pool with "
                            f"{DRILLS_ENV}=1 (tests and staging only)")

    def inject(self, stall_s: float = 0.0, credential: str = "") -> None:
        """Fault injection for drills and tests: every data-path call answers ``stall_s`` late
        (0 clears it). Membership and stats calls are not slowed."""
        self._drill("inject", credential)
        self.service.stall_s = float(stall_s)

    def held(self, credential: str = "") -> list[bytes]:
        """Keys of the chunks this shard holds (to check that the index converged on them)."""
        self._drill("held", credential)
        return [bytes(e.key) for e in self.store.index_entries(self.shard_id)]

    def locate(self, key, credential: str = "") -> tuple[str, int, int] | None:
        """(tier, byte offset in its slab, bytes) of a chunk (its address in the store, as the
        index lists it), for drills that corrupt a payload."""
        self._drill("locate", credential)
        key = ChunkKey(bytes(key))
        where, entries = self.store.locate(key), self.store.index_entries(self.shard_id, [key])
        if where is None or not entries:
            return None
        return where[0], where[1] * self.store.page_bytes, entries[0].nbytes
