"""Token eviction of a prefilled prompt's KV (LOSSY, opt-in): keep ``budget`` tokens per layer and head.

:func:`compress_cache` scores a transformers ``DynamicCache`` with the kernels of
:mod:`kvpool.kernels.scoring` and keeps the best ``budget`` tokens of each layer (and head); the
result, a :class:`CompressedKV`, remembers the prompt's original length ``length`` and each kept
entry's original position. The model continues it with :func:`continue_logits`: the new tokens get
their ORIGINAL positions (RoPE position ``length + i``) although the cache holds fewer entries.

NOTE: in transformers 5 a Llama's RoPE follows ``position_ids`` while its causal mask follows the
cache (``cache.get_query_offset`` / ``get_mask_sizes``: the cache's own length), so a shorter cache
with explicit ``position_ids`` is exactly "these keys, then the new tokens at their true positions".
The cached keys keep the rotation of their original positions (RoPE is applied before caching).
Without explicit ``position_ids`` the model would place the new tokens at ``len(cache)``: wrong.

Methods whose kept count is the same for every layer and head (``UNIFORM``: streaming_llm, h2o,
snapkv, quest) give a plain ``DynamicCache`` (:meth:`CompressedKV.cache`). PyramidKV keeps a
different count per layer and AdaKV per head: no ``DynamicCache`` can hold them so that a model
attends to exactly the kept entries, so :meth:`CompressedKV.cache` refuses them and
:func:`continue_logits` runs them with their padding masked (a registered attention function),
which is how the quality benchmark measures them; no connector stores them.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvpool.connectors.hf_batch import one_prompt
from kvpool.connectors.hf_model import cache_argument
from kvpool.errors import BadRequest
from kvpool.kernels import quest as _quest
from kvpool.kernels import scoring

METHODS = ("streaming_llm", "h2o", "snapkv", "pyramidkv", "adakv", "quest")
UNIFORM = ("streaming_llm", "h2o", "snapkv", "quest")  # one kept count for all layers and heads
_WINDOWED = ("snapkv", "pyramidkv", "adakv")
_CAPTURE = "kvpool_capture_q"
_RAGGED = "kvpool_ragged"
_local = threading.local()


@dataclass
class CompressedKV:
    """A compressed prompt prefix. ``keys[l]``/``values[l]``: ``[1, Hkv, n_l, D]``; ``positions[l]``:
    ``[1, Hkv, n_l]`` int64 original positions of the entries (``-1``: padding of a ragged method)."""

    method: str
    budget: int
    length: int  # the prompt's original tokens
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    params: dict = field(default_factory=dict)

    @property
    def ragged(self) -> bool:
        """Whether layers or heads keep different counts (PyramidKV, AdaKV): not a DynamicCache."""
        widths = {p.shape[-1] for p in self.positions}
        return len(widths) > 1 or any(bool((p < 0).any()) for p in self.positions)

    @property
    def kept_tokens(self) -> int:
        """Kept entries per layer and head, on average (``budget`` for a uniform method, at most ``length``)."""
        total = sum(int((p >= 0).sum()) for p in self.positions)
        slots = sum(p.shape[0] * p.shape[1] for p in self.positions)
        return round(total / max(slots, 1))

    @property
    def entries(self) -> int:
        """Entries each layer of :meth:`cache` holds (uniform methods)."""
        return self.positions[0].shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of what is kept: the K and V of every kept entry plus its int32 original position."""
        total = 0
        for k, v, p in zip(self.keys, self.values, self.positions):
            n = int((p >= 0).sum())
            total += n * (k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size() + 4)
        return total

    def cache(self):
        """A ``DynamicCache`` of the kept entries, to continue at position ``length`` (pass
        ``position_ids``: see the module docstring, or use :func:`continue_logits`)."""
        if self.ragged:
            raise BadRequest(f"{self.method} keeps a different number of tokens per layer or head, which no "
                             "DynamicCache can hold so that the model attends to exactly them: use "
                             f"continue_logits(), or one of {', '.join(UNIFORM)} for a cache")
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k, v, layer)
        return cache


def _int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BadRequest(f"{name}={value!r} must be an integer >= {lo}")
    return value


def _layers_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if not layers or getattr(layers[0], "keys", None) is None:
        raise BadRequest("cache must be a prefilled transformers DynamicCache (run the prompt first)")
    out = [(layer.keys, layer.values) for layer in layers]
    lengths = {k.shape[2] for k, _ in out}
    if len(lengths) != 1 or out[0][0].shape[0] != 1:
        raise BadRequest(f"every layer of the cache must hold the whole prompt for one sequence (lengths "
                         f"{sorted(lengths)}, batch {out[0][0].shape[0]}): a sliding-window cache dropped tokens; "
                         "prefill into a plain DynamicCache()")
    return out


@contextmanager
def _attention(model, name: str, fn):
    """Runs the model with attention function ``fn`` registered as ``name`` (restored afterwards)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    old = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = old


def _sdpa(module, q, k, v, mask, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, q, k, v, mask, **kw)


def _causal(n: int, total: int, device) -> torch.Tensor:
    """``[n, total]`` bool: the ``n`` last of ``total`` positions, each seeing itself and what precedes it."""
    return torch.ones(n, total, dtype=torch.bool, device=device).tril(total - n)


def _capture(module, q, k, v, mask, **kw):
    _local.queries[module.layer_idx] = q.detach()
    _local.keys[module.layer_idx] = k.detach()
    # NOTE: no mask function is registered under this name, so the model passes none: the causal
    # mask of the new tokens over the cut cache is made here (sdpa's is_causal aligns top-left).
    return _sdpa(module, q, k, v, _causal(q.shape[2], k.shape[2], q.device)[None, None], **kw)


@torch.no_grad()
def prompt_queries(model, cache, input_ids, last: int) -> list[torch.Tensor]:
    """Post-RoPE queries ``[1, Hq, last, D]`` of each layer for the prompt's last ``last`` tokens,
    recomputed on a copy of ``cache`` cut before them (the cache is not changed). Raises BadRequest
    when ``input_ids`` is not the prompt the cache holds (its recomputed keys differ)."""
    from transformers import DynamicCache

    kv = _layers_kv(cache)
    L = kv[0][0].shape[2]
    ids = one_prompt(input_ids)
    if ids.shape[1] != L:
        raise BadRequest(f"input_ids has {ids.shape[1]} tokens but the cache holds {L}: pass the prompt the cache holds")
    last = max(1, min(last, L))
    head = DynamicCache()
    if L > last:
        for layer, (k, v) in enumerate(kv):
            head.update(k[:, :, : L - last], v[:, :, : L - last], layer)
    device = kv[0][0].device
    _local.queries, _local.keys = {}, {}
    try:
        with _attention(model, _CAPTURE, _capture):
            model(input_ids=ids[:, L - last:].to(device), use_cache=True,
                  position_ids=torch.arange(L - last, L, device=device)[None], **{cache_argument(model): head})
        queries = [_local.queries[i] for i in range(len(kv))]
        k_new = _local.keys[0][:, :, L - last:]
    finally:
        _local.queries = _local.keys = None
    k_old = kv[0][0][:, :, L - last:]
    if not torch.allclose(k_new.float(), k_old.float(), atol=1e-3 + 1e-2 * float(k_old.abs().max())):
        raise BadRequest("input_ids are not the prompt this cache holds (recomputed keys differ): pass the same ids")
    return queries


def _quest_kept(q, k, budget: int, page_size: int) -> torch.Tensor:
    """Quest's kept token indices for the prompt's last query: its best pages, the last page always
    (so every head keeps the same count: a partial last page pads every head alike, and is trimmed)."""
    L = k.shape[2]
    pages = max(1, min(budget // page_size, _quest.num_pages(L, page_size)))
    s = scoring.score("quest", q, k, page_size=page_size)
    s[..., -1] = float("inf")
    kept = _quest.page_token_indices(scoring._top_sorted(s, pages), page_size, L)
    pad = int((kept[0, 0] < 0).sum())
    return kept[..., : kept.shape[-1] - pad] if pad else kept


@torch.no_grad()
def compress_cache(model, cache, *, method: str, budget: int, window: int | None = None, input_ids=None,
                   **params) -> CompressedKV:
    """Keep ``budget`` tokens per layer (and head) of a prefilled prompt's ``cache`` (not changed).

    ``input_ids``: the prompt the cache holds; every method but streaming_llm scores keys by the
    prompt's queries, recomputed from it (:func:`prompt_queries`: snapkv, pyramidkv and adakv the last
    ``window`` tokens, default ``min(64, budget)``; h2o all of them; quest the last one).
    ``params``: the method's own (:data:`kvpool.kernels.scoring.PARAMS`), e.g. ``n_sink=4``,
    ``recent=...``, ``kernel_size=5``, ``alpha=0.2``, ``beta=20``, ``page_size=16``. quest's
    ``budget`` counts tokens too (``budget // page_size`` pages, at least one; the last page is
    always kept). A budget at or above the prompt's length keeps everything.
    """
    if method not in METHODS:
        raise BadRequest(f"unknown compression method {method!r}: use one of {', '.join(METHODS)}")
    budget = _int("budget", budget, 1)
    kv = _layers_kv(cache)
    L = kv[0][0].shape[2]
    if method in _WINDOWED:
        params["window"] = _int("window", window, 1) if window is not None else min(64, budget, L)
    elif window is not None:
        raise BadRequest(f"{method} has no observation window: drop window=")
    scoring._params(method, {k: v for k, v in params.items() if k not in ("layer", "num_layers")} | (
        {"layer": 0, "num_layers": len(kv)} if method == "pyramidkv" else {}), for_select=True)
    if budget >= L:  # nothing to evict
        keep = torch.arange(L, device=kv[0][0].device).expand(1, kv[0][0].shape[1], L)
        return _gather(method, budget, L, kv, [keep] * len(kv), params)
    queries = None
    if method != "streaming_llm":
        if input_ids is None:
            raise BadRequest(f"{method} scores keys by the prompt's queries: pass input_ids (the prompt the cache holds)")
        last = {"h2o": L, "quest": 1}.get(method, params.get("window", 1))
        queries = prompt_queries(model, cache, input_ids, last)
    kept = []
    for layer, (k, _) in enumerate(kv):
        q = queries[layer] if queries is not None else k[:, :, -1:]  # streaming_llm reads no query
        if method == "quest":
            kept.append(_quest_kept(q, k, budget, params.get("page_size", 16)))
        else:
            extra = {"layer": layer, "num_layers": len(kv)} if method == "pyramidkv" else {}
            kept.append(scoring.select(method, q, k, budget, **params, **extra))
    return _gather(method, budget, L, kv, kept, params)


def _gather(method, budget, L, kv, kept, params) -> CompressedKV:
    keys, values, positions = [], [], []
    for (k, v), idx in zip(kv, kept):
        ck, cv = scoring.compress(k, v, idx)
        keys.append(ck)
        values.append(cv)
        positions.append(idx.long())
    return CompressedKV(method, budget, L, keys, values, positions, dict(params))


def _ragged_attention(module, q, k, v, mask, **kw):
    """sdpa over a padded compressed prefix: slot ``j < W`` of head ``h`` is attended only where it
    holds a kept entry, the new tokens causally."""
    valid = _local.valid[module.layer_idx]  # [1, Hkv, W]
    W, n, total = valid.shape[-1], q.shape[2], k.shape[2]
    groups = q.shape[1] // valid.shape[1]
    prefix = valid.repeat_interleave(groups, dim=1)[:, :, None, :].expand(1, q.shape[1], n, W)
    new = _causal(n, total - W, q.device)
    full = torch.cat([prefix, new[None, None].expand(1, q.shape[1], n, total - W)], dim=-1)
    return _sdpa(module, q, k, v, full, **kw)


@torch.no_grad()
def continue_logits(model, compressed: CompressedKV, ids) -> torch.Tensor:
    """Logits ``[1, len(ids), vocab]`` of ``ids`` run at positions ``length ..`` after the compressed
    prefix (ragged methods with their padding masked out). ``compressed`` is not changed."""
    return _continue(model, compressed, ids, 0)[0]


@torch.no_grad()
def greedy(model, compressed: CompressedKV, ids, new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``ids`` (run at positions ``length ..``) on the compressed prefix."""
    return _continue(model, compressed, ids, _int("new_tokens", new_tokens, 1))[1]


def _continue(model, compressed: CompressedKV, ids, steps: int) -> tuple[torch.Tensor, list[int]]:
    from transformers import DynamicCache

    ids = one_prompt(ids, "ids")
    device = compressed.keys[0].device
    arg = cache_argument(model)
    if compressed.ragged:
        W = max(p.shape[-1] for p in compressed.positions)
        cache, valid = DynamicCache(), {}
        for layer, (k, v, p) in enumerate(zip(compressed.keys, compressed.values, compressed.positions)):
            pad = W - p.shape[-1]
            cache.update(F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), layer)
            valid[layer] = F.pad(p >= 0, (0, pad), value=False)
        _local.valid, context = valid, _attention(model, _RAGGED, _ragged_attention)
    else:
        cache, context = compressed.cache(), nullcontext()
    at, tokens = compressed.length, []
    try:
        with context:
            out = model(input_ids=ids.to(device), position_ids=torch.arange(at, at + ids.shape[1], device=device)[None],
                        use_cache=True, **{arg: cache})
            logits, at = out.logits, at + ids.shape[1]
            for _ in range(steps):
                tokens.append(int(out.logits[0, -1].argmax()))
                if len(tokens) == steps:
                    break
                out = model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                            position_ids=torch.tensor([[at]], device=device), use_cache=True, **{arg: cache})
                at += 1
    finally:
        _local.valid = None
    return logits, tokens


@torch.no_grad()
def chunk_attention(model, cache, input_ids, chunk_tokens: int, *, window: int = 64, sinks: int = 4) -> list[float]:
    """Attention mass of each whole chunk of the prompt, for the ``importance`` eviction policy
    (``Access.attention``): the attention the prompt's last ``window`` queries pay to the chunk's
    tokens (:func:`kvpool.kernels.attention_mass.attention_mass`, mean over layers and KV heads),
    relative to the most attended chunk (which gets 1.0). The first ``sinks`` tokens are left out:
    every query pays them a large share whatever they hold (attention sinks)."""
    from kvpool.kernels.attention_mass import attention_mass

    kv = _layers_kv(cache)
    L = kv[0][0].shape[2]
    whole = L // chunk_tokens
    if whole == 0:
        return []
    queries = prompt_queries(model, cache, input_ids, window)
    mass = sum(attention_mass(q, k, causal=True).mean(dim=1)[0] for q, (k, _) in zip(queries, kv))
    mass[: min(sinks, L)] = 0
    per_chunk = mass[: whole * chunk_tokens].reshape(whole, chunk_tokens).sum(-1)
    top = float(per_chunk.max())
    return [float(x) / top if top > 0 else 0.0 for x in per_chunk]
