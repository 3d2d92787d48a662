"""Small writes in one call: the engine copies its chunks into a staging file its connection
owns in the node's run dir, and one call asks the shard to take them from there.

A write through reserve and commit costs two calls on the socket; for small chunks those calls,
not the bytes, are the cost (a 256 KiB copy takes ~10 us, a call ~100 us here). So chunks that
fit ``STAGE_BYTES`` go through the connection's staging file: a plain copy on the engine's side,
then ``put_staged``: the shard reserves pages, copies the chunks from the staging file into them
computing their checksums as it copies (so the checksum is of the bytes the shard holds), commits
and answers. Larger chunks keep the one-copy path (reserve, copy into the slab, commit).

The shard creates the file (``kvpool-<pool>-stage-<token>.kvstage``, mode 0600) when a connection
first asks for it with a credential it verifies (the file is charged to that tenant, within its
cap on the node: kvpool.cluster.node_caps), reads it only at offsets it checks against its size,
and removes it when the connection closes; a dead shard's are swept by the next one. Only the
engine writes into it.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Sequence

import numpy as np

from kvpool.errors import BadRequest

STAGE_BYTES = 8 << 20
ALIGN = 64
SUFFIX = ".kvstage"


def stage_prefix(pool: str) -> str:
    return f"kvpool-{pool}-stage-"


class Stage:
    """A staging file: ``create`` (the shard, per connection) or ``attach`` (the engine)."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool) -> None:
        self.path, self._mm, self.owner = path, mm, owner
        self.buf = np.frombuffer(mm, dtype=np.uint8)
        self.nbytes = self.buf.shape[0]

    @classmethod
    def create(cls, directory: str, pool: str, nbytes: int = STAGE_BYTES) -> "Stage":
        """A new staging file of ``nbytes`` (its memory reserved now: a full run dir is an error
        here, never a SIGBUS in a copy later)."""
        path = os.path.join(directory, f"{stage_prefix(pool)}{secrets.token_hex(8)}{SUFFIX}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            return cls(path, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), owner=True)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> "Stage":
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise BadRequest(f"staging file {path} is smaller than {nbytes} B")
            return cls(path, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), owner=False)
        finally:
            os.close(fd)

    def layout(self, arrays: Sequence[np.ndarray]) -> list[int] | None:
        """Where each array goes in the file, or None when they do not fit."""
        return self.layout_from(0, [a.nbytes for a in arrays])

    def layout_from(self, start: int, sizes: Sequence[int]) -> list[int] | None:
        """Where chunks of ``sizes`` go from ``start`` on, aligned, or None when they do not fit."""
        offsets, at = [], -(-start // ALIGN) * ALIGN
        for n in sizes:
            offsets.append(at)
            at += -(-n // ALIGN) * ALIGN
        return offsets if at <= self.nbytes else None

    def fill(self, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
        for a, off in zip(arrays, offsets):
            np.copyto(self.buf[off : off + a.nbytes], a)

    def region(self, offset: object, nbytes: object) -> np.ndarray:
        """``nbytes`` at ``offset``, checked against the file (the engine's word is not trusted)."""
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, nbytes))
        if not ok or offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise BadRequest(f"staging region {offset!r}+{nbytes!r} is outside the {self.nbytes} B staging file")
        return self.buf[offset : offset + nbytes]

    def close(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
