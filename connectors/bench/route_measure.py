"""What ``kvpool bench route`` measures per request and reports per arm (:mod:`.route`).

Per request, from the counters around it: the instance's own GPU-cache tokens (vLLM's
``prompt_tokens_cached_by_source{source="device"}``), the pool's (``source="host"``), of those
the ones read from another node (the shards' ``peer_fetched`` slices, a chunk's worth per KV head),
and the rest prefilled. *Same-node* tokens are the own cache's and the node shard's.
"""

from __future__ import annotations

import random
import time
from statistics import fmean, median
from typing import Any

from kvpool.connectors.bench.node_pool_proc import CHUNK_TOKENS

ARMS = ("tier-aware", "round-robin")


class Meter:
    def __init__(self, servers: list, pool, kv_heads: int) -> None:
        from kvpool.node.client import NodeClient

        self.servers = {f"http://127.0.0.1:{s.port}": s for s in servers}
        self.shards = {sid: NodeClient(pool="default", shard=sid, directory=pool.run_dir, timeout_s=10.0)
                       for sid in pool.shards()}
        self.kv_heads = kv_heads

    def _snapshot(self) -> dict[str, Any]:
        return {"servers": {u: s.metrics() for u, s in self.servers.items()},
                "fetched": sum(int(c.shard_stats().get("peer_fetched", 0)) for c in self.shards.values())}

    def _after(self, before: dict, instance: str) -> dict:
        """Once the instance has published the request's figures (after the step that ended it)."""
        key = "time_to_first_token_seconds_count"
        deadline = time.monotonic() + 5
        while True:
            after = self._snapshot()
            if after["servers"][instance].get(key, 0) > before["servers"][instance].get(key, 0) \
                    or time.monotonic() > deadline:
                return after

    def run(self, arms: dict[str, list], clients: dict, turns: int, answer_tokens: int) -> dict[str, Any]:
        """Every turn of every conversation in both arms (the conversations of a turn in a shuffled
        order, the same in both), one request at a time, the arms alternating."""
        recs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        step = 0
        for k in range(turns):
            order = list(range(len(arms[ARMS[0]])))
            random.Random(k).shuffle(order)  # NOTE: users come back in any order (round-robin is no placement)
            for c in order:
                for arm in (ARMS if step % 2 == 0 else ARMS[::-1]):
                    conv = arms[arm][c]
                    prompt = conv.prompt(k)
                    before = self._snapshot()
                    got = clients[arm].complete(prompt, conv.secret, answer_tokens)
                    after = self._after(before, got["instance"])
                    conv.answers.append(got["tokens"])
                    d = {key: after["servers"][got["instance"]].get(key, 0) - before["servers"][got["instance"]].get(key, 0)
                         for key in ("cached_device", "cached_host")}
                    remote = (after["fetched"] - before["fetched"]) * CHUNK_TOKENS // self.kv_heads
                    host = int(d["cached_host"])
                    recs[arm].append({"instance": got["instance"], "turn": k, "ttft_s": got["ttft_s"], "prompt": len(prompt),
                                      "gpu": int(d["cached_device"]), "node": max(0, host - remote),
                                      "remote": min(host, remote), "tiers_expected": got["tiers"]})
                step += 1
        same = all(a.answers == b.answers for a, b in zip(arms[ARMS[0]], arms[ARMS[1]]))
        return {**{arm: _arm(recs[arm]) for arm in ARMS}, "same_answers": same}

    def close(self) -> None:
        for c in self.shards.values():
            c.close()


def _arm(recs: list[dict]) -> dict[str, Any]:
    tokens = sum(r["prompt"] for r in recs)
    got = {t: sum(r[t] for r in recs) for t in ("gpu", "node", "remote")}
    where: dict[str, int] = {}
    for r in recs:
        where[r["instance"]] = where.get(r["instance"], 0) + 1
    ttfts = [r["ttft_s"] for r in recs]
    later = [r["ttft_s"] for r in recs if r["turn"] > 0] or ttfts
    return {"requests": len(recs), "prompt_tokens": tokens, "ttft_median_s": median(ttfts), "ttft_mean_s": fmean(ttfts),
            "followup_ttft_median_s": median(later),
            **{f"{t}_tokens": n for t, n in got.items()}, "prefilled_tokens": tokens - sum(got.values()),
            "same_node_share": (got["gpu"] + got["node"]) / tokens, "remote_share": got["remote"] / tokens,
            "requests_by_instance": where, "requests_detail": recs}


def summarize(shape: dict, rows: list[dict], shards: list[str]) -> dict[str, Any]:
    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": median(xs), "min": min(xs), "max": max(xs)}

    out: dict[str, Any] = {"bench": "route", **shape, "shards": shards, "arms": {},
                           "ttft": "wall time to the first streamed token through the router",
                           "protocol": "two vLLM servers on a two-node pool, one router per arm (tier-aware, "
                                       "round-robin) in front of both; the arms' conversations alternate, one request "
                                       "at a time, as different tenants with the same tokens"}
    for arm in ARMS:
        out["arms"][arm] = {k: spread([r[arm][k] for r in rows]) for k in
                            ("ttft_median_s", "ttft_mean_s", "followup_ttft_median_s", "same_node_share",
                             "remote_share")}
    for key, name in (("ttft_median_s", "round_robin_over_tier_aware_ttft"),
                      ("followup_ttft_median_s", "round_robin_over_tier_aware_followup_ttft")):
        out[name] = spread([r["round-robin"][key] / r["tier-aware"][key] for r in rows])
    out["same_answers"] = all(r["same_answers"] for r in rows)
    out["ok"] = out["same_answers"]
    out["runs_detail"] = rows
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"kvpool bench route: {result['runs']} runs, {result['tenants']} tenants an arm x "
             f"{result['conversations']} conversations x {result['turns']} turns (system prompt "
             f"{result['system_tokens']}, user turns {result['user_tokens']}, answers {result['answer_tokens']} tokens; "
             f"model {result['model']}); TTFT = {result['ttft']}; medians over runs (range)",
             f"{'arm':<13}{'TTFT s':>8}{'range':>14}{'follow-ups s':>14}{'range':>14}{'same-node':>11}{'range':>14}"
             f"{'remote':>8}"]
    for arm, a in result["arms"].items():
        t, f, s = a["ttft_median_s"], a["followup_ttft_median_s"], a["same_node_share"]
        lines.append(f"{arm:<13}{t['median']:>8.3f}{t['min']:>7.3f}-{t['max']:<6.3f}{f['median']:>14.3f}"
                     f"{f['min']:>7.3f}-{f['max']:<6.3f}{s['median']:>11.1%}{s['min']:>7.1%}-{s['max']:<6.1%}"
                     f"{a['remote_share']['median']:>8.1%}")
    r, f = result["round_robin_over_tier_aware_ttft"], result["round_robin_over_tier_aware_followup_ttft"]
    lines.append(f"round-robin / tier-aware median TTFT: {r['median']:.2f}x (range {r['min']:.2f}-{r['max']:.2f}x), "
                 f"follow-up turns {f['median']:.2f}x ({f['min']:.2f}-{f['max']:.2f}x); answers "
                 f"{'equal in every run' if result['same_answers'] else 'DIFFER'}")
    return "\n".join(lines)
