"""``kvpool bench slices``: what storing chunks as per-head slices (kvpool.slices: any TP size reads
them) costs a tensor-parallel rank's load, beside per-rank slices (one entry per rank holding its
heads, what Mooncake Store and LMCache keep: only the same TP size reads them), in one run.

Per TP size, one rank's loads of ``chunks`` chunks of a Llama-shaped model (8 layers, 8 KV heads
of 128, 256 tokens, fp16: 8 MiB a chunk; a rank holds 8/tp heads) from an in-process pool, each
read in place, scattered into the rank's paged KV cache in vLLM's layout of this device (blocks of
32 tokens, :func:`kvpool.kernels.layouts.vllm_layout`, kvpool's paged kernels, as the vLLM worker
does) and released:

- ``per_rank``: one entry per chunk and rank, scattered whole;
- ``ours``: the rank's per-head slices, each scattered straight into its head of the cache (what
  the vLLM worker does: ``SlicedPool.load_slices_in_place``, ``BoundCache.heads``);
- ``merged``: the same slices merged into one chunk of the rank's heads first, then scattered
  (what ``load`` and ``load_views`` give: the transformers and SGLang connectors).

All three alternate within every round; the figures are medians per chunk and each ratio to
``per_rank`` per round (range over rounds). Every load is checked against the bytes saved. Per
rank, all move the same bytes; ours takes ``8/tp`` index entries per chunk where per-rank takes one.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvpool.errors import BadRequest
from kvpool.kernels.layouts import vllm_layout
from kvpool.kernels.paged import BoundCache
from kvpool.pool import LocalPool
from kvpool.progress import Progress
from kvpool.slices import SlicedPool, Slicing
from kvpool.spec import KVSpec
from kvpool.tenants import Tenant, TenantRegistry

SPEC = KVSpec("bench/slices-llama", num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16,
              chunk_tokens=256)
BLOCK = 32  # tokens a block (vLLM's CPU attention takes multiples of 32)


def _pools(spec: KVSpec, tp: int, chunks: int) -> tuple[SlicedPool, LocalPool]:
    """(ours: rank 0's SlicedPool, per-rank: a pool of rank 0's parts keyed as the whole chunk)."""
    slicing = Slicing.of(spec, tp, 0)
    tenants = TenantRegistry([Tenant("bench")])
    ours = SlicedPool(LocalPool.create(slicing.slice_spec(spec), tenants, chunks * len(slicing.heads) + 4,
                                       keyed_as=spec, policy="lru"), spec, slicing)
    per_rank = LocalPool.create(slicing.rank_spec(spec), TenantRegistry([Tenant("bench")]), chunks + 4,
                                keyed_as=spec, policy="lru")
    return ours, per_rank


class _Cache:
    """A rank's paged cache in vLLM's layout of this device, and its per-head views."""

    def __init__(self, part: KVSpec, chunks: int, device: str) -> None:
        blocks = chunks * part.chunk_tokens // BLOCK
        # every layer in one allocation, as vLLM allocates them
        self.layers = list(torch.zeros(part.num_layers, blocks, part.num_kv_heads, BLOCK, 2 * part.head_dim,
                                       dtype=torch.float16, device=device).unbind(0))
        self.bound = BoundCache(self.layers, vllm_layout(torch.device(device)))
        self.heads = [self.bound.heads(h, h + 1) for h in range(part.num_kv_heads)]
        self.tokens = part.chunk_tokens

    def slots(self, i: int) -> range:
        return range(i * self.tokens, (i + 1) * self.tokens)

    def check(self, want: list[torch.Tensor]) -> bool:
        return all(torch.equal(self.bound.gather(torch.arange(self.slots(i).start, self.slots(i).stop)).cpu(), w)
                   for i, w in enumerate(want))


def _load(pool, keys, cache: _Cache, want: list[torch.Tensor], how: str) -> float:
    """Seconds per chunk of one load into ``cache``, every chunk checked after."""
    for layer in cache.layers:
        layer.zero_()
    got = 0
    t0 = time.perf_counter()
    if how == "ours":
        for i, h, view in pool.load_slices_in_place("bench", keys):
            with view:
                cache.heads[h].scatter(view.kv, cache.slots(i))
            got += h == len(cache.heads) - 1
    else:
        for i, view in enumerate(getattr(pool, "load_views_in_place", pool.load_views)("bench", keys)):
            with view:
                cache.bound.scatter(view.kv, cache.slots(i))
            got += 1
    if cache.layers[0].device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / len(keys)
    if got != len(keys) or not cache.check(want):
        raise RuntimeError(f"a load returned {got} of {len(keys)} chunks or other bytes than saved")
    return dt


def run(chunks: int = 8, rounds: int = 7, tps: tuple[int, ...] = (1, 2, 8), progress: bool = True,
        device: str = "cpu") -> list[dict]:
    """A row per TP size (see the module docstring)."""
    if chunks < 1 or rounds < 1 or any(t not in (1, 2, 4, 8) for t in tps) or not tps:
        raise BadRequest("--chunks and --rounds are at least 1; --tp sizes are of 1, 2, 4, 8 (the model's 8 KV heads)")
    rows = []
    with Progress(len(tps) * rounds, "slices vs per-rank", enabled=progress) as bar:
        for tp in tps:
            ours, per_rank = _pools(SPEC, tp, chunks)
            part = ours.slicing.rank_spec(SPEC)
            g = torch.Generator().manual_seed(tp)
            data = [torch.randn(part.chunk_shape, generator=g).to(torch.float16) for _ in range(chunks)]
            keys = ours.keys("bench", list(range(chunks * SPEC.chunk_tokens)))
            assert ours.save("bench", keys, data) == chunks and per_rank.save("bench", keys, data) == chunks
            cache = _Cache(part, chunks, device)
            times: dict[str, list[float]] = {"ours": [], "merged": [], "per_rank": []}
            for r in range(rounds + 1):  # round 0 warms up all three
                order = (("ours", ours), ("merged", ours), ("per_rank", per_rank))
                for name, pool in order if r % 2 else order[::-1]:
                    dt = _load(pool, keys, cache, data, name)
                    if r:
                        times[name].append(dt)
                if r:
                    bar.advance()
            row = {"tp": tp, "heads_per_rank": len(ours.slicing.heads), "rank_mib_per_chunk": part.chunk_nbytes / 2**20,
                   "entries_per_chunk_ours": SPEC.num_kv_heads, "entries_per_chunk_per_rank": tp, "rounds": rounds}
            for name in times:
                row[f"{name}_ms"] = round(1e3 * statistics.median(times[name]), 3)
            for name in ("ours", "merged"):
                ratios = [a / b for a, b in zip(times[name], times["per_rank"])]
                row[f"{name}_ratio"] = round(statistics.median(ratios), 3)
                row[f"{name}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
            rows.append(row)
            for p in (ours.part, per_rank):
                p.store.close()
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'TP':>3} {'heads/rank':>10} {'MiB/rank':>8} {'entries ours/per-rank':>22} {'per-rank ms':>11} "
             f"{'ours ms':>8} {'ours/per-rank':>16} {'merged ms':>9} {'merged/per-rank':>16}"]
    for r in rows:
        span = {n: f"{r[n + '_ratio']:.3f} ({r[n + '_range'][0]:.2f}-{r[n + '_range'][1]:.2f})" for n in ("ours", "merged")}
        lines.append(f"{r['tp']:>3} {r['heads_per_rank']:>10} {r['rank_mib_per_chunk']:>8.2f} "
                     f"{r['entries_per_chunk_ours']:>11}/{r['entries_per_chunk_per_rank']:<10} {r['per_rank_ms']:>11.3f} "
                     f"{r['ours_ms']:>8.3f} {span['ours']:>16} {r['merged_ms']:>9.3f} {span['merged']:>16}")
    lines.append("(per chunk, scattered into vLLM's paged layout; medians over rounds; a rank loads the same bytes "
                 "either way; ours reads them from 8 per-head entries, which any TP size reads)")
    return "\n".join(lines)
