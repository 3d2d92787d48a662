"""The worker half of the vLLM connector: copies between vLLM's paged KV cache and pool chunks.

It keeps, per request in flight, the chunk keys of its prompt, its block ids in each of vLLM's KV
cache groups and how many leading chunks are known to be in the pool. Each step it

- loads the token range the scheduler planned (``load``): this rank's slices of the pool's chunks
  (one per KV head it holds, :mod:`kvpool.slices`), each group's layers scattered straight into
  its head of the request's blocks of that group with :class:`kvpool.kernels.paged.BoundCache`
  (from the pages of the pool, verified in place; of a sliding-window group only the tail vLLM
  keeps blocks for). With one group the load feeds this step's forward, and chunks the pool does
  not return whole make their blocks "failed" (reported to vLLM, which recomputes them); with
  several, vLLM cannot map a block id back to its request, so the load is asynchronous: the
  request waits one step, and a failed load is reported by request (``failed_recving``), which
  vLLM recomputes whole;
- after the forward (``save``), gathers every whole prompt chunk completed so far and not yet in
  the pool with :func:`kvpool.kernels.paged.gather` and saves this rank's slices of it;
- measures both sides for the load-or-recompute decision: load bandwidth, and forward seconds
  per computed token (from metadata bind to ``wait_for_save``, minus the load).

The copies go through :mod:`kvpool.connectors.vllm_layout`: kvpool's paged kernels on every
device, with vLLM's CPU layout (K transposed inside a block) checked against vLLM's own
cache-write op at startup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.connectors.vllm_layout import copier_for
from kvpool.connectors.vllm_meta import PoolStepMeta, PoolWorkerMeta, cdiv
from kvpool.connectors.vllm_metrics import FAILURE, cause_of
from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.connectors.vllm")


@dataclass
class _Req:
    tenant: str
    keys: list
    block_ids: list[list[int]]  # per KV cache group, in vLLM's order
    saved: int  # leading chunks known to be in the pool
    touched: bool = False  # the pool's policy has heard of this request's chunks
    # First token of a failed load: the KV from there on is garbage until a forward recomputes
    # it (vLLM rolls the request back there; with async scheduling a step planned before the
    # rollback may still run on the garbage, and must not be saved).
    dirty_from: int | None = None
    tid: str = ""  # the tenant's id (per-tenant figures)


class _Group:
    """One KV cache group on this rank: the positions of its layers in the rank's chunk, the
    copiers of their caches (all heads, and one per head), and the tokens vLLM keeps of it."""

    def __init__(self, index: int, layers: list[int], copier, window: int | None) -> None:
        self.index, self.copier, self.window, self.positions = index, copier, window, layers
        lo = layers[0]
        # a run of layers is a view of the chunk; others are picked out (a copy)
        self.layers = slice(lo, lo + len(layers)) if layers == list(range(lo, lo + len(layers))) \
            else torch.tensor(layers, dtype=torch.int64)
        self.heads = [copier] if copier.kv_heads == 1 else [copier.heads(h, h + 1) for h in range(copier.kv_heads)]

    def kept_from(self, computed: int) -> int:
        """The first token whose block vLLM still holds once ``computed`` tokens are computed: a
        sliding window frees (and hands to other requests) the blocks wholly before it, as
        vLLM's SlidingWindowManager does in ``remove_skipped_blocks``."""
        if self.window is None:
            return 0
        bs = self.copier.block_size
        return max(0, computed - self.window + 1) // bs * bs


class PoolWorker:
    def __init__(self, pool, spec, block_size: int, vllm_config=None, saves: bool = True,
                 cache_groups: list | None = None) -> None:
        self.pool, self.spec, self.block_size = pool, spec, block_size
        self.saves = saves  # False: a decode instance (kv_consumer) loads and never saves
        self.cache_groups = cache_groups  # vllm_spec.cache_groups; None: one full-attention group of every layer
        self.vllm_config = vllm_config
        self.chunk_tokens = spec.chunk_tokens
        self.groups: list[_Group] = []
        self.reqs: dict[str, _Req] = {}
        self.failed_blocks: set[int] = set()
        self.failed_history: list[int] = []  # every block ever reported (tests, operators)
        self.finished_recving: set[str] = set()  # asynchronous loads done since vLLM last asked
        self.failed_recving: set[str] = set()  # ... of which failed
        self._meta = PoolWorkerMeta()
        self._t_bind = 0.0
        self._load_s = 0.0

    # ------------------------------------------------------------------ setup

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.spec.num_layers:
            raise BadRequest(f"KVPoolConnector: vLLM registered {len(names)} KV caches but the spec has "
                             f"{self.spec.num_layers} layers")
        position = {n: i for i, n in enumerate(names)}
        members = [list(g.layer_names) for g in self.cache_groups] if self.cache_groups else [names]
        windows = [g.window for g in self.cache_groups] if self.cache_groups else [None]
        groups = []
        for gi, (layer_names, window) in enumerate(zip(members, windows)):
            mine = [n for n in layer_names if n in position]  # a pipeline stage holds some of each group
            if not mine:
                continue
            caches = [kv_caches[n] for n in mine]
            isa, cache_dtype = None, "auto"
            if self.vllm_config is not None:
                layer = self.vllm_config.compilation_config.static_forward_context.get(mine[0])
                isa = getattr(layer, "isa", None)  # vLLM's CPU attention sets it on its layers, per group
                cache_dtype = self.vllm_config.cache_config.cache_dtype
            copier = copier_for(caches, isa=isa, kv_cache_dtype=cache_dtype)
            want = (self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
            got = (copier.block_size, copier.kv_heads, copier.head_dim)
            if got != want:
                raise BadRequest(f"KVPoolConnector: the KV cache is {tuple(caches[0].shape)} (block_size, kv_heads, "
                                 f"head_dim = {got}) but the spec says {want}")
            groups.append(_Group(gi, [position[n] for n in mine], copier, window))
        if sorted(i for g in groups for i in g.positions) != list(range(self.spec.num_layers)):
            raise BadRequest(f"KVPoolConnector: vLLM's KV cache groups cover layers {[g.positions for g in groups]} of "
                             f"the {self.spec.num_layers} this rank holds, not each once")
        self.groups = groups
        log.info("KVPoolConnector: %d layers in %d KV cache group(s), %s copies, cache %s stride %s", len(names),
                 len(groups), groups[0].copier.name, tuple(kv_caches[names[0]].shape), kv_caches[names[0]].stride())

    # ------------------------------------------------------------------ per step

    def step_started(self) -> None:
        self._t_bind = time.perf_counter()
        self._load_s = 0.0

    def _kept_from(self, computed: int) -> int:
        """The first token every group still holds the block of (the shortest window's)."""
        return max(g.kept_from(computed) for g in self.groups)

    def _slots(self, blocks: list[int], lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, dtype=torch.int64)
        ids = torch.tensor(blocks, dtype=torch.int64)[pos // self.block_size]
        return ids * self.block_size + pos % self.block_size

    def load(self, meta: PoolStepMeta) -> None:
        """Takes the step's request updates and runs its loads (before the forward, or after it
        for an asynchronous load, which this step's forward does not read)."""
        for step in meta.steps:
            req = self.reqs.get(step.req_id)
            if step.keys is not None:
                req = self.reqs[step.req_id] = _Req(step.tenant, step.keys, [list(b) for b in step.block_ids],
                                                    step.pool_chunks, tid=step.tid)
            elif req is None:
                continue
            elif step.replace_blocks:
                req.block_ids = [list(b) for b in step.block_ids]
            else:
                for mine, new in zip(req.block_ids, step.block_ids):
                    mine.extend(new)
            if step.load is not None:
                done = self._load(step.req_id, req, *step.load, report_blocks=not step.load_async)
                if step.load_async:
                    self.finished_recving.add(step.req_id)
                    if done < step.load[1]:
                        self.failed_recving.add(step.req_id)  # vLLM recomputes the request whole

    def _run_slots(self, blocks: list[int], a: int, b: int) -> torch.Tensor | range:
        """The slots of tokens ``a..b-1``: a ``range`` when their blocks are consecutive (vLLM hands
        a request ascending block ids from its free queue), else a tensor."""
        bs = self.block_size
        run = blocks[a // bs : cdiv(b, bs)]
        first = run[0]
        if all(x == first + i for i, x in enumerate(run)):
            start = first * bs + a % bs
            return range(start, start + b - a)
        return self._slots(blocks, a, b)

    def _load(self, req_id: str, req: _Req, lo: int, hi: int, report_blocks: bool = True) -> int:
        """Loads tokens ``lo..hi-1`` into each group's blocks (a sliding window: only those whose
        blocks vLLM holds, the window's tail; the ones before it are never attended to again);
        the end of what was loaded. ``report_blocks``: a failure marks the blocks from there on
        failed (a synchronous load; vLLM recomputes from the first)."""
        c = self.chunk_tokens
        starts = [max(lo, g.kept_from(hi)) for g in self.groups]
        start = min(starts)
        c0, c1 = start // c, cdiv(hi, c)
        t0 = time.perf_counter()
        done, why = start, None
        last = len(self.groups[0].heads) - 1
        try:
            with closing(self._chunks(req, c0, c1)) as slices:
                for j, h, view in slices:
                    if h == 0:  # a new chunk: its tokens' slots in each group, once for all its heads
                        off = (c0 + j) * c
                        b = min(hi, off + c)
                        runs = []
                        for g, first in zip(self.groups, starts):
                            a = max(first, off)
                            if a < b:
                                runs.append((g, a - off, b - off, self._run_slots(req.block_ids[g.index], a, b)))
                    with view:  # released right after its copy, also when the copy fails
                        for g, a, e, slots in runs:
                            kv = view.kv[g.layers]  # a view, or this group's layers picked out
                            g.heads[h].scatter(kv if (a, e) == (0, c) else kv[:, :, a:e], slots)  # into its head
                    if h == last:  # the chunk's every head is in: its tokens are loaded
                        done = b
        except Exception as e:  # noqa: BLE001 - any failure on the read path is a miss
            log.warning("KVPoolConnector: load of request %s failed after %d tokens (%s)", req_id, done, e)
            why = e
        dt = time.perf_counter() - t0
        self._add("load_us", int(dt * 1e6))
        self._load_s += dt
        if done > start:
            self._meta.load_samples.append(((done - start) * self.spec.chunk_nbytes // c, dt))
        # what vLLM keeps: up to the first failed block; of an asynchronous load that fell short, nothing
        kept = done - lo if done == hi or report_blocks else 0
        self._meta.loads[req_id] = (req.tid, kept, dt)
        if done < hi:
            if report_blocks:
                bs = self.block_size
                bad = set(req.block_ids[0][done // bs : cdiv(hi, bs)])
                self.failed_blocks |= bad
                self.failed_history.extend(sorted(bad))
                self._add("failed_blocks", len(bad))
            req.dirty_from = done if req.dirty_from is None else min(req.dirty_from, done)
            req.saved = min(req.saved, done // c)
            self._add("load_failures")
            self._add(FAILURE + cause_of(why))
            self._add("failed_tokens", hi - lo - kept)
        return done

    def _chunks(self, req: _Req, c0: int, c1: int) -> Iterator[tuple[int, int, Any]]:
        """(chunk, head, view) of this rank's slices of the leading run of the pool's chunks for
        ``keys[c0:c1]`` (:meth:`kvpool.slices.SlicedPool.load_slices_in_place`), in order, each
        verified and valid until released; adds the time spent reading the pool to ``load_pool_us``.

        NOTE: a same-process pool (LocalPool) hands out views of its own pages, verified in
        place, which are scattered straight into vLLM's blocks; ``load`` would verify a private
        copy of every chunk, one more pass over the bytes into freshly allocated tensors (64 MiB
        of new pages per 4K load of the bench model: 16K minor page faults, 36 ms, where the
        in-place read takes 2.4 ms with none). In one engine whose allocator had warmed up
        (medians of 15 warm loads): pool read 6.6 -> 2.9 ms, whole load 18.7 -> 15.3 ms.
        A Ray pool's views own the bytes that came over the network. A node's shard gives views of
        its slab (``load_views_in_place``), verified when released, after the scatter: a release
        that raises makes the chunk's blocks failed (``_load``), as a miss does.
        NOTE: reading chunk j+1 in a helper thread while chunk j is scattered was slower (load
        16.3 ms against 14.8 ms, same run): xxhash holds the GIL, torch's copy already uses both
        cores, and the hand-offs cost more than the 2-3 ms of verification they would hide."""
        keys = req.keys[c0:c1]
        t0 = time.perf_counter()
        views = self.pool.load_slices_in_place(req.tenant, keys)
        pool_s = 0.0
        try:
            for _ in range(len(keys) * len(self.groups[0].heads)):
                got = next(views, None)
                pool_s += time.perf_counter() - t0
                if got is None:
                    return
                view = got[2]
                yield got  # the caller releases it (``with``): an in-place view is verified then
                pool_s += getattr(view, "verify_s", 0.0)
                t0 = time.perf_counter()
        finally:
            views.close()
            self._add("load_pool_us", int(pool_s * 1e6))

    def save(self, meta: PoolStepMeta) -> None:
        """After the forward: saves every whole prompt chunk that is now computed."""
        t_forward = time.perf_counter() - self._t_bind - self._load_s
        if meta.prefill_tokens >= self.block_size and meta.prefill_tokens * 2 >= meta.total_tokens:
            self._meta.prefill_samples.append((meta.total_tokens, t_forward))
        c = self.chunk_tokens
        for step in meta.steps if self.saves else ():
            req = self.reqs.get(step.req_id)
            if req is None:
                continue
            if req.dirty_from is not None:
                if step.computed_before > req.dirty_from:
                    continue  # this forward read blocks a failed load never filled: save nothing of it
                req.dirty_from = None  # this forward recomputed them
            whole = min(step.computed_after // c, len(req.keys))
            if whole <= req.saved and (req.touched or req.saved == 0):
                continue  # nothing new; a request that hit tells the pool's policy once (below)
            # A sliding window: chunks whose first blocks vLLM freed before this step (a save
            # that failed earlier, a prefix-cache hit) are not saved from blocks others now hold.
            first = max(req.saved, cdiv(self._kept_from(step.computed_before), c))
            if min(first, whole) > req.saved:
                self._add("save_skipped_chunks", min(first, whole) - req.saved)
            todo = range(first, whole)
            start = first if todo else req.saved  # nothing to save: the hit's chunks are touched
            try:
                t0 = time.perf_counter()
                chunks = [self._gather(req, i * c, (i + 1) * c) for i in todo]
                t1 = time.perf_counter()
                stored = self.pool.save(req.tenant, req.keys, chunks, start=start)
                self._add("save_copy_us", int((t1 - t0) * 1e6))
                self._add("save_us", int((time.perf_counter() - t0) * 1e6))
                self._add("saved_chunks", stored)
                if chunks:
                    self._add("save_steps")
                req.saved, req.touched = max(whole, req.saved), True
            except Exception as e:  # noqa: BLE001 - a failed save is a future miss, never an engine error
                log.warning("KVPoolConnector: save of request %s failed (%s)", step.req_id, e)
                self._add("save_errors")
                req.touched = True

    def _gather(self, req: _Req, lo: int, hi: int) -> torch.Tensor:
        """Tokens ``lo..hi-1`` of every layer, each group's from its blocks: ``[layers, 2, T, heads, dim]``."""
        if len(self.groups) == 1:
            return self.groups[0].copier.gather(self._slots(req.block_ids[self.groups[0].index], lo, hi))
        out = None
        for g in self.groups:
            part = g.copier.gather(self._slots(req.block_ids[g.index], lo, hi))
            if out is None:
                out = part.new_empty((self.spec.num_layers, *part.shape[1:]))
            out[g.layers] = part
        return out

    def take_transfers(self) -> tuple[set[str], set[str]]:
        """The asynchronous loads finished since last asked, and those of them that failed."""
        done, failed = self.finished_recving, self.failed_recving
        self.finished_recving, self.failed_recving = set(), set()
        return done, failed

    def forget(self, req_ids: set[str]) -> None:
        for r in req_ids:
            self.reqs.pop(r, None)

    def take_failed_blocks(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    def take_meta(self) -> PoolWorkerMeta | None:
        out, self._meta = self._meta, PoolWorkerMeta()
        return out if out else None

    def _add(self, name: str, n: int = 1) -> None:
        self._meta.counters[name] = self._meta.counters.get(name, 0) + n
