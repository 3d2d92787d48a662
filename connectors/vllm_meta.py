"""What the vLLM connector's two halves tell each other, and the config it reads.

vLLM builds the connector twice: a scheduler half (decides what to load, once per step) and a
worker half (copies between the paged cache and the pool). The scheduler sends a
``PoolStepMeta`` with every step; the worker sends a ``PoolWorkerMeta`` back (its measured load
and prefill figures and its counters), so the load-or-recompute decision is made where the
figures are needed even when the two halves live in different processes. Both are plain
picklable dataclasses: vLLM ships them between processes when it runs multiprocess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpool.errors import BadRequest

# A tenant name in a request's kv_transfer_params: no longer honoured (a request's tenant comes from
# its cache_salt, kvpool.connectors.tenancy), only detected, counted and logged.
PARAM_TENANT = "kvpool_tenant"


@dataclass
class ReqStep:
    """One request's part of one engine step.

    ``keys`` (the chunk keys of the prompt's whole chunks), ``tenant`` and ``pool_chunks`` come
    with the request's first step and again when it resumes after a preemption; later steps carry
    only new blocks and how far the prompt is computed."""

    req_id: str
    computed_before: int  # tokens vLLM counts as computed before this step (local + loaded)
    computed_after: int  # prompt tokens whose KV is in the cache once this step ran
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group (vLLM's order)
    replace_blocks: bool = False  # a new or resumed request: block_ids are the whole lists
    keys: list[Any] | None = None
    tenant: str | None = None  # what the pool is passed: the tenant's credential (secured pool) or id
    pool_chunks: int = 0  # leading chunks the pool held at lookup (not saved again)
    load: tuple[int, int] | None = None  # token range [lo, hi) to load from the pool this step
    load_async: bool = False  # the load runs after the forward and is reported by request (several groups)
    tid: str = ""  # the tenant's id, for per-tenant figures (``tenant`` may be a credential), with ``keys``


@dataclass
class PoolStepMeta(KVConnectorMetadata):
    steps: list[ReqStep] = field(default_factory=list)
    total_tokens: int = 0  # tokens the forward computes this step (all requests)
    prefill_tokens: int = 0  # of which prompt tokens (the prefill cost is measured on these)


@dataclass
class PoolWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step with news: samples for BreakEven and counters. vLLM
    aggregates one per rank of a parallel engine (its KVOutputAggregator): the ranks ran the same
    requests, each on its slices, so a counter is the largest of the ranks' (a load that failed on
    one rank failed for the request; the rank that writes a replicated head counts its saves)."""

    load_samples: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    prefill_samples: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)
    counters: dict[str, int] = field(default_factory=dict)
    # each load run this step, by request: (tenant id, tokens vLLM keeps of it, seconds). Over the
    # ranks: the tokens every rank loaded (vLLM recomputes from any rank's first failed block), the
    # slowest rank's time.
    loads: dict[str, tuple[str, int, float]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if not isinstance(other, PoolWorkerMeta):
            return self
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = max(counters.get(k, 0), v)
        loads = dict(self.loads)
        for rid, (tid, kept, s) in other.loads.items():
            mine = loads.get(rid)
            loads[rid] = (tid, kept, s) if mine is None else (tid, min(mine[1], kept), max(mine[2], s))
        return PoolWorkerMeta(self.load_samples + other.load_samples,
                              self.prefill_samples + other.prefill_samples, counters, loads)

    def __bool__(self) -> bool:
        return bool(self.load_samples or self.prefill_samples or self.counters or self.loads)


ROLES = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}  # (loads, saves)


def role_of(kv_role: object) -> tuple[bool, bool]:
    """(loads, saves) of a ``kv_role``: ``kv_both``; ``kv_producer`` (a prefill instance: saves, never
    loads); ``kv_consumer`` (a decode instance: loads, never saves)."""
    if kv_role not in ROLES:
        raise BadRequest(f"KVPoolConnector: kv_role {kv_role!r} is not one of {sorted(ROLES)}")
    return ROLES[kv_role]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
