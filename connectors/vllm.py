"""vLLM V1 KV connector: vLLM loads prompt prefixes from the kvpool and saves new ones into it.

Run it with ``vllm serve MODEL ... --kv-transfer-config CONFIG``, CONFIG what ``kvpool connect vllm``
prints (the README's quickstart, docs/engines.md), a literal written once: by default (backend
``"node"``) the engine reaches its node's shard without joining Ray, and the pool outlives the
engine (``"backend": "local"``: in this process, for tests). ``kv_transfer_config(**pool_config)``
builds the dict.
The extra config is :mod:`kvpool.connectors.pools`'s plus ``model_id``,
``model_revision``, ``model_weights`` and ``breakeven_margin``. Keys carry a fingerprint of the
checkpoint's files (as the transformers connector's do), so two checkpoints under one name never
share; state-space, linear-attention and MLA models are refused at start. It declares vLLM's
``SupportsHMA``, so vLLM keeps its hybrid allocator on: every attention KV cache group is served,
full and sliding-window (Gemma 2/3's mix, Mistral's window), each group's layers in its own blocks,
of a sliding window only the tail loaded, each chunk saved while vLLM still holds its blocks
(:mod:`kvpool.connectors.vllm_spec`). Tensor- and pipeline-parallel
engines: the spec is the whole model's and each rank saves and loads its own heads' and layers'
slices (:mod:`kvpool.connectors.vllm_spec`, :mod:`kvpool.slices`), so any TP size reads them. A lossy ``"storage_format"``
(opt-in) is quantized by the worker's saves and dequantized by its loads; the format is in the key.

Lifecycle, per request:

- scheduler: ``get_num_new_matched_tokens`` keys the prompt's whole chunks (kvpool's keys) and
  asks the pool how many leading chunks it holds whole, every rank's slices (one lookup); a full hit leaves the last token to
  compute, and hits the measured break-even says to recompute are declined. ``update_state_after_
  alloc`` / ``build_connector_meta`` turn it into a load and, per prefill step, how far it is;
- worker: ``start_load_kv`` loads that range and scatters it into the request's blocks
  (:mod:`kvpool.connectors.vllm_layout`). One KV cache group: before the forward, and chunks the pool cannot return
  (evicted, failed checksum, shard down) are reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes from the first of them (policy
  ``recompute``; vLLM unions the ranks' failed blocks, so one rank's failure is every rank's); ``wait_for_save`` gathers every whole prompt chunk the forward has just
  completed and saves it (not after a failed load: the recompute's step saves them). Several
  groups (vLLM cannot map a failed block back to its request there): the load is asynchronous
  (``get_num_new_matched_tokens`` says so; the request waits one engine step), runs after the
  step's forward, and is reported by request through ``get_transfer_results``; a failed one is
  in ``failed_recving`` and vLLM recomputes the request whole (the scheduler then loads nothing
  for it).

Tenants: a request is served as the tenant whose request secret (``request_secret``, or the one
derived from its credential: :mod:`kvpool.connectors.tenancy`) is its ``cache_salt`` (the OpenAI
server takes it in the request body); none: the config's ``tenant``, else its first; a salt that is nobody's
secret: not cached by the pool (``rejected_credential``); ``kv_transfer_params["kvpool_tenant"]``
is ignored (``ignored_tenant_name``). vLLM's own prefix cache is kept apart per tenant by the same
salt. The salt is not in the keys (the tenant's namespace isolates); LoRA adapters and multimodal inputs are.

Start-up: a pool that does not answer or take a tenant's credential stops vLLM with the fix (``"degraded": true``: a WARNING).

NOTE: loads and saves are whole-forward (the layer-wise hooks are no-ops) and run in the step's
thread: on CPU there is nothing to overlap with, and a failed load never races a forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.connectors.breakeven import BreakEven
from kvpool.connectors.pool_start import verify_tenants
from kvpool.connectors.pools import PoolHealth, Reporter, open_pool
from kvpool.connectors.tenancy import Tenancy
from kvpool.connectors.vllm_config import split_config
from kvpool.connectors.vllm_figures import Counts, engine_name
from kvpool.connectors.vllm_meta import PARAM_TENANT, PoolStepMeta, PoolWorkerMeta, ReqStep, role_of
from kvpool.connectors.vllm_metrics import FAILURE, ConnectorMetrics
from kvpool.connectors.vllm_spec import cache_groups, model_spec, rank_slicing
from kvpool.connectors.vllm_worker import PoolWorker
from kvpool.errors import BadRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.connectors.vllm")

__all__ = ["KVPoolConnector", "kv_transfer_config"]


def kv_transfer_config(kv_role: str = "kv_both", **pool_config: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that selects this connector with ``pool_config``."""
    split_config(pool_config)  # fail here, not inside the engine
    role_of(kv_role)
    return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
            "kv_role": kv_role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": pool_config}


@dataclass
class _Plan:
    """What the scheduler knows of one request (from its lookup)."""

    tenant: str | None  # what the pool is passed (credential or id); None: not cached (no token ids, no tenant)
    keys: list
    prompt_len: int
    pool_chunks: int = 0  # leading chunks the pool held at the last lookup
    load_tokens: int = 0  # external tokens vLLM accepted, loaded in the request's next step
    declined: bool = False  # the break-even said recompute
    sent: bool = False  # the worker has the keys
    local: int = 0  # tokens vLLM's own prefix cache held at the last lookup (a load starts there)
    looked: bool = False  # a lookup came before this allocation (not an asynchronous load's second one)
    pending: tuple | None = None  # an asynchronous load for the next step: (lo, hi, block ids per group)
    load_failed: bool = False  # an asynchronous load failed: vLLM recomputes the request, nothing is loaded
    tid: str = ""  # the tenant's id (per-tenant figures; "": no tenant)
    counted: bool = False  # in the figures (vllm_figures.Counts: once, as vLLM counts it)


class KVPoolConnector(ConnectorMetrics, KVConnectorBase_V1, SupportsHMA):
    """The kvpool as vLLM's external prefix cache (``kv_role`` ``kv_both``), or one side of
    prefill/decode disaggregation through the pool (``kv_producer``, ``kv_consumer``)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        xfer = self._kv_transfer_config
        pool_config, own = split_config(xfer.kv_connector_extra_config)
        self.loads, self.saves = role_of(xfer.kv_role)
        self.tenancy = (Tenancy(pool_config, engine="KVPoolConnector")
                        if role == KVConnectorRole.SCHEDULER else None)  # the worker takes the scheduler's routes
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = int(pool_config.get("chunk_tokens", 256))
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size:
            raise BadRequest(f"KVPoolConnector: chunk_tokens={self.chunk_tokens} is not a multiple of vLLM's "
                             f"block_size={self.block_size}; set kv_connector_extra_config['chunk_tokens'] to a "
                             f"multiple of {self.block_size} (e.g. {max(1, 256 // self.block_size) * self.block_size})")
        par = vllm_config.parallel_config
        if pool_config.get("backend", "local") == "local" and par.distributed_executor_backend not in ("uni", None):
            # NOTE: a local pool is in one process: with the worker apart (executor "mp") the scheduler never sees its saves
            raise BadRequest(f"KVPoolConnector: a 'local' pool is in-process, but vLLM runs its worker apart from "
                             f"the scheduler (distributed_executor_backend={par.distributed_executor_backend!r}): "
                             "use --distributed-executor-backend uni (with VLLM_ENABLE_V1_MULTIPROCESSING=0 on "
                             "vLLM's CPU build), or backend 'node' (a kvpool cluster's shard on this node)")
        if xfer.kv_load_failure_policy != "recompute":
            # NOTE: a chunk that fails to load is a miss that vLLM recomputes (DESIGN); the
            # scheduler reads this after building its connector, so setting it here takes effect.
            # vLLM's default is "fail", and a config need not say it: not worth a warning.
            log.info("KVPoolConnector: kv_load_failure_policy 'recompute' (not %r): a chunk the pool cannot return "
                     "is recomputed, never a failed request", xfer.kv_load_failure_policy)
            xfer.kv_load_failure_policy = "recompute"
        self.spec = model_spec(vllm_config, kv_cache_config, pool_config, own)  # the whole model's, every rank's
        self.groups = cache_groups(kv_cache_config)
        self.async_loads = len(self.groups) > 1  # block-level load failures are refused by vLLM there
        self.slicing = rank_slicing(vllm_config, self.spec, worker=role == KVConnectorRole.WORKER)
        self.pool = open_pool(self.spec, pool_config, self.slicing)  # not answering: Unavailable, or degraded
        if self.tenancy is not None:  # the pool verifies each credential once: a wrong one stops vLLM here
            verify_tenants(self.pool, self.tenancy.pool_routes(), pool_config, "KVPoolConnector")
        self.health = PoolHealth(self.pool)
        self.bytes_per_token = self.slicing.rank_spec(self.spec).chunk_nbytes // self.chunk_tokens  # a rank loads
        self.load_min_tokens = int(pool_config.get("load_min_tokens", 0))
        self.breakeven = BreakEven(margin=float(own.get("breakeven_margin", 1.0)))
        self.counts, self._xfer = Counts(), {}  # _xfer: for vLLM's connector stats (ConnectorMetrics)
        self._plans: dict[str, _Plan] = {}
        # one engine, one name, one credential (its default tenant's), whichever tenants it serves
        self.reporter = (Reporter(self.pool, engine_name(self.spec.model_id, vllm_config.model_config.served_model_name,
                                                         par.data_parallel_index if par.data_parallel_size > 1 else None),
                                  self.figures, credential=self.tenancy.default.pool_as)
                         if role == KVConnectorRole.SCHEDULER else None)
        self.worker = (PoolWorker(self.pool, self.slicing.rank_spec(self.spec), self.block_size, vllm_config,
                                  saves=self.saves, cache_groups=self.groups)
                       if role == KVConnectorRole.WORKER else None)

    requires_kv_delivery = False  # a dropped save is a future miss, never lost data

    def _count(self, name: str, n: int = 1) -> None:
        self.counts.add(name, n)
        if self.reporter is not None:  # `kvpool stats` shows a load within a second, not at the next heartbeat
            self.reporter.poke()

    @property
    def counters(self) -> dict[str, int]:
        """The connector's counters (the worker's arrive with each step's output)."""
        return self.counts.c

    def stats(self) -> dict[str, Any]:
        """Counters (the worker's arrive with each step's output), break-even figures, ``health``."""
        tenancy = self.tenancy.stats() if self.tenancy is not None else {}
        return {**self.counts.c, **tenancy, "breakeven": self.breakeven.stats(), "health": self.health.figures()}

    def figures(self) -> dict[str, Any]:
        """What ``kvpool stats`` shows: the loads vLLM kept and their tokens (as the worker reports
        them, never what was planned), those of failed loads (recomputed, not hits), DEGRADED."""
        return self.counts.figures(self.breakeven.stats(self.bytes_per_token), self.health.figures())

    def shutdown(self) -> None:
        if self.reporter is not None:  # `kvpool stats` forgets this engine now, not after its reports lapse
            self.reporter.close()

    # ------------------------------------------------------------------ scheduler side

    def _plan(self, request: "Request") -> _Plan:
        prompt = request.prompt_token_ids
        n = len(prompt) if prompt is not None else 0
        plan = self._plans.get(request.request_id)
        if plan is not None and plan.prompt_len == n:
            return plan
        params = request.kv_transfer_params
        named = params.get(PARAM_TENANT) if isinstance(params, dict) else None
        route = self.tenancy.route(request.cache_salt, named, request.request_id)
        whole = n // self.chunk_tokens
        if route is None or prompt is None or request.prompt_embeds is not None or whole == 0:
            plan = _Plan(None, [], n, tid=route.tenant if route else "")  # no tenant, or nothing to key
        else:
            extra = [f"mm:{f.identifier}" for f in (request.mm_features or [])]
            adapter = request.lora_request.lora_name if request.lora_request is not None else ""
            keys = self.pool.keys(route.pool_as, prompt[: whole * self.chunk_tokens], adapter_id=adapter,
                                  extra_keys=extra)
            plan = _Plan(route.pool_as, keys, n, tid=route.tenant)
        self._plans[request.request_id] = plan
        return plan

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self._plan(request)
        plan.looked, plan.local = True, num_computed_tokens
        if plan.load_failed:  # recomputed whole, once, and every chunk saved again
            plan.pool_chunks = 0
            return 0, False
        if plan.tenant is None:
            return 0, False
        if not self.health.up():  # DEGRADED: the pool does not answer; no call until it does
            self._count("degraded_requests")
            plan.pool_chunks, plan.declined = 0, False
            return 0, False
        try:
            hit = self.pool.lookup(plan.tenant, plan.keys)  # one round trip, no writes
        except Exception as e:  # noqa: BLE001 - a pool that cannot answer is a miss
            log.warning("KVPoolConnector: lookup failed (%s): recomputing", e)
            self._count("lookup_errors")
            hit = 0
        plan.pool_chunks = hit // self.chunk_tokens  # a producer saves only what the pool lacks
        ext = min(hit, plan.prompt_len - 1) - num_computed_tokens
        plan.declined = False
        if ext <= 0 or not self.loads:
            return 0, False
        shortest = self.breakeven.min_tokens(self.bytes_per_token)
        if ext < self.load_min_tokens or (shortest is not None and ext < shortest):
            plan.declined = True
            return 0, False
        return ext, self.async_loads

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        plan = self._plan(request)
        plan.sent = False  # a new or resumed request: send keys and the whole block list again
        if not plan.looked:  # (the allocation after an asynchronous load: counted)
            return
        plan.looked = False
        plan.counted = self.counts.admitted(plan.counted, plan.tid, request, num_external_tokens)
        if plan.tenant is None:
            return
        if num_external_tokens > 0 and self.async_loads:
            lo = plan.local
            plan.pending = (lo, lo + num_external_tokens, [list(b) for b in blocks.get_block_ids()])
        else:
            plan.load_tokens = num_external_tokens
        self._count("lookups")
        if num_external_tokens > 0:
            self._count("loads_planned")
            self._count("matched_tokens", num_external_tokens)
            self.breakeven.loaded += 1  # taken back if the worker says the load failed
        elif plan.declined:
            self._count("recomputed_by_breakeven")
            self.breakeven.recomputed += 1
        self._xfer_add("lookups")
        self._xfer_add("declined" if plan.declined and not num_external_tokens else
                       "misses" if not num_external_tokens else "loads_planned")

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PoolStepMeta:
        sched = scheduler_output.num_scheduled_tokens
        meta = PoolStepMeta(total_tokens=scheduler_output.total_num_scheduled_tokens)
        for req in scheduler_output.scheduled_new_reqs:
            n = sched.get(req.req_id, 0)
            meta.prefill_tokens += n
            self._add_step(meta, req.req_id, req.num_computed_tokens, n, [list(b) for b in req.block_ids], True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            n = sched.get(req_id, 0)
            if cached.is_context_phase(req_id):
                meta.prefill_tokens += n
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            self._add_step(meta, req_id, cached.num_computed_tokens[i], n,
                           [list(b) for b in new_blocks] if new_blocks is not None else [[] for _ in self.groups],
                           resumed)
        for req_id, plan in self._plans.items():
            if plan.pending is not None:  # asynchronous: this step's forward does not wait for it
                lo, hi, blocks = plan.pending
                meta.steps.append(ReqStep(req_id, computed_before=hi, computed_after=hi, block_ids=blocks,
                                          replace_blocks=True, keys=plan.keys, tenant=plan.tenant,
                                          pool_chunks=plan.pool_chunks, load=(lo, hi), load_async=True,
                                          tid=plan.tid))
                plan.pending, plan.sent = None, True
        return meta

    def _add_step(self, meta: PoolStepMeta, req_id: str, computed: int, scheduled: int, blocks: list[list[int]],
                  whole_list: bool) -> None:
        plan = self._plans.get(req_id)
        if plan is None or plan.tenant is None:
            return
        full = len(plan.keys) * self.chunk_tokens
        if plan.sent and computed >= full and not plan.load_tokens:
            # Every whole prompt chunk is computed (and saved): nothing left to tell the worker.
            # NOTE: blocks appended from here on are not sent; a preempted request resumes with
            # its whole block list, and a failed load resets ``computed`` below ``full``.
            return
        step = ReqStep(req_id, computed_before=computed, computed_after=min(computed + scheduled, plan.prompt_len),
                       block_ids=blocks, replace_blocks=whole_list or not plan.sent)
        if not plan.sent:
            step.keys, step.tenant, step.pool_chunks, step.tid = plan.keys, plan.tenant, plan.pool_chunks, plan.tid
            plan.sent = True
        if plan.load_tokens:
            step.load = (computed - plan.load_tokens, computed)
            plan.load_tokens = 0
        meta.steps.append(step)

    def update_connector_output(self, connector_output) -> None:
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            plan = self._plans.get(req_id)
            if plan is not None:
                plan.load_failed = True
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, PoolWorkerMeta):
            return
        for nbytes, s in wm.load_samples:
            self.breakeven.observe_load(nbytes, s)
        for _tid, kept, s in wm.loads.values():  # the loads that brought tokens vLLM keeps: the pool's hits
            if kept:
                self.counts.loaded(kept)
                self._xfer_add("loads")
                self._xfer_add("loaded_tokens", kept)
                self._xfer.setdefault("load_seconds", []).append(s)
        if wm.loads and self.reporter is not None:
            self.reporter.poke()
        for tokens, s in wm.prefill_samples:
            self.breakeven.observe_prefill(tokens, s)
        # NOTE: vLLM counted every planned load as a hit when it admitted the request (its
        # connector_prefix_cache_stats, before any load ran); kvpool's own figures count only the
        # loads that succeeded: one that failed is taken back here.
        self.breakeven.loaded = max(0, self.breakeven.loaded - wm.counters.get("load_failures", 0))
        for k, v in wm.counters.items():
            self._count(k, v)
            if k in ("load_failures", "failed_tokens") or k.startswith(FAILURE):
                self._xfer_add(k, v)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        plan = self._plans.pop(request.request_id, None)
        if plan is not None:
            self.counts.finished(plan.counted, plan.tid, request)
        return False, None  # saves finish inside the step (wait_for_save): the blocks can go now

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.step_started()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, PoolStepMeta):
            self.worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the whole load finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saved once per step in wait_for_save, all layers together

    def wait_for_save(self):
        meta = self._connector_metadata
        if isinstance(meta, PoolStepMeta):
            self.worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The asynchronous loads this step ran (every rank reports each: vLLM waits for all), and
        which of them failed; saves finish inside the step, so none is ever pending."""
        self.worker.forget(finished_req_ids)
        done, failed = self.worker.take_transfers()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks()

    def build_connector_worker_meta(self) -> PoolWorkerMeta | None:
        return self.worker.take_meta() if self.worker is not None else None
