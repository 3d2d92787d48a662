"""The real-model demo: multi-turn chats over documents, served twice per request.

Every request runs once without the pool (the baseline: the whole prompt is prefilled) and once
through it (its longest cached prefix is loaded, the rest prefilled, the new whole chunks saved),
each decoding its greedy answer on its own. The answers must be the same tokens: a difference
fails the demo. What it measures: per tenant, the prompt tokens that came from the pool; per
request, the time to the first token both ways and the largest difference of the first token's
logits.
"""

from __future__ import annotations

import re
import statistics
import textwrap
from dataclasses import dataclass

import torch

from kvpool.connectors.demo.smollm2 import chat_ids
from kvpool.connectors.demo.workload import Conversation, first_message
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import cache_argument
from kvpool.progress import Progress


@dataclass
class Answer:
    tokens: list[int]
    first_logits: torch.Tensor
    ttft_s: float  # the prefill that gives the first token's logits (with the pool: lookup, load, save too)
    loaded_tokens: int


@torch.no_grad()
def greedy(conn: HFConnector, ids: list[int], tenant: str, *, use_pool: bool, max_new_tokens: int,
           stop: set[int]) -> Answer:
    """Greedy decoding after a prefill with or without the pool, until a stop token or the limit."""
    first = conn.prefill(ids, tenant=tenant, use_pool=use_pool)
    logits = first.logits[0, -1].float().cpu()
    arg, cache, tokens = cache_argument(conn.model), first.cache, []
    device = next(conn.model.parameters()).device
    nxt = int(logits.argmax())
    while nxt not in stop and len(tokens) < max_new_tokens:
        tokens.append(nxt)
        if len(tokens) == max_new_tokens:
            break
        out = conn.model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True, **{arg: cache})
        nxt = int(out.logits[0, -1].argmax())
    return Answer(tokens, logits, first.seconds, first.loaded_tokens)


def serve(model, tok, pool, convs: list[Conversation], *, max_new_tokens: int, progress: bool) -> dict:
    """Serves the conversations turn by turn (every conversation's turn 1, then every turn 2, ...),
    each request without and with the pool; returns per-request records and per-tenant sums."""
    conn = HFConnector(model, pool)
    stop = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if t is not None}
    history = [[{"role": "system", "content": c.work.system}] for c in convs]
    turns = max(len(c.questions) for c in convs)
    records = []
    with Progress(sum(len(c.questions) for c in convs), "demo", enabled=progress) as bar:
        for turn in range(turns):
            for conv, messages in zip(convs, history):
                if turn >= len(conv.questions):
                    continue
                q = conv.questions[turn]
                messages.append({"role": "user", "content": first_message(conv.work, q) if turn == 0 else q})
                ids = chat_ids(tok, messages)
                tenant = conv.work.tenant
                base = greedy(conn, ids, tenant, use_pool=False, max_new_tokens=max_new_tokens, stop=stop)
                pooled = greedy(conn, ids, tenant, use_pool=True, max_new_tokens=max_new_tokens, stop=stop)
                text = tok.decode(base.tokens, skip_special_tokens=True).strip()
                messages.append({"role": "assistant", "content": text})  # the baseline's answer goes on
                records.append({
                    "tenant": tenant, "conversation": conv.number, "turn": turn + 1, "question": q,
                    "answer": text, "answer_with_pool": tok.decode(pooled.tokens, skip_special_tokens=True).strip(),
                    "prompt_tokens": len(ids), "loaded_tokens": pooled.loaded_tokens,
                    "new_tokens": len(base.tokens), "finished": len(base.tokens) < max_new_tokens,
                    "same_tokens": base.tokens == pooled.tokens,
                    "first_logit_max_abs_diff": float((base.first_logits - pooled.first_logits).abs().max()),
                    "ttft_no_pool_s": base.ttft_s, "ttft_pool_s": pooled.ttft_s,
                })
                bar.advance(note=tenant)
    return {"requests": records, "tenants": _per_tenant(records), "ttft": _ttft(records),
            "verified": sum(r["same_tokens"] for r in records),
            "mismatches": [r for r in records if not r["same_tokens"]],
            "max_first_logit_diff": max((r["first_logit_max_abs_diff"] for r in records), default=0.0),
            "ok": all(r["same_tokens"] for r in records), "breakeven": conn.breakeven.stats()}


def _per_tenant(records: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for r in records:
        s = out.setdefault(r["tenant"], {"requests": 0, "prompt_tokens": 0, "loaded_tokens": 0,
                                         "ttft_no_pool_s": [], "ttft_pool_s": []})
        s["requests"] += 1
        s["prompt_tokens"] += r["prompt_tokens"]
        s["loaded_tokens"] += r["loaded_tokens"]
        s["ttft_no_pool_s"].append(r["ttft_no_pool_s"])
        s["ttft_pool_s"].append(r["ttft_pool_s"])
    for s in out.values():
        s["hit_rate"] = s["loaded_tokens"] / max(s["prompt_tokens"], 1)
    return out


def _ttft(records: list[dict]) -> dict:
    """TTFT both ways over the requests that found a cached prefix (the others cannot gain)."""
    hit = [r for r in records if r["loaded_tokens"]]
    if not hit:
        return {"requests": 0}
    ratios = [r["ttft_no_pool_s"] / r["ttft_pool_s"] for r in hit]
    return {"requests": len(hit), "median_no_pool_s": statistics.median(r["ttft_no_pool_s"] for r in hit),
            "median_pool_s": statistics.median(r["ttft_pool_s"] for r in hit),
            "speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios)}


def format_report(result: dict, width: int = 100) -> str:
    spec = result["spec"]
    lines = [
        f"kvpool demo: {result['model_name']} ({spec['model_id']}; {spec['num_layers']} layers, {spec['num_kv_heads']} KV heads x "
        f"{spec['head_dim']}, {spec['dtype']}) on the {result['where']}; chunks of {spec['chunk_tokens']} tokens",
        f"every request is served twice, without the pool and then through it, each decoding its own greedy "
        f"answer (up to {result['max_new_tokens']} tokens)",
        "documents (shipped with Python): " + "; ".join(
            f"{d['title']} [{d['source']}, {d['tokens']} tokens]" for d in result["documents"]),
    ]
    current = None
    for r in result["requests"]:
        if (r["tenant"], r["conversation"]) != current:
            current = (r["tenant"], r["conversation"])
            lines += ["", f"{r['tenant']}, conversation {r['conversation']}"]
        lines.append(textwrap.fill(r["question"], width, initial_indent=f"  Q{r['turn']}: ", subsequent_indent=" " * 6))
        lines.append(textwrap.fill(shown(r["answer"], r["finished"]), width, initial_indent=f"  A{r['turn']}: ",
                                   subsequent_indent=" " * 6))
        speed = r["ttft_no_pool_s"] / r["ttft_pool_s"]
        lines.append(f"      [{r['loaded_tokens']}/{r['prompt_tokens']} prompt tokens from the pool; first token "
                     f"{_ms(r['ttft_no_pool_s'])} -> {_ms(r['ttft_pool_s'])} ({speed:.1f}x); "
                     + (f"same {r['new_tokens']} tokens]" if r["same_tokens"] else "DIFFERENT ANSWER with the pool]"))
        if not r["same_tokens"]:
            lines.append(textwrap.fill(r["answer_with_pool"], width, initial_indent="  A with the pool: ",
                                       subsequent_indent=" " * 6))
    lines += ["", f"{'tenant':<10}{'requests':>9}{'prompt tokens':>15}{'from pool':>11}{'hit rate':>10}"
                  f"{'TTFT no pool':>14}{'TTFT pool':>11}   (medians)"]
    for name, s in result["tenants"].items():
        lines.append(f"{name:<10}{s['requests']:>9}{s['prompt_tokens']:>15}{s['loaded_tokens']:>11}"
                     f"{s['hit_rate']:>10.1%}{_ms(statistics.median(s['ttft_no_pool_s'])):>14}"
                     f"{_ms(statistics.median(s['ttft_pool_s'])):>11}")
    t = result["ttft"]
    if t["requests"]:
        lines.append(f"time to first token of the {t['requests']} requests with a cached prefix: median "
                     f"{_ms(t['median_no_pool_s'])} without the pool, {_ms(t['median_pool_s'])} with it; "
                     f"speed-up median {t['speedup_median']:.1f}x (range {t['speedup_min']:.1f}x-"
                     f"{t['speedup_max']:.1f}x)")
    st, n = result["store"], len(result["requests"])
    dram, m = st["tiers"]["dram"], st["metrics"]
    lines += [
        f"pool: {st['chunks']} chunks, {dram['bytes'] / 2**20:.0f} MiB in dram ({dram['pages_used']}/"
        f"{dram['pages_total']} pages), evictions {sum(m['evictions'].values()):.0f}, checksum failures "
        f"{sum(m['checksum_failures'].values()):.0f}",
        f"verified: {result['verified']} of {n} answers are the same greedy tokens with and without the pool; "
        f"first-token logits differ by at most {result['max_first_logit_diff']:.1e}",
    ]
    if not result["ok"]:
        lines.append(f"FAILED: {n - result['verified']} of {n} answers changed when their prefix came from the pool")
    return "\n".join(lines)


def shown(answer: str, finished: bool) -> str:
    """An answer as the report shows it: one cut off by the token limit ends at its last whole
    sentence (when that keeps most of it), marked ``[...]``."""
    if finished:
        return answer
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", answer)]
    keep = ends[-1] if ends and ends[-1] >= len(answer) // 3 else len(answer)
    return answer[:keep].rstrip() + " [...]"


def _ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{1e3 * seconds:.0f} ms"

