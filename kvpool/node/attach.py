"""What a NodeClient maps of its node's shard: the node file's info, the page table, the slab."""

from __future__ import annotations

import fcntl
import os
import time

from kvpool.node.table import PageTable
from kvpool.node.trust import check_file
from kvpool.slab import Slab


class Attached:
    """The shard a client currently maps: its info, page table and slab."""

    def __init__(self, info: dict, node_path: str) -> None:
        self.info = info
        self.node_path = node_path
        self.stat = node_stat(node_path)
        check_file(info["table"], "the page table")  # this user's, in a private dir (kvpool.node.trust)
        check_file(info["slab"], "the slab")
        self.table = PageTable.attach(info["table"])
        self._fd = os.open(info["table"], os.O_RDONLY)
        self.epoch = self.table.epoch
        self.slab = Slab.attach(info["slab"], info["page_bytes"], info["dram_pages"])
        self.checked = time.monotonic()

    def alive(self) -> bool:
        """Whether the shard that wrote the table still runs: it holds an exclusive lock on the
        file for its whole life (cluster/node_server.py), so a shared lock taken here means it
        died, even by SIGKILL, and even in another PID namespace."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        os.close(self._fd)
        self.table.close(unlink=False)
        self.slab.close()


def node_stat(path: str):
    """What tells one node file from the next one under the same name (a restarted shard's)."""
    try:
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns
    except OSError:
        return None
