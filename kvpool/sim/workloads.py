"""Workload generators, so `kvpool sim` runs with no trace file: multi-turn chat, RAG over a
shared corpus, agents with tool schemas, and many tenants.

A prompt is a list of *segments* (an id and a length in tokens): a tenant's system prompt, a
document, a tool schema, a user turn, a model answer. A block's identity is the segments it
covers and where, chained to its parent like a real chunk key, so two prompts share exactly the
blocks a real pool would let them share (whole 512-token blocks of a common prefix).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.errors import BadRequest
from kvpool.sim.trace import BLOCK_TOKENS, SimRequest

Segment = tuple[object, int]  # (identity, tokens)


class BlockNamer:
    """Chained block ids: the same content under the same parent always gets the same id."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def blocks(self, tenant: int, segments: list[Segment]) -> tuple[tuple[int, ...], int]:
        """Block ids of the prompt made of ``segments``, and its length in tokens."""
        pieces: list[tuple] = []
        out: list[int] = []
        parent = -1 - tenant  # tenants never share a root
        fill = 0
        total = 0
        ids = self._ids
        for seg_id, length in segments:
            off = 0
            while off < length:
                take = min(length - off, BLOCK_TOKENS - fill)
                pieces.append((seg_id, off, take))
                off += take
                fill += take
                total += take
                if fill == BLOCK_TOKENS:
                    parent = ids.setdefault((parent, tuple(pieces)), len(ids))
                    out.append(parent)
                    pieces, fill = [], 0
        if pieces:
            out.append(ids.setdefault((parent, tuple(pieces)), len(ids)))
        return tuple(out), total


def _lognormal(rng: np.random.Generator, mean: float, sigma: float = 0.6) -> int:
    mu = np.log(mean) - sigma * sigma / 2
    return max(16, int(rng.lognormal(mu, sigma)))


def _zipf_choice(rng: np.random.Generator, n: int, s: float) -> int:
    w = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=w / w.sum()))


class _Sessions:
    """Sessions arrive as a Poisson process; each yields timed prompts. Merged by time."""

    def __init__(self, rng: np.random.Generator, rate_per_s: float) -> None:
        self.rng = rng
        self.rate = rate_per_s

    def run(self, n_requests: int, make_session: Callable[[int, float], list[tuple[float, int, list[Segment]]]]
            ) -> list[tuple[float, int, list[Segment]]]:
        out: list[tuple[float, int, list[Segment]]] = []
        t = 0.0
        sid = 0
        while len(out) < n_requests:
            t += self.rng.exponential(1.0 / self.rate)
            out.extend(make_session(sid, t))
            sid += 1
        out.sort(key=lambda x: x[0])
        return out[:n_requests]


def chat(n_requests: int = 10000, seed: int = 0, tenants: int = 4, rate_per_s: float = 2.0,
         mean_turns: float = 4.0, think_s: float = 120.0) -> list[SimRequest]:
    """Multi-turn chat: every turn resends the whole history (system prompt, earlier turns)."""
    rng = np.random.default_rng(seed)
    system_len = {t: int(rng.integers(600, 2500)) for t in range(tenants)}

    def session(sid: int, t0: float):
        tenant = int(rng.integers(tenants))
        history: list[Segment] = [(("sys", tenant), system_len[tenant])]
        turns = int(rng.geometric(1.0 / mean_turns))
        out, t = [], t0
        for k in range(turns):
            history = history + [(("user", sid, k), _lognormal(rng, 300))]
            out.append((t, tenant, list(history)))
            history = history + [(("answer", sid, k), _lognormal(rng, 400))]
            t += rng.exponential(think_s)
        return out

    return _build(_Sessions(rng, rate_per_s).run(n_requests, session))


def rag(n_requests: int = 10000, seed: int = 0, corpus: int = 2000, docs_per_query: int = 3,
        zipf: float = 1.1, rate_per_s: float = 3.0) -> list[SimRequest]:
    """RAG: a shared system prompt, then long retrieved documents (popular ones more often), then
    the question. Two queries share blocks up to their first differing document."""
    rng = np.random.default_rng(seed)
    doc_len = rng.integers(1500, 4000, corpus)

    def session(sid: int, t0: float):
        docs = []
        while len(docs) < docs_per_query:
            d = _zipf_choice(rng, corpus, zipf)
            if d not in docs:
                docs.append(d)
        segs: list[Segment] = [(("sys",), 1000)] + [(("doc", d), int(doc_len[d])) for d in docs]
        segs.append((("question", sid), _lognormal(rng, 80)))
        return [(t0, 0, segs)]

    return _build(_Sessions(rng, rate_per_s).run(n_requests, session))


def agent(n_requests: int = 10000, seed: int = 0, toolsets: int = 6, mean_steps: float = 8.0,
          rate_per_s: float = 1.0, step_s: float = 20.0) -> list[SimRequest]:
    """Agents: a tool-schema prefix (one of a few), a task, then a loop where each step appends the
    model's call and the tool's observation and sends everything again."""
    rng = np.random.default_rng(seed)
    schema_len = rng.integers(3000, 9000, toolsets)

    def session(sid: int, t0: float):
        ts = int(rng.integers(toolsets))
        history: list[Segment] = [(("tools", ts), int(schema_len[ts])), (("task", sid), _lognormal(rng, 200))]
        out, t = [], t0
        for k in range(int(rng.geometric(1.0 / mean_steps))):
            out.append((t, 0, list(history)))
            history = history + [(("call", sid, k), _lognormal(rng, 150)), (("obs", sid, k), _lognormal(rng, 700))]
            t += rng.exponential(step_s)
        return out

    return _build(_Sessions(rng, rate_per_s).run(n_requests, session))


def tenants(n_requests: int = 10000, seed: int = 0, n_tenants: int = 50, zipf: float = 1.0) -> list[SimRequest]:
    """Many tenants of very different sizes, each chatting with its own system prompt; their
    namespaces never share a block."""
    rng = np.random.default_rng(seed)
    base = chat(n_requests, seed=seed + 1, tenants=n_tenants, rate_per_s=3.0)
    weights = 1.0 / np.arange(1, n_tenants + 1) ** zipf
    remap = {t: int(rng.choice(n_tenants, p=weights / weights.sum())) for t in range(n_tenants)}
    # Re-root each request under its remapped tenant: block ids stay chained and disjoint.
    out, namer_ids = [], {}
    for r in base:
        ten = remap[r.tenant]
        ids, parent = [], ("t", ten)
        for b in r.blocks:
            parent = namer_ids.setdefault((parent, b), len(namer_ids))
            ids.append(parent)
        out.append(SimRequest(r.time_s, tuple(ids), r.input_tokens, r.output_tokens, ten))
    return out


def _build(timed: list[tuple[float, int, list[Segment]]]) -> list[SimRequest]:
    namer = BlockNamer()
    out = []
    for t, tenant, segs in timed:
        blocks, tokens = namer.blocks(tenant, segs)
        out.append(SimRequest(t, blocks, tokens, 0, tenant))
    return out


WORKLOADS: dict[str, Callable[..., list[SimRequest]]] = {
    "chat": chat,
    "rag": rag,
    "agent": agent,
    "tenants": tenants,
}


def generate(name: str, n_requests: int = 10000, seed: int = 0) -> list[SimRequest]:
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise BadRequest(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None
    return fn(n_requests=n_requests, seed=seed)
