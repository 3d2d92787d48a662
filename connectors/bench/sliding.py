"""``kvpool bench sliding``: what keeping every layer's KV costs a sliding-window model.

The transformers connector runs a model on a cache that keeps the whole prompt's KV in every
layer (the model's masks still apply its windows), so any prefix of whole chunks it saves is
correct for every layer. transformers' own cache keeps only the last ``W - 1`` tokens of a
sliding layer. Side by side, on one random-weight model with sliding layers (Mistral-like: every
layer sliding; Gemma-3-like: five sliding layers to one full), one prompt of ``--context``
tokens, each round:

- KV held until the prompt's chunks are saved (every layer, the whole prompt) and the cache the
  request decodes on afterwards, each against transformers' own cache after the prefill;
- prefill time: the connector's cold prefill (no pool hit) against one plain forward;
- decode time per token (20 greedy tokens) on each cache;
- pool bytes for the prompt: every layer's KV of every whole chunk (what the pool stores)
  against the least a window-aware store could keep (full layers: every chunk; sliding layers:
  the chunks inside the window at the prompt's end).
"""

from __future__ import annotations

import sys
import time

import torch

SHAPES = {
    # name: (config class, fields)
    "mistral-like": ("MistralConfig", dict(num_hidden_layers=8, sliding_window=1024)),
    "gemma3-like": ("Gemma3TextConfig", dict(num_hidden_layers=12, sliding_window=1024, sliding_window_pattern=6,
                                             head_dim=64)),
}
BASE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=32768, initializer_range=0.2, tie_word_embeddings=False)
DECODE = 20


def _model(name: str):
    import transformers

    cls, fields = SHAPES[name]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**BASE, **fields)).float().eval()


def _cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.no_grad()
def _decode_s(model, arg: str, cache, first: int) -> float:
    t = time.perf_counter()
    nxt = first
    for _ in range(DECODE):
        nxt = int(model(input_ids=torch.tensor([[nxt]]), use_cache=True, **{arg: cache}).logits[0, -1].argmax())
    return (time.perf_counter() - t) / DECODE


@torch.no_grad()
def _round(name: str, model, context: int, chunk: int) -> dict:
    from transformers import DynamicCache

    from kvpool.connectors.hf import HFConnector
    from kvpool.connectors.hf_model import cache_argument
    from kvpool.connectors.pools import close_local_pools

    close_local_pools()
    conn = HFConnector(model, config={"chunk_tokens": chunk, "dram_mib": 4096, "pool": f"bench-sliding-{name}"})
    ids = torch.randint(3, BASE["vocab_size"], (1, context), generator=torch.Generator().manual_seed(context))
    arg = cache_argument(model)
    own = DynamicCache(config=model.config)
    t = time.perf_counter()
    first = int(model(input_ids=ids, use_cache=True, **{arg: own}).logits[0, -1].argmax())
    plain_prefill = time.perf_counter() - t
    t = time.perf_counter()
    r = conn.prefill(ids, save=True)
    conn_prefill = time.perf_counter() - t
    own_bytes, conn_bytes = _cache_bytes(own), _cache_bytes(r.cache)
    own_decode, conn_decode = _decode_s(model, arg, own, first), _decode_s(model, arg, r.cache, first)
    spec = conn.spec
    whole = context // chunk
    per_layer_chunk = spec.chunk_nbytes // spec.num_layers
    needed = 0
    for layer in range(spec.num_layers):
        window = int(spec.kind(layer).partition(":")[2] or 0)
        needed += per_layer_chunk * (whole if not window else min(whole, -(-(window - 1) // chunk) + 1))
    close_local_pools()
    return {"model": name, "context": context, "kinds": sorted(set(spec.layer_kinds)),
            "held_bytes_ratio": context * spec.chunk_nbytes / spec.chunk_tokens / own_bytes,
            "cache_bytes_ratio": conn_bytes / own_bytes, "prefill_ratio": conn_prefill / plain_prefill,
            "decode_ratio": conn_decode / own_decode, "pool_bytes_ratio": whole * spec.chunk_nbytes / needed,
            "cache_mib": [own_bytes / 2**20, conn_bytes / 2**20]}


def run(context: int = 8192, rounds: int = 3, chunk: int = 256, progress: bool = True) -> list[dict]:
    rows = []
    for name in SHAPES:
        model = _model(name)
        for i in range(rounds):
            rows.append(_round(name, model, context, chunk))
            if progress:
                print(f"{name} round {i + 1}/{rounds} done", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["the transformers connector / transformers alone (windowed cache), same prompt",
             f"{'model':<13} {'context':>7} {'KV held to save':>15} {'cache after':>11} {'prefill':>11} "
             f"{'decode/token':>12} {'pool bytes vs window-aware':>27}"]
    for name in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == name]

        lines.append(f"{name:<13} {rs[0]['context']:>7} {_span(rs, 'held_bytes_ratio'):>15} "
                     f"{_span(rs, 'cache_bytes_ratio'):>11} {_span(rs, 'prefill_ratio'):>11} "
                     f"{_span(rs, 'decode_ratio'):>12} {_span(rs, 'pool_bytes_ratio'):>27}")
    return "\n".join(lines)


def _span(rows: list[dict], key: str) -> str:
    lo, hi = min(r[key] for r in rows), max(r[key] for r in rows)
    return f"{lo:.2f}-{hi:.2f}x"
