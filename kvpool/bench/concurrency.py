"""``kvpool bench concurrency``: the most concurrent chat sessions each strategy sustains in a
GPU's KV memory without running out of it, as a multiple of the no-eviction baseline.

The model (stated, so the figure can be argued with):
- The GPU's KV memory is the top tier: ``hbm_gib`` of pages of one chunk each (Llama-3-8B
  layout: 256 tokens = 32 MiB). ``tiered-memory`` adds DRAM (x4) and disk (x16) below it.
- N sessions run at once (closed loop). A session is a multi-turn chat: each turn sends the whole
  history (a per-tenant system prompt, earlier turns and answers), is *active* while it prefills
  what is not cached and decodes its answer, then the user thinks before the next turn. After the
  last turn a new session starts in the same slot.
- An active turn holds all its chunks (prompt and answer) in the top tier, leased: they cannot
  be evicted. Between turns a session's chunks are cached and the strategy decides what stays.
- Out of memory: a turn cannot get a page because nothing in the top tier can be evicted. A
  strategy sustains N if no turn runs out of memory over ``horizon_s`` of simulated time.
- Time: prefill at ``prefill_tok_s`` tokens/s for uncached prompt tokens, decode at
  ``decode_tok_s`` tokens/s per session.

Same cache and policy code as the pool (kvpool.cache, kvpool.policies).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from kvpool.cache import TieredCache
from kvpool.errors import PoolFull
from kvpool.policies import TIERED_MEMORY, Access, make_policy, policy_names
from kvpool.progress import Progress

# Not a pool policy: the engine frees a turn's KV when the turn ends (nothing is reused).
NO_CACHE = "no-cache"


@dataclass(frozen=True)
class Setup:
    hbm_gib: float = 16.0
    chunk_mib: float = 32.0  # Llama-3-8B, bf16, 256 tokens
    chunk_tokens: int = 256
    dram_ratio: int = 4
    disk_ratio: int = 16
    tenants: int = 8
    system_tokens: tuple[int, int] = (1000, 3000)
    user_tokens: float = 300.0
    answer_tokens: float = 350.0
    mean_turns: float = 5.0
    think_s: float = 30.0
    prefill_tok_s: float = 10000.0
    decode_tok_s: float = 40.0
    horizon_s: float = 600.0
    seed: int = 0

    @property
    def hbm_pages(self) -> int:
        return int(self.hbm_gib * 1024 / self.chunk_mib)


class _Session:
    __slots__ = ("sid", "tenant", "turn", "turns", "history", "rng")

    def __init__(self, sid: int, setup: Setup, rng: np.random.Generator) -> None:
        self.sid = sid
        self.rng = rng
        self.tenant = int(rng.integers(setup.tenants))
        self.turn = 0
        self.turns = int(rng.geometric(1.0 / setup.mean_turns))
        self.history = 0  # tokens after the system prompt


def _lognormal(rng: np.random.Generator, mean: float) -> int:
    return max(16, int(rng.lognormal(math.log(mean) - 0.18, 0.6)))


def simulate(policy: str, n: int, setup: Setup) -> dict:
    """Runs N concurrent sessions; returns whether memory ran out, and figures on the way."""
    rng = np.random.default_rng(setup.seed)
    sys_len = [int(rng.integers(*setup.system_tokens)) for _ in range(setup.tenants)]
    top = setup.hbm_pages
    no_cache = policy == NO_CACHE
    if no_cache:
        policy = "lru"
    if policy == TIERED_MEMORY:
        tiers, tier_policy = [top, top * setup.dram_ratio, top * setup.disk_ratio], "lru"
    else:
        tiers, tier_policy = [top], policy
    cache = TieredCache(tiers, lambda cap, res, t: make_policy(tier_policy, cap, res))
    res = cache.res
    ct = setup.chunk_tokens
    events: list[tuple[float, int, int]] = []  # (time, seq, slot): a slot's next turn starts
    sessions: list[_Session] = []
    next_sid = 0
    for slot in range(n):
        sessions.append(_Session(next_sid, setup, rng))
        next_sid += 1
        heapq.heappush(events, (float(rng.uniform(0, setup.think_s)), slot, slot))
    seq = n
    turns = hit_tok = prompt_tok = 0
    ttft = 0.0
    active_until: list[tuple[float, int, list[int], list[int]]] = []  # (end, seq, leased, transient)
    rid = 0
    while events:
        t, _, slot = heapq.heappop(events)
        if t > setup.horizon_s:
            break
        while active_until and active_until[0][0] <= t:  # turns that finished release their pages
            _, _, nodes, transient = heapq.heappop(active_until)
            cache.release(nodes)
            for nd in reversed(transient):  # pages the strategy does not keep after the turn
                if cache.node_key[nd] is not None and res.leases[nd] == 0 and res.children[nd] == 0:
                    cache.drop(nd, "evicted")
        s = sessions[slot]
        if s.turn >= s.turns:  # the session is over: a new user takes the slot
            s = sessions[slot] = _Session(next_sid, setup, rng)
            next_sid += 1
        user, answer = _lognormal(rng, setup.user_tokens), _lognormal(rng, setup.answer_tokens)
        prompt = sys_len[s.tenant] + s.history + user
        total = prompt + answer
        sys_full = sys_len[s.tenant] // ct

        def key(i: int, s=s, sys_full=sys_full, total=total) -> tuple:
            if i < sys_full:
                return ("sys", s.tenant, i)
            if (i + 1) * ct <= total:
                return ("s", s.sid, i)
            return ("partial", s.sid, i, s.turn)  # not reusable: the next turn fills it differently

        rid += 1
        keys = [key(i) for i in range(math.ceil(total / ct))]
        prompt_full = prompt // ct
        run = cache.leading_run(keys[:prompt_full])
        acc = Access(rid, t, len(keys), len(keys), len(run), s.tenant)
        transient: list[int] = []  # pages the strategy does not keep after the turn
        try:
            # An active turn needs its pages whatever the strategy keeps afterwards: held, leased.
            held = cache.serve(keys, acc, run, hold=True, keep=not no_cache, transient=transient)
        except PoolFull:
            return {"oom": True, "at_s": t, "turns": turns}
        hit = len(run) * ct
        prefill_s = (prompt - hit) / setup.prefill_tok_s
        end = t + prefill_s + answer / setup.decode_tok_s
        seq += 1
        heapq.heappush(active_until, (end, seq, held, transient))
        turns += 1
        hit_tok += hit
        prompt_tok += prompt
        ttft += prefill_s
        s.turn += 1
        s.history += user + answer
        seq += 1
        heapq.heappush(events, (end + float(rng.exponential(setup.think_s)), seq, slot))
    return {"oom": False, "turns": turns, "token_hit_rate": hit_tok / max(prompt_tok, 1),
            "mean_ttft_s": ttft / max(turns, 1)}


def max_concurrency(policy: str, setup: Setup, limit: int = 4096) -> tuple[int, dict]:
    """The largest N with no out-of-memory over the horizon (doubling, then bisection)."""
    lo, lo_res = 0, {}
    hi = 1
    while hi <= limit:
        r = simulate(policy, hi, setup)
        if r["oom"]:
            break
        lo, lo_res = hi, r
        hi *= 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = simulate(policy, mid, setup)
        if r["oom"]:
            hi = mid
        else:
            lo, lo_res = mid, r
    return lo, lo_res


def run(setup: Setup | None = None, policies: list[str] | None = None, progress: bool = True,
        seeds: tuple[int, ...] = (0, 1, 2)) -> dict:
    setup = setup or Setup()
    policies = policies or policy_names()
    policies = ["reject", NO_CACHE] + [p for p in policies if p not in ("reject", NO_CACHE)]
    rows = []
    t0 = time.perf_counter()
    with Progress(len(policies) * len(seeds), "bench concurrency", enabled=progress) as bar:
        for p in policies:
            # NOTE: "never out of memory over the horizon" is a maximum over time, so one trial is
            # noisy: the median over seeds is reported, and each seed's figure beside it.
            trials = []
            for seed in seeds:
                trials.append(max_concurrency(p, replace(setup, seed=seed)))
                bar.advance(note=p)
            trials.sort(key=lambda x: x[0])
            n, r = trials[len(trials) // 2]
            rows.append({"policy": p, "max_concurrency": n, "per_seed": [t[0] for t in trials],
                         **{k: v for k, v in r.items() if k != "oom"}})
    base = next(r["max_concurrency"] for r in rows if r["policy"] == "reject")
    nocache = next(r["max_concurrency"] for r in rows if r["policy"] == NO_CACHE)
    for r in rows:
        r["vs_no_eviction"] = r["max_concurrency"] / base if base else float("inf")
        r["vs_no_cache"] = r["max_concurrency"] / nocache if nocache else float("inf")
    return {"setup": asdict(setup), "hbm_pages": setup.hbm_pages, "rows": rows, "seconds": time.perf_counter() - t0}


def format_table(result: dict) -> str:
    s = result["setup"]
    lines = [
        f"KV memory {s['hbm_gib']} GiB = {result['hbm_pages']} chunks of {s['chunk_tokens']} tokens; "
        f"{s['horizon_s']:.0f} s of multi-turn chat per trial",
        f"{'policy':<16}{'max sessions':>13}{'vs no eviction':>16}{'vs no cache':>13}{'token hit rate':>16}"
        f"{'mean TTFT s':>13}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['policy']:<16}{r['max_concurrency']:>13}{r['vs_no_eviction']:>15.2f}x{r['vs_no_cache']:>12.2f}x"
            f"{r.get('token_hit_rate', 0):>16.1%}{r.get('mean_ttft_s', 0):>13.3f}"
        )
    return "\n".join(lines)
