"""In-place reads of a node's chunks: views of the shard's slab itself, verified after their use.

``NodeClient.get`` copies each chunk of this node out of the slab, hashing it in the same pass,
then validates the page table's slot (kvpool.node.table: ``read``). A caller that only copies the
chunk somewhere else (the vLLM worker scatters it into vLLM's paged cache) pays for that copy
twice. Here the caller gets a view of the chunk's slab page (no copy) and uses it first; the
verification runs when it releases the view, over the same bytes, in this order:

1. the caller reads the view (its scatter);
2. xxh3-64 of the view's bytes, against the checksum the table published;
3. the table slot's sequence number, against the one ``find`` saw before step 1, and the
   table's epoch (a stale table is a miss).

Why this keeps the table's guarantee
    The writer withdraws a chunk (bumping its slot's seq) BEFORE it reuses the page, and the seq
    never goes back. Step 3 comes after every read of the bytes (steps 1 and 2), so any rewrite of
    the page that overlapped the window from ``find`` to the end of step 2 changed the seq and
    fails step 3. The checksum catches what the ordering rule cannot (a writer breaking it, a
    stale table). A failed release raises :class:`ChunkChanged`: whatever the caller made of the
    view is not the chunk, and it must treat that chunk (and the run after it) as a failed load.
    A view that was never released was never verified.

Only for callers that can take a chunk back after using it (the vLLM worker reports the blocks of
a failed load to vLLM, which recomputes them); every other read copies (``NodeClient.get``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvpool.checksum import checksum
from kvpool.errors import Unavailable
from kvpool.keys import is_shared
from kvpool.node.table import PageTable
from kvpool.node.table_file import Entry

# Tests only: called as ``before_verify(view)`` between the caller's use of a view and its
# verification (to rewrite a page or withdraw a chunk in that window).
before_verify: Callable[["InPlaceChunk"], None] | None = None


class ChunkChanged(Unavailable):
    """A chunk read in place changed (or did not verify) while it was read: a miss."""


class InPlaceChunk:
    """A chunk of this node's slab, read in place (``kv``; ``data``: its bytes in the slab). Valid
    only if :meth:`release` (or leaving ``with``) returns without raising."""

    __slots__ = ("kv", "data", "_table", "_entry", "_open", "verify_s")

    def __init__(self, kv, data: np.ndarray, table: PageTable, entry: Entry) -> None:
        self.kv, self.data = kv, data
        self._table, self._entry = table, entry
        self._open = True
        self.verify_s = 0.0

    def verified(self) -> bool:
        """Steps 2 and 3 above: the bytes hash to the published checksum, then the slot is the
        one ``find`` saw and the table is not stale."""
        hook = before_verify
        if hook is not None:
            hook(self)
        if checksum(self.data) != self._entry.checksum:
            return False
        try:
            return self._table.valid(self._entry) and not self._table.stale
        except RuntimeError:  # the client closed the table meanwhile (a shard restart): a miss
            return False

    def release(self) -> None:
        """Verifies the chunk once; raises ChunkChanged when it did not hold still."""
        if not self._open:
            return
        self._open = False
        t0 = time.perf_counter()
        ok = self.verified()
        self.verify_s = time.perf_counter() - t0
        self.kv = None  # the slab page is the shard's again
        if not ok:
            raise ChunkChanged("a chunk of this node's slab changed while it was read in place; the caller "
                               "recomputes it (nothing to fix unless it keeps happening: then enlarge the pool)")

    def __enter__(self) -> "InPlaceChunk":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def views(table: PageTable, slab_buf: np.ndarray, addresses: Sequence[bytes],
          decode: Callable[[np.ndarray], object]) -> Iterator[InPlaceChunk]:
    """The leading run of ``addresses`` found in ``table``, one view at a time (as asked for),
    each ``decode``d from its bytes in ``slab_buf`` (the slab mapped as uint8). It ends at the
    first chunk not found or not decoding; the caller verifies each view by releasing it."""
    for a in addresses:
        try:
            entry = table.find(a)
        except RuntimeError:  # the client closed the table (a shard restart): a miss
            return
        if entry is None:
            return
        offset, nbytes = entry.offset, entry.nbytes
        if offset + nbytes > slab_buf.shape[0]:
            return  # a table of another slab, or a torn snapshot on a weak memory model
        data = slab_buf[offset : offset + nbytes]
        kv = decode(data)
        if kv is None:
            return
        yield InPlaceChunk(kv, data, table, entry)


def local_views(client, credential: str, keys, decode: Callable[[np.ndarray], object]) -> Iterator[InPlaceChunk]:
    """:func:`views` of a NodeClient's chunks on its node (none while it maps no shard)."""
    at = client.vouched(client._attached(), credential)
    if at is None or at.table.stale:
        return
    client.counts["get_inplace"] += 1
    shared = is_shared(keys)
    for i, view in enumerate(views(at.table, at.slab.buf, [bytes(a) for a in client.addresses(credential, keys)],
                                   decode)):
        client.touches.add(credential, [bytes(keys[i])], shared)  # a same-node hit, for the shard's policy
        yield view
