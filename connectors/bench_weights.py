"""``kvpool bench weights``: what binding keys to the weights costs an engine's start.

A checkpoint of ``--size-gib`` is simulated by one file of that size (random bytes). Each round,
side by side on that file:

- ``read``: reading it once from disk (the page cache dropped first): the baseline, what loading
  the checkpoint costs anyway;
- ``first start``: the files fingerprint with an empty fingerprint cache (page cache dropped):
  every byte read and hashed;
- ``later start``: the same call with the cache written by the first (a ``stat`` per file).

The page cache is dropped with ``posix_fadvise(DONTNEED)`` on the (fsynced, so clean) file: no
root needed, and nothing else on the machine is touched.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from kvpool.connectors import weights as W
from kvpool.progress import Progress

_BLOCK = 64 << 20


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(path: str, size: int, progress: bool) -> None:
    block = os.urandom(_BLOCK)
    with open(path, "wb") as f, Progress(size, f"writing a {size / 2**30:.1f} GiB checkpoint", enabled=progress) as p:
        left = size
        while left:
            n = min(left, _BLOCK)
            f.write(block[:n] if n < _BLOCK else block)
            left -= n
            p.advance(n)
        f.flush()
        os.fsync(f.fileno())


def _read(path: str) -> None:
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def run(size_gib: float = 16.0, rounds: int = 3, folder: str | None = None, progress: bool = True) -> dict:
    size = int(size_gib * (1 << 30))
    if size <= 0 or rounds <= 0:
        raise ValueError("--size-gib and --rounds must be positive")
    base = tempfile.mkdtemp(prefix="kvpool-bench-weights-", dir=folder or "/var/tmp")
    ckpt, cache = os.path.join(base, "ckpt"), os.path.join(base, "cache")
    os.makedirs(ckpt)
    saved_env = os.environ.get("KVPOOL_CACHE_DIR")
    os.environ["KVPOOL_CACHE_DIR"] = cache
    rows = []
    try:
        path = os.path.join(ckpt, "model.safetensors")
        if shutil.disk_usage(base).free < size * 1.1:
            raise ValueError(f"{base} has {shutil.disk_usage(base).free >> 30} GiB free; the benchmark writes "
                             f"{size_gib} GiB: pass --dir on a larger disk or a smaller --size-gib")
        _write(path, size, progress)
        with open(os.path.join(ckpt, "config.json"), "w") as f:
            f.write('{"architectures": ["LlamaForCausalLM"]}')
        for r in range(rounds):
            _drop_page_cache(path)
            t = time.perf_counter()
            _read(path)
            read_s = time.perf_counter() - t
            shutil.rmtree(cache, ignore_errors=True)
            _drop_page_cache(path)
            t = time.perf_counter()
            first = W.files_fingerprint(ckpt)
            first_s = time.perf_counter() - t
            t = time.perf_counter()
            later = W.files_fingerprint(ckpt)
            later_s = time.perf_counter() - t
            assert later == first
            rows.append({"round": r + 1, "read_s": read_s, "first_start_s": first_s, "later_start_s": later_s,
                         "first_vs_read": first_s / read_s, "first_gbps": size / first_s / 1e9,
                         "read_gbps": size / read_s / 1e9})
            if progress:
                print(f"round {r + 1}/{rounds}: read {read_s:.1f} s, first start {first_s:.1f} s, "
                      f"later start {later_s * 1e3:.2f} ms", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if saved_env is None:
            os.environ.pop("KVPOOL_CACHE_DIR", None)
        else:
            os.environ["KVPOOL_CACHE_DIR"] = saved_env
    return {"size_gib": size_gib, "rounds": rows}


def format_table(result: dict) -> str:
    rows = result["rounds"]
    lines = [f"weights fingerprint of a {result['size_gib']:g} GiB checkpoint ({len(rows)} rounds)",
             f"{'round':>5} {'read (s)':>9} {'first start (s)':>16} {'first/read':>10} {'GB/s':>6} "
             f"{'later start (ms)':>17}"]
    for r in rows:
        lines.append(f"{r['round']:>5} {r['read_s']:>9.1f} {r['first_start_s']:>16.1f} {r['first_vs_read']:>10.2f} "
                     f"{r['first_gbps']:>6.2f} {r['later_start_s'] * 1e3:>17.2f}")
    return "\n".join(lines)
