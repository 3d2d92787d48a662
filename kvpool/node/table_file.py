"""The page table's file (kvpool.node.table): its layout, its creation and attach.

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
HEADER = struct.Struct("<8sIIQQQQQQ")
EPOCH_AT = 24
PID_AT = 32
COUNT_AT = 56
U64 = struct.Struct("<Q")
ADDR = struct.Struct("<QQ")
# addr_hi, addr_lo, offset, nbytes, checksum (after the seq)
FIELDS = struct.Struct("<QQQQQ")
# seq and the fields in one call (a reader's snapshot; it then re-reads the seq)
SLOT = struct.Struct("<QQQQQQ")
# NOTE: a NamedTuple's own constructor is a Python function (~0.8 us, a fifth of a lookup)
new_tuple = tuple.__new__
U64_MAX = (1 << 64) - 1

assert HEADER.size <= HEADER_BYTES and COUNT_AT == HEADER.size - 8


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


def split_address(address: bytes) -> tuple[int, int]:
    try:
        return ADDR.unpack(address)
    except (struct.error, TypeError):
        raise BadRequest(f"a chunk address is {ADDRESS_BYTES} bytes, got {address!r:.40}: pass the chunk's key "
                         "digest") from None


def check_int(name: str, v, lo: int, hi: int) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise BadRequest(f"page table: {name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise BadRequest(f"page table: {name} must be in {lo}..{hi}, got {v}")
    return int(v)


def create(path: str, page_bytes: int, num_pages: int) -> tuple[mmap.mmap, tuple[int, int]]:
    """Creates (or replaces) the table file at ``path`` for a slab of ``num_pages`` x
    ``page_bytes``, and returns its writer. The file is written under a temporary name in the
    same directory (mode 0600) and renamed onto ``path``; an older file there gets its epoch
    bumped first, so its readers see that it is stale. (the writable mapping, the file's (dev, ino))"""
    page_bytes = check_int("page_bytes", page_bytes, 1, U64_MAX)
    num_pages = check_int("num_pages", num_pages, 0, U64_MAX)
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
        HEADER.pack_into(mm, 0, MAGIC, VERSION, SLOT_BYTES, capacity, epoch, os.getpid(),
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
    return mm, (st.st_dev, st.st_ino)


def attach(path: str) -> tuple[mmap.mmap, tuple[int, int]]:
    """Maps the table file at ``path`` read-only, its header checked: (the mapping, the file's (dev, ino))."""
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
        magic, version, slot_bytes, capacity = HEADER.unpack_from(header, 0)[:4]
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
    return mm, (st.st_dev, st.st_ino)


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
        if len(header) < HEADER.size or header[:8] != MAGIC or HEADER.unpack_from(header, 0)[1] != VERSION:
            return 0
        epoch = U64.unpack_from(header, EPOCH_AT)[0] + 1
        os.pwrite(fd, U64.pack(epoch), EPOCH_AT)
        return epoch
    finally:
        os.close(fd)
