"""The one lock `kvpool up` and `kvpool down` take on this machine, so that starting and stopping the
pool happen one at a time.

Without it, `kvpool up`s started together each found no pool running (the check and the record
written after it are minutes apart: the pool's process commits its DRAM tier first) and each
started one: pools nobody recorded, unreachable, holding their slabs. With it, the first starts
the pool and holds the lock until the pool answers and is recorded; the others wait, then find it
running (a single-node pool: refused, naming it; a pool on Ray: its head and actors, found again).
A `kvpool down` during an up waits for the up, then stops what it started.

The lock is ``fcntl.flock`` on ``up.lock`` (0600) beside the single-node pool's record
(``~/.kvpool``, or ``$KVPOOL_POOL_RECORD``'s folder): the kernel drops it with its holder, so a
killed `kvpool up` never leaves it held. The holder writes its pid and command into the file, so
a waiter says whom it waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time

from kvpool.errors import Unavailable

WAIT_S = 600.0  # the longest a `kvpool up` holds it: a Ray head's start and the shards' (120 s each), and more
NAME = "up.lock"


def lock_path() -> str:
    from kvpool.cluster.solo import record_path

    return os.path.join(os.path.dirname(record_path()), NAME)


@contextlib.contextmanager
def held(what: str, wait_s: float = WAIT_S):
    """Holds this machine's pool lock for ``what`` (e.g. "kvpool up"), waiting up to ``wait_s``
    for another holder (said once on stderr); Unavailable (503) naming the holder after that.
    Not reentrant: a process takes it once at a time."""
    path = lock_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(fd)
                if time.monotonic() >= deadline:
                    raise Unavailable(f"{what}: {holder} still starts or stops the pool on this machine after "
                                      f"{wait_s:.0f} s (lock {path}): wait for it, or stop it if it hangs") from None
                if not said:
                    print(f"kvpool: waiting for {holder} to finish starting or stopping the pool ...", file=sys.stderr)
                    said = True
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}".encode(), 0)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it: "`kvpool up` (pid 4242)"."""
    try:
        pid, _, what = os.pread(fd, 200, 0).decode(errors="replace").partition(" ")
        int(pid)
    except (OSError, ValueError):
        return "another `kvpool up` or `kvpool down`"
    return f"`{what}` (pid {pid})"
