"""Slabs: one preallocated buffer of fixed-size pages per tier.

- ``dram``: anonymous memory, pinned through torch when CUDA is present (so copies to the GPU
  are DMA), or a file under /dev/shm when a same-node client must map it;
- ``disk``: a memory-mapped file on local disk (sparse until written; unlinked at once so a
  crash leaves nothing behind).
Pages are numpy views: slicing costs no copy and no allocation beyond the view object.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time

import numpy as np

from kvpool.errors import BadRequest

MAX_PAGE_BYTES = 1 << 34  # 16 GiB: larger than any sane chunk; catches unit mistakes


def _check_sizes(tier: str, page_bytes: int, num_pages: int) -> int:
    for name, v in (("page_bytes", page_bytes), ("num_pages", num_pages)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise BadRequest(f"{tier} tier: {name} must be an int, got {type(v).__name__}")
    if page_bytes <= 0 or page_bytes > MAX_PAGE_BYTES:
        raise BadRequest(f"{tier} tier: page_bytes must be in 1..{MAX_PAGE_BYTES}, got {page_bytes}")
    if num_pages < 0:
        raise BadRequest(f"{tier} tier: num_pages must be >= 0, got {num_pages}")
    return int(page_bytes) * int(num_pages)


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Slab:
    """``num_pages`` pages of ``page_bytes`` each in one contiguous uint8 buffer."""

    def __init__(self, tier: str, page_bytes: int, num_pages: int, buf: np.ndarray, closer=None) -> None:
        assert buf.dtype == np.uint8 and buf.shape == (page_bytes * num_pages,)
        self.tier = tier
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.buf = buf
        self._closer = closer
        self.path: str | None = None  # set for a named, shareable slab

    @property
    def nbytes(self) -> int:
        return self.buf.shape[0]

    def page(self, i: int) -> np.ndarray:
        pb = self.page_bytes
        return self.buf[i * pb : (i + 1) * pb]

    def close(self) -> None:
        closer, self._closer = self._closer, None
        self.buf = np.empty(0, dtype=np.uint8)
        if closer is not None:
            closer()

    @classmethod
    def dram(cls, page_bytes: int, num_pages: int, pin: bool | None = None) -> "Slab":
        total = _check_sizes("dram", page_bytes, num_pages)
        phys = _physical_memory()
        if total > phys:
            raise BadRequest(
                f"dram tier of {num_pages} x {page_bytes} B = {total} B exceeds this machine's "
                f"{phys} B of memory: lower dram_pages"
            )
        if pin is None or pin:
            import torch  # torch is a core dependency; only pinning needs it

            if torch.cuda.is_available():
                t = torch.empty(total, dtype=torch.uint8, pin_memory=True)
                return cls("dram", page_bytes, num_pages, t.numpy(), closer=lambda: t)
            if pin:
                raise BadRequest("pin_memory=True needs CUDA; leave it unset to pin only when a GPU is present")
        return cls("dram", page_bytes, num_pages, np.empty(total, dtype=np.uint8))

    @classmethod
    def mapped_file(cls, tier: str, directory: str, page_bytes: int, num_pages: int,
                    name: str | None = None) -> "Slab":
        """A slab in a memory-mapped file under ``directory``. Anonymous (unlinked at once, so a
        crash leaves nothing) unless ``name`` is given: then the file stays at ``path`` until the
        slab is closed, so other processes of the same node can map it (``Slab.attach``)."""
        total = _check_sizes(tier, page_bytes, num_pages)
        if not os.path.isdir(directory):
            raise BadRequest(f"{tier} tier: directory {directory!r} does not exist: create it or pick another")
        free = shutil.disk_usage(directory).free
        if total > free:
            raise BadRequest(
                f"{tier} tier of {total} B does not fit in the {free} B free under {directory!r}: "
                f"lower num_pages or pick another directory"
            )
        fd, path = tempfile.mkstemp(prefix="kvpool-", suffix=".kvslab", dir=directory)
        tmp = path
        try:
            os.ftruncate(fd, max(total, 1))
            if tier == "dram":
                _reserve(fd, total, directory)
            mm = mmap.mmap(fd, max(total, 1), flags=_map_flags(tier))
            if name is not None:
                # NOTE: a new file replaces the old one under its name, never truncates it: a client
                # still mapping a dead shard's slab would take a SIGBUS on its next read.
                final = os.path.join(directory, name)
                os.replace(path, final)
                path = final
        finally:
            os.close(fd)
            if path == tmp:
                os.unlink(tmp)  # NOTE: the mapping keeps the file alive; a crash leaves nothing behind
        slab = cls._over(tier, page_bytes, num_pages, mm, total, unlink=None if name is None else path)
        slab.path = None if name is None else path
        return slab

    @classmethod
    def attach(cls, path: str, page_bytes: int, num_pages: int, tier: str = "dram") -> "Slab":
        """Maps another process's named slab (same node): reads and writes go straight to its pages."""
        total = _check_sizes(tier, page_bytes, num_pages)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise BadRequest(f"cannot map the slab {path!r} ({e.strerror}): is the shard on this node running?") from None
        try:
            if os.fstat(fd).st_size < total:
                raise BadRequest(f"slab {path!r} is smaller than {num_pages} x {page_bytes} B: wrong shard?")
            mm = mmap.mmap(fd, total, flags=_map_flags(tier))
        finally:
            os.close(fd)
        slab = cls._over(tier, page_bytes, num_pages, mm, total, unlink=None)
        slab.path = path
        return slab

    @classmethod
    def _over(cls, tier: str, page_bytes: int, num_pages: int, mm: mmap.mmap, total: int, unlink: str | None) -> "Slab":
        buf = np.frombuffer(mm, dtype=np.uint8)[:total]

        def close() -> None:
            nonlocal buf
            del buf
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it later
                pass
            if unlink is not None:
                try:
                    os.unlink(unlink)
                except FileNotFoundError:
                    pass

        return cls(tier, page_bytes, num_pages, buf, closer=close)


def _reserve(fd: int, total: int, directory: str) -> None:
    """Allocates a shared-memory slab's pages now: a /dev/shm too small for the slab is a clear error
    at start-up instead of a SIGBUS on some later write, and no put pays for first-touch faults."""
    try:
        os.posix_fallocate(fd, 0, max(total, 1))
    except OSError as e:
        raise BadRequest(f"cannot reserve {total} B of memory under {directory!r} ({e.strerror}): "
                         "enlarge it (e.g. the pod's /dev/shm emptyDir) or lower dram_pages") from None


def _map_flags(tier: str) -> int:
    """Shared mappings; a DRAM slab's page tables are filled at map time (MAP_POPULATE), so the hot
    path takes no page faults (measured: a put into fresh slab pages ran at ~1/3 of the speed of
    one into pages already touched). Disk tiers are not populated: that would read the whole file."""
    flags = mmap.MAP_SHARED
    if tier == "dram":
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return flags



def _mapped_paths() -> set[str] | None:
    """Every file some process of this machine maps (from /proc/*/maps); None when /proc cannot
    tell (then nothing is swept)."""
    if not os.path.isdir("/proc/self"):
        return None
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        out.add(parts[5].rstrip("\n"))
        except OSError:  # gone meanwhile, or another user's: such a process maps nothing of ours we can see
            continue
    return out


def sweep_orphans(directory: str, prefix: str, suffix: str = ".kvslab", min_age_s: float = 60.0) -> list[str]:
    """Removes the named slab files ``prefix*suffix`` under ``directory`` that no live process maps
    (their shard died without closing them); the paths removed. Only files of this user (another's
    may be mapped by a process /proc does not show us), and none modified in the last ``min_age_s``
    (a shard starting beside this one creates its file before it maps it)."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(suffix)]
    except OSError:
        return []
    if not names:
        return []
    mapped = _mapped_paths()
    if mapped is None:
        return []
    removed = []
    for n in names:
        path = os.path.join(directory, n)
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid() or path in mapped or time.time() - st.st_mtime < min_age_s:
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed
