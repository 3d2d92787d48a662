"""How many pages a pool's tiers hold: a size in bytes, or a share of each node's memory.

``kvpool up --dram 64GiB`` / ``--dram 25%`` and ``--disk 500GiB`` / ``--disk 50%`` ask for a tier
size; the CLI checks the request (:func:`parse_tier`) and every shard turns it into pages on ITS
node (:func:`resolve_store`): a share is of that node's memory (its cgroup's limit when lower
than the machine's) or of the filesystem holding the disk tier. Pages = size // page size, and a
tier of fewer than :data:`MIN_PAGES` pages is refused naming the fix.

NOTE: a shard's DRAM slab is committed when the shard starts (a /dev/shm file reserved with
posix_fallocate and mapped with MAP_POPULATE, see kvpool.slab), so the default DRAM tier
(:data:`DEFAULT_DRAM`) is a fixed, modest size rather than a share of memory: a share would commit
gigabytes on every machine `kvpool up` runs on, test machines included.
"""

from __future__ import annotations

import os
import re
import shutil
from fractions import Fraction

from kvpool.errors import BadRequest

MIN_PAGES = 4
MAX_SHARE_PERCENT = 90
DEFAULT_DRAM = "1GiB"
DEFAULT_PAGE = "32MiB"
_SHARE = re.compile(r"\s*(\d{1,3}(?:\.\d{1,6})?)\s*%\s*")


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "10GiB", "500 MB" (exact: "1.5KiB" is 1536, "0.5" is an error)."""
    m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([a-zA-Z]*)\s*", text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise BadRequest(f"size {text!r} is not a number of bytes like 1073741824, 10GiB or 500MB")
    size = Fraction(m.group(1)) * _SIZE_UNITS[unit]  # NOTE: exact; a float would round large sizes
    if size.denominator != 1:
        raise BadRequest(f"size {text!r} is not a whole number of bytes: use a smaller unit or a whole number")
    return int(size)


def parse_tier(text: str, flag: str) -> int | str:
    """``"64GiB"`` -> 68719476736 (bytes); ``"25%"`` -> ``"25%"`` (a share of each node's memory,
    resolved by the shard on its node). Shares are in (0, 90]%."""
    if not isinstance(text, str):
        raise BadRequest(f"{flag} is a size like 64GiB or a share like 25%, got {type(text).__name__}")
    if "%" in text:
        m = _SHARE.fullmatch(text)
        share = Fraction(m.group(1)) if m else None
        if share is None or not 0 < share <= MAX_SHARE_PERCENT:
            raise BadRequest(f"{flag} {text!r}: a share of the node's memory is a percentage in "
                             f"(0, {MAX_SHARE_PERCENT}]%, e.g. 25%")
        return f"{m.group(1)}%"
    try:
        size = parse_size(text)
    except BadRequest as e:
        raise BadRequest(f"{flag}: {e.message}, or a share of the node's memory like 25%") from None
    if size <= 0:
        raise BadRequest(f"{flag} {text!r}: a tier needs room for at least {MIN_PAGES} pages: give a size like 4GiB")
    return size


def tier_bytes(request: int | str, total: int) -> int:
    """The bytes a request (bytes, or ``"N%"`` of ``total``) stands for."""
    if isinstance(request, str):
        return int(Fraction(request.rstrip("%")) * total / 100)
    return int(request)


def tier_pages(request: int | str, page_bytes: int, total: int, flag: str, of: str = "this node's memory") -> int:
    """Pages of ``page_bytes`` in the tier ``request`` asks for (``total``: what a share is of)."""
    assert page_bytes > 0
    nbytes = tier_bytes(request, total)
    pages = nbytes // page_bytes
    if pages < MIN_PAGES:
        share = f" ({request} of {of}, {total} B)" if isinstance(request, str) else ""
        raise BadRequest(f"{flag} {request}: {nbytes} B{share} holds {pages} pages of {page_bytes} B, and a tier needs "
                         f"at least {MIN_PAGES}: raise {flag} (or size pages to the model with --model instead of a "
                         "larger --page-size)")
    return pages


def node_memory() -> int:
    """This node's memory: the machine's, or its cgroup's limit when that is lower (a container)."""
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            phys = min(phys, int(text))
    return phys


def resolve_store(store: dict, memory: int | None = None) -> dict:
    """A shard's store config with its ``dram`` / ``disk`` requests turned into ``dram_pages`` /
    ``disk_pages`` on this node (``memory``: this node's, by default :func:`node_memory`)."""
    cfg = dict(store)
    dram, disk = cfg.pop("dram", None), cfg.pop("disk", None)
    page = cfg.get("page_bytes")
    if (dram is not None or disk is not None) and (not isinstance(page, int) or page <= 0):
        raise BadRequest(f"page_bytes must be a positive int to size tiers, got {page!r}")
    if dram is not None:
        if "dram_pages" in cfg:
            raise BadRequest("give the DRAM tier as dram (bytes or a share) or dram_pages, not both")
        cfg["dram_pages"] = tier_pages(dram, page, node_memory() if memory is None else memory, "--dram")
    if disk is not None:
        if cfg.get("disk_pages"):
            raise BadRequest("give the disk tier as disk (bytes or a share) or disk_pages, not both")
        where = cfg.get("disk_dir")
        if not where or not os.path.isdir(where):
            raise BadRequest(f"--disk needs --disk-dir, an existing directory on every node (got {where!r})")
        total = shutil.disk_usage(where).total
        cfg["disk_pages"] = tier_pages(disk, page, total, "--disk", of=f"the filesystem of {where}")
    return cfg


def mib(n: int) -> str:
    """``n`` bytes as MiB (or GiB from 10 GiB up), for messages."""
    return f"{n / 2**30:.1f} GiB" if n >= 10 << 30 else f"{n / 2**20:.2f} MiB"
