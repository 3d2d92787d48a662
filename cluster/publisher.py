"""Publishing a node's writes to the index just after their commit, off the engine's path.

An engine's write through its node's shard (cluster/service_writes.py) is committed in the store (findable
on this node at once, through the page table) and answered; this thread then publishes what
accumulated in one index call. The rules stay: bytes before index (only committed chunks are
published), and the index charges the tenant's quota atomically as it publishes. A tenant the
index refuses (over its quota across the pool) has those chunks removed here, and its next write
on this node is refused with that 429 until a publish of its goes through again (or
``REFUSED_S`` passes). An index that is down leaves the chunks stored and unlisted: the shard's
reconcile lists them when it is back.
"""

from __future__ import annotations

import logging
import threading
import time

from kvpool.errors import KvPoolError, QuotaExceeded

log = logging.getLogger("kvpool.shard")
REFUSED_S = 5.0
# NOTE: the thread gathers for this long after a commit before publishing: a stream of writes is
# published in a few batches instead of one index call per write, which competed with the writes'
# own handling for the shard process's interpreter. Other nodes see a chunk this much later.
LINGER_S = 0.005


class Publisher:
    def __init__(self, service) -> None:
        self.service = service  # cluster.service.ShardService
        self._pending: list = []
        self._cv = threading.Condition()
        self._refused: dict[str, tuple[QuotaExceeded, float]] = {}
        self.published = 0
        self.batches = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvpool-publisher")
        self._thread.start()

    def enqueue(self, keys: list) -> None:
        if keys:
            with self._cv:
                self._pending.extend(keys)
                self._cv.notify()

    def refused(self, tenant: str) -> QuotaExceeded | None:
        """The 429 the index gave ``tenant``'s last publish here, while it holds."""
        hit = self._refused.get(tenant)
        if hit is None or time.monotonic() > hit[1]:
            return None
        return hit[0]

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until what was enqueued so far is published (tests, drain)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    _busy = False

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
            time.sleep(LINGER_S)  # more commits join this batch meanwhile
            with self._cv:
                keys, self._pending = self._pending, []
                self._busy = True
            try:
                self._publish(keys)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _publish(self, keys: list) -> None:
        shard = self.service
        try:
            shard.publish(keys)
            self.published += len(keys)
            self.batches += 1
            for e in shard.store.index_entries(shard.shard_id, keys[:1]):
                self._refused.pop(e.tenant, None)
        except QuotaExceeded as e:  # publish removed the refused chunks from the store
            self._refused[e.tenant] = (e, time.monotonic() + REFUSED_S)
            log.warning("shard %s: the index refused %d chunks of tenant %s (over its quota): removed",
                        shard.shard_id, len(keys), e.tenant)
        except KvPoolError as e:  # the index is down: stored, unlisted until the next reconcile
            log.warning("shard %s: publishing %d chunks failed (%s); the next reconcile lists them",
                        shard.shard_id, len(keys), e)
        except Exception:  # noqa: BLE001 - the thread must survive anything
            log.exception("shard %s: publishing failed", shard.shard_id)
