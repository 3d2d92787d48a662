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

Table file
    A header of 128 bytes (magic ``KVPTAB01``, format version, slot size, capacity, epoch, the
    writer's pid, the slab's page_bytes and num_pages, the number of used slots), then
    ``capacity`` slots of 64 bytes: seq, addr_hi, addr_lo, offset, nbytes, checksum and two spare
    u64, little-endian. An all-zero address marks an empty slot. Open addressing with linear
    probing from slot ``addr_lo & (capacity - 1)`` (``addr_lo`` is bytes 8..16 of the address, read
    little-endian); deletion by backward shift (no tombstones), bumping the seq of every slot the
    shift rewrites. The capacity is the next power of two >= 2 x the slab's pages, so the table is
    never more than half full and probe runs stay short.

    The epoch is bumped in the file when the writer closes it, and in a valid old file when a new
    table is created over it (so the readers of a dead writer's table notice): a reader whose
    attach-time epoch no longer matches is ``stale`` and every ``read`` misses; attach again. A new
    file is written under a temporary name and renamed onto the path, so a reader still mapping an
    older file never sees it truncated (that would be a SIGBUS in an engine).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import tempfile
from typing import NamedTuple

import numpy as np

from kvpool.checksum import copy_with_checksum
from kvpool.errors import BadRequest

MAGIC = b"KVPTAB01"
VERSION = 1
HEADER_BYTES = 128
SLOT_BYTES = 64
ADDRESS_BYTES = 16
MIN_CAPACITY = 8
# how many times ``find`` starts over when it meets a slot being rewritten; then it reports a miss
FIND_RETRIES = 8

# magic, version, slot_bytes, capacity, epoch, writer_pid, page_bytes, num_pages, count
_HEADER = struct.Struct("<8sIIQQQQQQ")
_EPOCH_AT = 24
_PID_AT = 32
_COUNT_AT = 56
_U64 = struct.Struct("<Q")
_ADDR = struct.Struct("<QQ")
# addr_hi, addr_lo, offset, nbytes, checksum (after the seq)
_FIELDS = struct.Struct("<QQQQQ")
# seq and the fields in one call (a reader's snapshot; it then re-reads the seq)
_SLOT = struct.Struct("<QQQQQQ")
# NOTE: a NamedTuple's own constructor is a Python function (~0.8 us, a fifth of a lookup)
_new_tuple = tuple.__new__
_U64_MAX = (1 << 64) - 1

assert _HEADER.size <= HEADER_BYTES and _COUNT_AT == _HEADER.size - 8


class Entry(NamedTuple):
    """A consistent snapshot of one slot: where the chunk lay when ``find`` saw it."""

    slot: int
    seq: int
    offset: int
    nbytes: int
    checksum: int


def capacity_for(num_pages: int) -> int:
    """The number of slots of a table over ``num_pages`` pages: a power of two >= 2 x pages."""
    need = max(2 * int(num_pages), MIN_CAPACITY)
    return 1 << (need - 1).bit_length()


def _split(address: bytes) -> tuple[int, int]:
    try:
        return _ADDR.unpack(address)
    except (struct.error, TypeError):
        raise BadRequest(f"a chunk address is {ADDRESS_BYTES} bytes, got {address!r:.40}: pass the chunk's key "
                         "digest") from None


def _check_int(name: str, v, lo: int, hi: int) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise BadRequest(f"page table: {name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise BadRequest(f"page table: {name} must be in {lo}..{hi}, got {v}")
    return int(v)


class PageTable:
    """One side of a page table file: the writer (``create``) or a read-only reader (``attach``)."""

    def __init__(self, path: str, mm: mmap.mmap, writable: bool, ident: tuple[int, int]) -> None:
        magic, version, slot_bytes, capacity, epoch, _pid, page_bytes, num_pages, _count = _HEADER.unpack_from(mm, 0)
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
        ``page_bytes``, and returns its writer. The file is written under a temporary name in the
        same directory (mode 0600) and renamed onto ``path``; an older file there gets its epoch
        bumped first, so its readers see that it is stale."""
        page_bytes = _check_int("page_bytes", page_bytes, 1, _U64_MAX)
        num_pages = _check_int("num_pages", num_pages, 0, _U64_MAX)
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise BadRequest(f"page table: directory {directory!r} does not exist: create it or pick another")
        capacity = capacity_for(num_pages)
        size = HEADER_BYTES + capacity * SLOT_BYTES
        epoch = _retire(path) + 1
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
        mm = None
        try:
            try:
                os.fchmod(fd, 0o600)
                # NOTE: allocated now, so a full /dev/shm is an error here, not a SIGBUS on a later write
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise BadRequest(f"cannot reserve {size} B for the page table under {directory!r} ({e.strerror}): "
                                 "enlarge it (e.g. the pod's /dev/shm emptyDir) or lower dram_pages") from None
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            _HEADER.pack_into(mm, 0, MAGIC, VERSION, SLOT_BYTES, capacity, epoch, os.getpid(),
                              page_bytes, num_pages, 0)
            st = os.fstat(fd)
            os.replace(tmp, path)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)
        return cls(path, mm, True, (st.st_dev, st.st_ino))

    def _writer(self) -> mmap.mmap:
        if not self.writable:
            raise RuntimeError("this page table was attached read-only: only the shard that created it writes")
        if self._mm is None:
            raise RuntimeError("the page table is closed")
        return self._mm

    def _write_slot(self, mm: mmap.mmap, i: int, hi: int, lo: int, offset: int, nbytes: int, checksum: int) -> None:
        at = HEADER_BYTES + i * SLOT_BYTES
        seq = _U64.unpack_from(mm, at)[0]
        _U64.pack_into(mm, at, seq + 1)  # odd: readers retry
        _FIELDS.pack_into(mm, at + 8, hi, lo, offset, nbytes, checksum)
        _U64.pack_into(mm, at, seq + 2)

    def _set_count(self, mm: mmap.mmap, count: int) -> None:
        self._count = count
        _U64.pack_into(mm, _COUNT_AT, count)

    def publish(self, address: bytes, offset: int, nbytes: int, checksum: int) -> None:
        """Maps ``address`` to ``nbytes`` at ``offset`` of the slab with xxh3-64 ``checksum``
        (inserts, or overwrites the address's slot)."""
        mm = self._writer()
        hi, lo = _split(address)
        if hi == 0 and lo == 0:
            raise BadRequest("the all-zero chunk address marks an empty slot: derive addresses from the chunk keys")
        if (not isinstance(offset, (int, np.integer)) or not isinstance(nbytes, (int, np.integer))
                or offset < 0 or nbytes < 0 or offset + nbytes > self._slab_bytes):
            raise BadRequest(f"page table: bytes {offset}..{offset}+{nbytes} are not inside the slab of "
                             f"{self._slab_bytes} B: pass a page's offset and the chunk's size")
        checksum = _check_int("checksum", checksum, 0, _U64_MAX)
        mask = self._mask
        i = lo & mask
        for _ in range(self.capacity):
            h, lw = _ADDR.unpack_from(mm, HEADER_BYTES + i * SLOT_BYTES + 8)
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
        hi, lo = _split(address)
        if hi == 0 and lo == 0:
            return False
        mask = self._mask
        i = lo & mask
        for _ in range(self.capacity):
            h, lw = _ADDR.unpack_from(mm, HEADER_BYTES + i * SLOT_BYTES + 8)
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
            fields = _FIELDS.unpack_from(mm, HEADER_BYTES + j * SLOT_BYTES + 8)
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
            epoch = _U64.unpack_from(mm, _EPOCH_AT)[0]
            _U64.pack_into(mm, _EPOCH_AT, epoch + 1)
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
        return _U64.unpack_from(self._reader(), _COUNT_AT)[0]

    # ---------------------------------------------------------------- reader

    @classmethod
    def attach(cls, path: str) -> "PageTable":
        """Maps the table file at ``path`` read-only."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise BadRequest(f"cannot open the page table {path!r} ({e.strerror}): is the node's shard running, "
                             "with its DRAM slab under a shared directory (dram_dir, e.g. /dev/shm)?") from None
        try:
            st = os.fstat(fd)
            if st.st_size < HEADER_BYTES:
                raise BadRequest(f"{path!r} is {st.st_size} B, too small for a page table: "
                                 "point the engine at the table file its node's shard reports")
            header = os.pread(fd, HEADER_BYTES, 0)
            magic, version, slot_bytes, capacity = _HEADER.unpack_from(header, 0)[:4]
            if magic != MAGIC:
                raise BadRequest(f"{path!r} is not a kvpool page table (magic {magic!r}): "
                                 "point the engine at the table file its node's shard reports")
            if version != VERSION or slot_bytes != SLOT_BYTES:
                raise BadRequest(f"page table {path!r} has format version {version} (slot {slot_bytes} B); this "
                                 f"kvpool reads version {VERSION}: run the same kvpool version in the engine "
                                 "and the shard")
            size = HEADER_BYTES + capacity * SLOT_BYTES
            if capacity < 1 or capacity & (capacity - 1) or st.st_size < size:
                raise BadRequest(f"page table {path!r} is {st.st_size} B, not the {size} B its header says "
                                 "(truncated or corrupt): restart the node's shard to recreate it")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(path, mm, False, (st.st_dev, st.st_ino))

    def _reader(self) -> mmap.mmap:
        mm = self._mm
        if mm is None:
            raise RuntimeError("the page table is closed")
        return mm

    @property
    def epoch(self) -> int:
        """The epoch in the file's header now (re-read on each call)."""
        return _U64.unpack_from(self._reader(), _EPOCH_AT)[0]

    @property
    def writer_pid(self) -> int:
        return _U64.unpack_from(self._reader(), _PID_AT)[0]

    @property
    def stale(self) -> bool:
        """True once the writer closed this file or created a new one over it: attach again."""
        return _U64.unpack_from(self._reader(), _EPOCH_AT)[0] != self._attach_epoch

    def find(self, address: bytes) -> Entry | None:
        """A consistent snapshot of ``address``'s slot, or None (absent, or the slot kept changing:
        a miss is always allowed)."""
        mm = self._mm
        if mm is None:
            raise RuntimeError("the page table is closed")
        hi, lo = _split(address)
        if hi == 0 and lo == 0:
            return None
        mask = self._mask
        unpack_u64 = _U64.unpack_from
        unpack_slot = _SLOT.unpack_from
        for _ in range(FIND_RETRIES):
            i = lo & mask
            for _ in range(self.capacity):
                at = HEADER_BYTES + i * SLOT_BYTES
                # NOTE: the seq is the first field read, then the rest, then the seq again
                seq, h, lw, offset, nbytes, checksum = unpack_slot(mm, at)
                if seq & 1 or unpack_u64(mm, at)[0] != seq:
                    break  # being rewritten: start over
                if h == hi and lw == lo:
                    return _new_tuple(Entry, (i, seq, offset, nbytes, checksum))
                if h == 0 and lw == 0:
                    return None
                i = (i + 1) & mask
            else:
                return None
        return None

    def valid(self, entry: Entry) -> bool:
        """Whether ``entry``'s slot is unchanged since ``find`` saw it."""
        return _U64.unpack_from(self._reader(), HEADER_BYTES + entry.slot * SLOT_BYTES)[0] == entry.seq

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


def _retire(path: str) -> int:
    """Bumps the epoch of a valid table file at ``path`` (its readers see it is stale) and returns
    the new epoch; 0 when there is none. Reads and writes through the descriptor, never a mapping,
    so a short or foreign file cannot SIGBUS us."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        header = os.pread(fd, HEADER_BYTES, 0)
        if len(header) < _HEADER.size or header[:8] != MAGIC or _HEADER.unpack_from(header, 0)[1] != VERSION:
            return 0
        epoch = _U64.unpack_from(header, _EPOCH_AT)[0] + 1
        os.pwrite(fd, _U64.pack(epoch), _EPOCH_AT)
        return epoch
    finally:
        os.close(fd)
