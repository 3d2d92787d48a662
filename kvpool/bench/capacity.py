"""``kvpool bench capacity``: how many chunks one GiB of pool holds in each storage format.

For each format, an in-process pool of ``mib`` MiB is opened the way a connector opens its local
pool (pages sized to the stored chunk, the format's watermarks) and filled with SmolLM2-135M-shaped
chunks (``[30, 2, 256, 3, 64]``, random values) through ``LocalPool.save``, a new prompt per
chunk, until a save makes the pool evict. The row reports the chunks resident just before that
first eviction, the stored bytes per chunk against the raw chunk (and against a 16-bit raw chunk),
and the time a save and a load take per chunk on this machine (quantization and dequantization
included: the PyTorch reference on a CPU, Triton on a GPU). Every chunk read back at the end must
decode to the shape saved. Formats other than ``raw`` are LOSSY; this measures their size, not
their quality (``kvpool bench quality`` does).
"""

from __future__ import annotations

import time

import torch

from kvpool.codec import ChunkCodec, stored_nbytes
from kvpool.errors import BadRequest
from kvpool.pool import LocalPool
from kvpool.progress import Progress
from kvpool.spec import DEFAULT_HIGH_WATERMARK, STORAGE_FORMATS, KVSpec
from kvpool.tenants import Tenant, TenantRegistry

SMOLLM2 = dict(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", num_layers=30, num_kv_heads=3, head_dim=64,
               chunk_tokens=256, block_size=16)


def _evictions(pool: LocalPool) -> int:
    return int(sum(pool.store.stats()["metrics"]["evictions"].values()))


def fill(spec: KVSpec, mib: int, samples: list[torch.Tensor], progress: bool) -> dict:
    """One format's row: a pool of ``mib`` MiB filled until its first eviction."""
    pages = max(1, (mib << 20) // stored_nbytes(spec))
    pool = LocalPool.create(spec, TenantRegistry([Tenant("bench")]), pages, policy="lru")
    try:
        held, save_s, n = 0, 0.0, 0
        with Progress(pages + 1, f"capacity {spec.storage_format}", enabled=progress) as bar:
            while n <= 4 * pages:  # a pool that never evicts is a bug: stop rather than spin
                keys = pool.keys("bench", list(range(n * spec.chunk_tokens, (n + 1) * spec.chunk_tokens)))
                t0 = time.perf_counter()
                pool.save("bench", keys, [samples[n % len(samples)]])
                save_s += time.perf_counter() - t0
                n += 1
                if _evictions(pool):
                    break
                held = pool.store.stats()["chunks"]
                bar.advance()
        if not _evictions(pool):
            raise RuntimeError(f"a pool of {pages} pages took {n} chunks without evicting")
        last = [pool.keys("bench", list(range(i * spec.chunk_tokens, (i + 1) * spec.chunk_tokens)))[0]
                for i in range(n - min(8, held - 1), n)]  # the newest: the first eviction took an old one
        t0 = time.perf_counter()
        loaded = [pool.load("bench", [k]) for k in last]
        load_s = (time.perf_counter() - t0) / len(last)
        if not all(len(x) == 1 and tuple(x[0].shape) == spec.chunk_shape for x in loaded):
            raise RuntimeError(f"{spec.storage_format}: the last chunks saved do not load back")
    finally:
        pool.store.close()
    codec = ChunkCodec(spec)
    raw16 = spec.chunk_nbytes * 2 // torch.empty((), dtype=codec.dtype).element_size()
    return {"format": spec.storage_format, "dtype": spec.dtype, "pool_mib": mib, "page_bytes": codec.nbytes,
            "bytes_ratio": round(codec.bytes_ratio, 4), "bytes_ratio_vs_16bit": round(codec.nbytes / raw16, 4),
            "chunks_held": held, "tokens_held": held * spec.chunk_tokens,
            "high_watermark": DEFAULT_HIGH_WATERMARK[spec.storage_format],
            "save_ms_per_chunk": round(1e3 * save_s / n, 1), "load_ms_per_chunk": round(1e3 * load_s, 1)}


def run(mib: int = 1024, formats: tuple[str, ...] = STORAGE_FORMATS, dtype: str = "float32",
        progress: bool = True) -> list[dict]:
    """A row per format (see the module docstring), ``x_raw`` the chunks held over raw's."""
    if not isinstance(mib, int) or mib < 1:
        raise BadRequest(f"--mib is the pool's size in MiB (>= 1), got {mib!r}")
    unknown = [f for f in formats if f not in STORAGE_FORMATS]
    if unknown or not formats:
        raise BadRequest(f"--formats: choose from {', '.join(STORAGE_FORMATS)}, got {', '.join(unknown) or 'none'}")
    specs = [KVSpec(**SMOLLM2, dtype=dtype, storage_format=f) for f in formats]
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(specs[0].chunk_shape, generator=g).to(ChunkCodec(specs[0]).dtype) for _ in range(4)]
    rows = [fill(spec, mib, samples, progress) for spec in specs]
    base = next((r["chunks_held"] for r in rows if r["format"] == "raw"), None)
    for r in rows:
        r["x_raw"] = round(r["chunks_held"] / base, 2) if base else None
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'format':<10} {'page B':>10} {'ratio':>7} {'vs 16-bit':>9} {'chunks':>7} {'tokens':>8} {'x raw':>6} "
            f"{'save ms':>8} {'load ms':>8}")
    lines = [f"chunks of SmolLM2-135M ({rows[0]['dtype']}) held in {rows[0]['pool_mib']} MiB of pool", head]
    for r in rows:
        lines.append(f"{r['format']:<10} {r['page_bytes']:>10} {r['bytes_ratio']:>7.4f} {r['bytes_ratio_vs_16bit']:>9.4f} "
                     f"{r['chunks_held']:>7} {r['tokens_held']:>8} {r['x_raw'] or 0:>6.2f} "
                     f"{r['save_ms_per_chunk']:>8.1f} {r['load_ms_per_chunk']:>8.1f}")
    return "\n".join(lines)
