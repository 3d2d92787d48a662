"""Same-node hits, told to the shard: an engine reads its node's chunks from the slab itself (no
call), so the shard would not know they were used. Each read's keys are gathered here and sent
in one ``touch`` call per caller every ``EVERY_S`` from a daemon thread, off the read's path: the
shard counts them as hits and its eviction policy sees them as it sees reads through the shard
(a chunk read only from shared memory is not evicted as if it were never read). Best effort: a
shard that does not answer loses those touches, never a read.
"""

from __future__ import annotations

import threading

from kvpool.errors import KvPoolError
from kvpool.node import messages as m

EVERY_S = 0.2
MAX_PENDING = 8 * m.MAX_KEYS  # keys waiting; more are dropped (counted) until the next send


class Touches:
    def __init__(self, connection) -> None:
        self.connection = connection  # a kvpool.node.connection.NodeConnection
        self._pending: dict[tuple[str, bool], list[bytes]] = {}
        self._n = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.sent = self.dropped = 0
        self._thread: threading.Thread | None = None

    def add(self, credential: str, keys: list[bytes], shared: bool) -> None:
        with self._lock:
            if self._n + len(keys) > MAX_PENDING:
                self.dropped += len(keys)
                return
            self._pending.setdefault((credential, shared), []).extend(keys)
            self._n += len(keys)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="kvpool-touches")
                self._thread.start()

    def flush(self) -> None:
        """Sends what is pending now (tests, close)."""
        with self._lock:
            pending, self._pending, self._n = self._pending, {}, 0
        for (credential, shared), keys in pending.items():
            for i in range(0, len(keys), m.MAX_KEYS):
                try:
                    self.connection.call(m.Touch(credential, keys[i: i + m.MAX_KEYS], shared))
                    self.sent += len(keys[i: i + m.MAX_KEYS])
                except KvPoolError:
                    self.dropped += len(keys[i: i + m.MAX_KEYS])

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(EVERY_S):
            self.flush()
