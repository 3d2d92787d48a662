"""``kvpool bench importance``: does the ``importance`` policy, told each chunk's attention mass by
the real model at save time, keep more of what comes back than ``adaptive``?

Workload (long shared documents, a few hot ones, cold ones streaming through): ``docs`` passages of
real English (:mod:`kvpool.connectors.bench.quality_text`), ``doc_tokens`` each. Each of ``tenants``
tenants keeps asking about its own hot document (``hot`` of them, ``p_hot`` of the requests), the
other requests ask about the cold documents in turn, for a random tenant; a request's prompt is
its document then one of a few questions. The pool holds ``capacity`` chunks, well under the
working set, so it must evict.

How: the attention mass of each prompt's chunks comes from the model, once per distinct prompt,
as the transformers connector computes it on save (:func:`kvpool.connectors.compress.chunk_attention`:
the last ``window`` queries' attention per chunk, relative to the most attended chunk). The
trace is then replayed through a real :class:`kvpool.pool.LocalPool` with the connector's call
sequence (lookup, begin, load, save with ``attention``, end), once per policy and seed; payloads
are small zero chunks (the policy never reads bytes, and the hit rate depends on keys only).
Reported per policy: the token hit rate and the prompt tokens recomputed, as min..max over the
seeds. ``importance`` runs twice: with the model's attention and without (every chunk 0.5), so
what the attention itself adds is seen apart from the policy's other terms.
"""

from __future__ import annotations

import random

import torch

from kvpool.connectors.compress import chunk_attention
from kvpool.errors import BadRequest
from kvpool.progress import Progress

QUESTIONS = ("\n\nQuestion: What is the main point of the text above? Answer:",
             "\n\nQuestion: Which example in the text above matters most, and why? Answer:",
             "\n\nQuestion: Summarize the last paragraph above in one sentence. Answer:")
POLICIES = (("lru", False), ("adaptive", False), ("importance", False), ("importance", True))


def _documents(model_name: str, docs: int, doc_tokens: int):
    """(model, [doc ids], [question ids]) of the real model and text, or a random-weight model and tokens."""
    if model_name == "smollm2":
        from kvpool.connectors.bench import quality_text
        from kvpool.connectors.demo import smollm2

        model, tok = smollm2.load()
        texts = [ids for _, ids in quality_text.passages(tok, docs, doc_tokens)]
        questions = [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
        return model, texts, questions
    if model_name == "tiny":
        from kvpool.connectors.hf_model import tiny_llama

        g = torch.Generator().manual_seed(0)
        texts = [torch.randint(0, 1024, (doc_tokens,), generator=g).tolist() for _ in range(docs)]
        return tiny_llama(0, layers=2), texts, [torch.randint(0, 1024, (12,), generator=g).tolist() for _ in QUESTIONS]
    raise BadRequest(f"--model {model_name!r}: use smollm2 (the real model) or tiny (a random-weight smoke test)")


@torch.no_grad()
def attention_table(model, texts, questions, chunk_tokens: int, window: int, progress: bool) -> dict:
    """``{(doc, question): per-chunk attention}`` of every distinct prompt, from the model."""
    from transformers import DynamicCache

    out = {}
    with Progress(len(texts) * len(questions), "attention of each prompt", enabled=progress) as bar:
        for d, text in enumerate(texts):
            for q, question in enumerate(questions):
                ids = torch.tensor([text + question])
                cache = DynamicCache()
                model(input_ids=ids, cache=cache, use_cache=True)
                out[d, q] = chunk_attention(model, cache, ids, chunk_tokens, window=window)
                bar.advance()
    return out


def trace(seed: int, requests: int, docs: int, hot: int, tenants: int, p_hot: float, questions: int):
    """``[(tenant, doc, question)]``: tenant t asks about hot document ``t % hot`` with probability
    ``p_hot``; otherwise a random tenant asks about the next cold document."""
    rng = random.Random(seed)
    cold = list(range(hot, docs))
    out, nxt = [], 0
    for _ in range(requests):
        t = rng.randrange(tenants)
        if rng.random() < p_hot or not cold:
            out.append((t, t % hot, rng.randrange(questions)))
        else:
            out.append((t, cold[nxt % len(cold)], rng.randrange(questions)))
            nxt += 1
    return out


def replay(policy: str, use_attention: bool, requests, texts, questions, attention, *, capacity: int,
           chunk_tokens: int, tenants: int) -> dict:
    """Hit rate and recomputed tokens of one policy on one trace, through a LocalPool."""
    from kvpool.pool import LocalPool
    from kvpool.spec import KVSpec
    from kvpool.tenants import Tenant, TenantRegistry

    spec = KVSpec("bench/importance", 1, 1, 4, dtype="float16", block_size=chunk_tokens, chunk_tokens=chunk_tokens)
    names = [f"t{i}" for i in range(tenants)]
    pool = LocalPool.create(spec, TenantRegistry([Tenant(n) for n in names]), capacity, policy=policy)
    zero = torch.zeros(spec.num_layers, 2, chunk_tokens, 1, 4, dtype=torch.float16)
    total = loaded = 0
    for t, d, q in requests:
        tenant, ids = names[t], texts[d] + questions[q]
        keys = pool.keys(tenant, ids)
        hit = min(pool.lookup(tenant, keys), len(ids) - 1) // chunk_tokens
        request = pool.begin(tenant, keys)
        try:
            got = len(pool.load(tenant, keys[:hit])) if hit else 0
            att = attention[d, q] if use_attention else None
            if len(keys) > got:
                pool.save(tenant, keys, [zero] * (len(keys) - got), start=got, request=request, attention=att)
        finally:
            pool.end(request)
        total += len(ids)
        loaded += got * chunk_tokens
    return {"hit_rate": loaded / total, "recomputed_tokens": total - loaded}


def run(*, model_name: str = "smollm2", docs: int = 11, hot: int = 3, doc_tokens: int = 512, chunk_tokens: int = 32,
        tenants: int = 3, p_hot: float = 0.6, requests: int = 300, capacity: int = 64, window: int = 32,
        seeds: int = 3, progress: bool = True) -> dict:
    if not 1 <= hot < docs:
        raise BadRequest(f"hot={hot} must be at least 1 and below docs={docs}: some documents must be cold")
    torch.set_num_threads(1)  # NOTE: on a shared machine one thread ran several times faster than two
    model, texts, questions = _documents(model_name, docs, doc_tokens)
    attention = attention_table(model, texts, questions, chunk_tokens, window, progress)
    rows = []
    with Progress(len(POLICIES) * seeds, "replaying", enabled=progress) as bar:
        for policy, use in POLICIES:
            runs = []
            for seed in range(seeds):
                reqs = trace(seed, requests, docs, hot, tenants, p_hot, len(questions))
                runs.append(replay(policy, use, reqs, texts, questions, attention, capacity=capacity,
                                   chunk_tokens=chunk_tokens, tenants=tenants))
                bar.advance()
            rows.append({"policy": policy, "attention": use,
                         "hit_rate": [min(r["hit_rate"] for r in runs), max(r["hit_rate"] for r in runs)],
                         "recomputed_tokens": [min(r["recomputed_tokens"] for r in runs),
                                               max(r["recomputed_tokens"] for r in runs)],
                         "runs": runs})
    flat = [a for v in attention.values() for a in v]
    return {"model": model_name, "workload": {
        "docs": docs, "hot": hot, "doc_tokens": doc_tokens, "chunk_tokens": chunk_tokens, "tenants": tenants,
        "p_hot": p_hot, "requests": requests, "capacity_chunks": capacity, "window": window, "seeds": seeds,
        "working_set_chunks": docs * (doc_tokens // chunk_tokens),
        "attention_mean": sum(flat) / max(len(flat), 1)}, "rows": rows}


def format_table(result: dict) -> str:
    w = result["workload"]
    lines = [f"importance vs adaptive on {result['model']}: {w['docs']} docs of {w['doc_tokens']} tokens "
             f"({w['hot']} hot, p_hot {w['p_hot']}), {w['tenants']} tenants, {w['requests']} requests, pool "
             f"{w['capacity_chunks']} chunks of {w['chunk_tokens']} tokens; min..max over {w['seeds']} seeds",
             f"{'policy':<30}{'hit rate':>18}{'recomputed tokens':>24}"]
    for r in result["rows"]:
        name = r["policy"] + (" (model attention)" if r["attention"] else "")
        h, c = r["hit_rate"], r["recomputed_tokens"]
        lines.append(f"{name:<30}{h[0]:>9.3f}..{h[1]:<7.3f}{c[0]:>14}..{c[1]:<8}")
    return "\n".join(lines)
