"""A shared-memory page table: where each chunk of a node's slab lies, readable by engines without
a call to the shard.

The node's shard process is the single writer: it calls every writer method (``publish``,
``withdraw``, ``clear``, ``close``) while holding its own store lock. It publishes, in a file under
/dev/shm, a map from a chunk's 16-byte address to the chunk's byte range and xxh3-64 checksum in
its shared-memory slab. Engine processes of the same node map that file read-only
(``PageTable.attach``), look chunks up (``find``), copy the bytes optimistically out of the slab,
which they also map, and validate after the copy (``read``).

Trust model
    Any process that can open the slab and table files (same user: both are mode 0600) is trusted
    with every byte of the node's slab, exactly as with the existing shared-memory transport
    (``Slab.attach``). The table gives such a process nothing it could not read from the slab
    already. Tenants are kept apart by addresses derived from their credentials (a tenant cannot
    name another tenant's chunk), and ``Tenant(encrypt=True)`` seals payloads, so a sealed chunk
    read out of the slab is ciphertext to anyone without the tenant's key.

Ordering rule (writer)
    ``withdraw(address)`` must be called BEFORE the slab page holding the chunk is reused or freed.
    Publishing new bytes at an address works the same way: withdraw (or overwrite with
    ``publish``, which also bumps the slot), and only then rewrite the page, then ``publish``.

Why validation after the copy is enough
    Each 64-byte slot carries a sequence number (a seqlock): odd while the writer rewrites the slot,
    and every write or withdraw of the slot raises it by 2 in total; it never goes back (u64, no
    wrap in practice), so a reader cannot be fooled by A-B-A. A reader takes a consistent snapshot
    of the slot (seq even and unchanged across the read of the fields), copies the bytes, then
    checks that the seq is still the one it saw. If the chunk was withdrawn meanwhile, or its slot
    rewritten by a backward shift, the seq changed and the read is a miss; since the writer
    withdraws before it touches the page, any copy that overlapped a page rewrite also sees a
    changed seq. The xxh3-64 checksum, computed in the same pass as the copy
    (``copy_with_checksum``), catches any other tear (a writer breaking the ordering rule, a stale
    table of a dead writer, a torn slot). A miss is always allowed: a reader that keeps seeing a
    slot in flux gives up and reports a miss.

Memory ordering
    x86-64 keeps loads in order with loads and stores in order with stores (TSO), which is what the
    seqlock needs: the writer stores seq odd, the fields, then seq even; a reader loads seq, the
    fields, then seq. Each u64 is one aligned 8-byte load or store: on a little-endian machine
    CPython's ``struct`` packs and unpacks ``<Q`` with its native code (a memcpy of 8 bytes), and
    slots are 64-byte aligned in a page-aligned mapping. On weaker memory models (ARM, POWER)
    Python gives no fences to put between the loads, and the checksum is what guards the payload;
    a torn slot snapshot then is at worst a miss or a copy that fails the checksum.

The file itself (its header, slots, creation and attach) is :mod:`kvpool.node.table_file`.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvpool.checksum import copy_with_checksum
from kvpool.errors import BadRequest
from kvpool.node.table_file import (
    ADDR,
    COUNT_AT,
    EPOCH_AT,
    FIELDS,
    FIND_RETRIES,
    HEADER,
    HEADER_BYTES,
    PID_AT,
    SLOT,
    SLOT_BYTES,
    U64,
    U64_MAX,
    Entry,
    attach,
    check_int,
    create,
    new_tuple,
    split_address,
)


class PageTable:
    """One side of a page table file: the writer (``create``) or a read-only reader (``attach``)."""

    def __init__(self, path: str, mm: mmap.mmap, writable: bool, ident: tuple[int, int]) -> None:
        magic, version, slot_bytes, capacity, epoch, _pid, page_bytes, num_pages, _count = HEADER.unpack_from(mm, 0)
        self.path = path
        self.writable = writable
        self.capacity = capacity
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self._mm: mmap.mmap | None = mm
        self._mask = capacity - 1
        self._attach_epoch = epoch
        self._ident = ident  # (st_dev, st_ino) of the file mapped
        self._slab_bytes = page_bytes * num_pages
        self._count = _count

    # ---------------------------------------------------------------- writer

    @classmethod
    def create(cls, path: str, page_bytes: int, num_pages: int) -> "PageTable":
        """Creates (or replaces) the table file at ``path`` for a slab of ``num_pages`` x
        ``page_bytes``, and returns its writer (:func:`kvpool.node.table_file.create`)."""
        mm, ident = create(path, page_bytes, num_pages)
        return cls(path, mm, True, ident)

    def _writer(self) -> mmap.mmap:
        if not self.writable:
            raise RuntimeError("this page table was attached read-only: only the shard that created it writes")
        if self._mm is None:
            raise RuntimeError("the page table is closed")
        return self._mm

    def _write_slot(self, mm: mmap.mmap, i: int, hi: int, lo: int, offset: int, nbytes: int, checksum: int) -> None:
        at = HEADER_BYTES + i * SLOT_BYTES
        seq = U64.unpack_from(mm, at)[0]
        U64.pack_into(mm, at, seq + 1)  # odd: readers retry
        FIELDS.pack_into(mm, at + 8, hi, lo, offset, nbytes, checksum)
        U64.pack_into(mm, at, seq + 2)

    def _set_count(self, mm: mmap.mmap, count: int) -> None:
        self._count = count
        U64.pack_into(mm, COUNT_AT, count)

    def publish(self, address: bytes, offset: int, nbytes: int, checksum: int) -> None:
        """Maps ``address`` to ``nbytes`` at ``offset`` of the slab with xxh3-64 ``checksum``
        (inserts, or overwrites the address's slot)."""
        mm = self._writer()
        hi, lo = split_address(address)
        if hi == 0 and lo == 0:
            raise BadRequest("the all-zero chunk address marks an empty slot: derive addresses from the chunk keys")
        if (not isinstance(offset, (int, np.integer)) or not isinstance(nbytes, (int, np.integer))
                or offset < 0 or nbytes < 0 or offset + nbytes > self._slab_bytes):
            raise BadRequest(f"page table: bytes {offset}..{offset}+{nbytes} are not inside the slab of "
                             f"{self._slab_bytes} B: pass a page's offset and the chunk's size")
        checksum = check_int("checksum", checksum, 0, U64_MAX)
        mask = self._mask
        i = lo & mask
        for _ in range(self.capacity):
            h, lw = ADDR.unpack_from(mm, HEADER_BYTES + i * SLOT_BYTES + 8)
            if h == hi and lw == lo:
                self._write_slot(mm, i, hi, lo, int(offset), int(nbytes), checksum)
                return
            if h == 0 and lw == 0:
                # at least one slot stays empty, so every probe run ends
                assert self._count + 1 < self.capacity, f"page table full ({self._count} of {self.capacity})"
                self._write_slot(mm, i, hi, lo, int(offset), int(nbytes), checksum)
                self._set_count(mm, self._count + 1)
                return
            i = (i + 1) & mask
        raise AssertionError(f"page table full ({self._count} of {self.capacity})")

    def withdraw(self, address: bytes) -> bool:
        """Removes ``address`` (True if it was there). Call it BEFORE the chunk's slab page is reused
        or freed: it bumps the slot's seq, so a reader mid-copy fails validation."""
        mm = self._writer()
        hi, lo = split_address(address)
        if hi == 0 and lo == 0:
            return False
        mask = self._mask
        i = lo & mask
        for _ in range(self.capacity):
            h, lw = ADDR.unpack_from(mm, HEADER_BYTES + i * SLOT_BYTES + 8)
            if h == hi and lw == lo:
                break
            if h == 0 and lw == 0:
                return False
            i = (i + 1) & mask
        else:
            return False
        # backward shift: pull each later entry of the run that may live at the hole into it
        j = i
        while True:
            j = (j + 1) & mask
            fields = FIELDS.unpack_from(mm, HEADER_BYTES + j * SLOT_BYTES + 8)
            if fields[0] == 0 and fields[1] == 0:
                break
            home = fields[1] & mask
            # the entry at j may stay unless its home is cyclically outside (i, j]
            if (home - i - 1) & mask < (j - i) & mask:
                continue
            self._write_slot(mm, i, *fields)
            i = j
        self._write_slot(mm, i, 0, 0, 0, 0, 0)
        self._set_count(mm, self._count - 1)
        return True

    def clear(self) -> None:
        """Withdraws every address."""
        mm = self._writer()
        slots = np.frombuffer(mm, dtype="<u8", count=self.capacity * (SLOT_BYTES // 8),
                              offset=HEADER_BYTES).reshape(self.capacity, SLOT_BYTES // 8)
        try:
            used = np.flatnonzero(slots[:, 1] | slots[:, 2])
            # NOTE: whole-column passes, in this order: every used slot odd, then emptied, then even
            slots[used, 0] += 1
            slots[used, 1:6] = 0
            slots[used, 0] += 1
        finally:
            del slots  # an exported view would stop close() from unmapping
        self._set_count(mm, 0)

    def close(self, unlink: bool = True) -> None:
        """Writer: bumps the epoch (readers see the table is stale), unmaps, and unlinks the file if
        the file at ``path`` is still this one. Reader: unmaps. Idempotent."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        if self.writable:
            epoch = U64.unpack_from(mm, EPOCH_AT)[0]
            U64.pack_into(mm, EPOCH_AT, epoch + 1)
        mm.close()
        if self.writable and unlink:
            try:
                st = os.stat(self.path)
                # NOTE: a successor may have replaced the file meanwhile: leave its table alone
                if (st.st_dev, st.st_ino) == self._ident:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __len__(self) -> int:
        if self.writable:
            return self._count
        return U64.unpack_from(self._reader(), COUNT_AT)[0]

    # ---------------------------------------------------------------- reader

    @classmethod
    def attach(cls, path: str) -> "PageTable":
        """Maps the table file at ``path`` read-only (:func:`kvpool.node.table_file.attach`)."""
        mm, ident = attach(path)
        return cls(path, mm, False, ident)

    def _reader(self) -> mmap.mmap:
        mm = self._mm
        if mm is None:
            raise RuntimeError("the page table is closed")
        return mm

    @property
    def epoch(self) -> int:
        """The epoch in the file's header now (re-read on each call)."""
        return U64.unpack_from(self._reader(), EPOCH_AT)[0]

    @property
    def writer_pid(self) -> int:
        return U64.unpack_from(self._reader(), PID_AT)[0]

    @property
    def stale(self) -> bool:
        """True once the writer closed this file or created a new one over it: attach again."""
        return U64.unpack_from(self._reader(), EPOCH_AT)[0] != self._attach_epoch

    def find(self, address: bytes) -> Entry | None:
        """A consistent snapshot of ``address``'s slot, or None (absent, or the slot kept changing:
        a miss is always allowed)."""
        mm = self._mm
        if mm is None:
            raise RuntimeError("the page table is closed")
        hi, lo = split_address(address)
        if hi == 0 and lo == 0:
            return None
        mask = self._mask
        unpack_u64 = U64.unpack_from
        unpack_slot = SLOT.unpack_from
        for _ in range(FIND_RETRIES):
            i = lo & mask
            for _ in range(self.capacity):
                at = HEADER_BYTES + i * SLOT_BYTES
                # NOTE: the seq is the first field read, then the rest, then the seq again
                seq, h, lw, offset, nbytes, checksum = unpack_slot(mm, at)
                if seq & 1 or unpack_u64(mm, at)[0] != seq:
                    break  # being rewritten: start over
                if h == hi and lw == lo:
                    return new_tuple(Entry, (i, seq, offset, nbytes, checksum))
                if h == 0 and lw == 0:
                    return None
                i = (i + 1) & mask
            else:
                return None
        return None

    def valid(self, entry: Entry) -> bool:
        """Whether ``entry``'s slot is unchanged since ``find`` saw it."""
        return U64.unpack_from(self._reader(), HEADER_BYTES + entry.slot * SLOT_BYTES)[0] == entry.seq

    def read(self, address: bytes, slab_buf: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
        """Copies ``address``'s chunk out of ``slab_buf`` (the slab mapped as uint8) into ``out`` (or
        a new array) and returns the filled array (``out[:nbytes]``), or None: a miss, also when the
        chunk changed during the copy, failed its checksum, ``out`` is too small or the table is
        stale."""
        entry = self.find(address)
        if entry is None:
            return None
        offset, nbytes = entry.offset, entry.nbytes
        if offset + nbytes > slab_buf.shape[0]:
            return None  # a table of another slab, or a torn snapshot on a weak memory model
        if out is None:
            dst = np.empty(nbytes, dtype=np.uint8)
        elif out.shape[0] < nbytes:
            return None
        else:
            dst = out[:nbytes]
        digest = copy_with_checksum(dst, slab_buf[offset : offset + nbytes])
        if not self.valid(entry) or digest != entry.checksum or self.stale:
            return None
        return dst
