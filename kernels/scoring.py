"""Eviction scores and selection for KV-cache compression: which keys (and values) of a layer to keep.

Public surface:
- ``score(method, q, k, *, impl="auto", **params)`` -> fp32 scores ``[B, Hkv, L]`` (quest: page
  scores ``[B, Hkv, P]``); higher is more worth keeping, ``+inf`` marks what is always kept.
- ``select(method, q, k, budget, *, impl="auto", **params)`` -> int64 kept indices ``[B, Hkv, n]``,
  ascending (n: see each method below).
- ``compress(k, v, kept)`` -> ``(k_kept, v_kept)`` gathered along the token axis.
- ``pyramid_budgets(...)``: PyramidKV's per-layer budgets.

``q [B, Hq, Lq, D]`` are post-RoPE queries (the last ``Lq`` positions of the sequence), ``k [B, Hkv, L, D]``
the keys, ``Hq`` a multiple of ``Hkv`` (GQA: scores are averaged over the query heads of a group).
Methods (definitions follow the papers and NVIDIA kvpress):

- ``streaming_llm`` (n_sink=4): score = position, sinks ``+inf``; keeps the first ``n_sink`` tokens and
  the last ``budget - n_sink``. n = budget.
- ``h2o`` (recent, causal=True): accumulated attention each key receives, ``sum_i softmax(q_i k^T / sqrt(D))``
  over every query (causal, queries aligned to the end of the sequence), averaged over the GQA group;
  the last ``recent`` keys score ``+inf``. ``score`` defaults ``recent=0`` (it has no budget);
  ``select`` defaults ``recent = budget // 2`` (H2O's half heavy hitters, half recent). n = budget.
- ``snapkv`` (window=64, kernel_size=5): the last ``window`` queries' attention to every key (causal inside
  the window), averaged over those queries; the keys before the window are smoothed by a 1-D average pool
  (stride 1, padding kernel_size//2, zero padding counted, as ``avg_pool1d``'s default), then averaged
  over the GQA group; the ``window`` last keys score ``+inf`` (kept, and counted in the budget). As in
  kvpress, pooling sees only the keys before the window. n = budget (``budget >= window``).
- ``pyramidkv`` (layer, num_layers, window=64, kernel_size=5, beta=20): SnapKV scores; n is the layer's
  own budget from :func:`pyramid_budgets`, which sum to ``num_layers * budget`` over the layers.
- ``adakv`` (window=64, kernel_size=5, alpha=0.2): SnapKV scores with the budget shared by the heads of a
  layer. Each head first keeps its top ``int(alpha * budget)`` keys; the remaining slots go to the best
  scores across all heads, so exactly ``budget * Hkv`` keys are kept per (batch, layer) and heads keep
  different counts. Returned as ``[B, Hkv, W]``, each head's kept indices ascending then padded with
  ``-1``; ``W = min(L, Hkv*budget - (Hkv-1)*max(int(alpha*budget), window))`` is the most one head can
  keep (so W >= budget). Per-head counts: ``(kept >= 0).sum(-1)``; ``compress`` gathers zero rows at -1.
- ``quest`` (page_size=16): pages of ``page_size`` tokens scored by the Quest upper bound
  ``sum_d max(q_d M_d, q_d m_d)`` (``m``, ``M``: the page's elementwise key min and max) for the last
  query, averaged over the GQA group. ``budget`` counts *pages*; n = budget page indices
  (:func:`kvpool.kernels.quest.page_token_indices` turns them into token indices).

Selection ties go to the lower index (stable sort), so results are deterministic and identical
across implementations when the scores are.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F

from kvpool.errors import BadRequest

from . import quest as _quest
from .attention_mass import attention_mass, check_qk

METHODS = ("streaming_llm", "h2o", "snapkv", "pyramidkv", "adakv", "quest")
_REQUIRED = object()
_SNAP = {"window": 64, "kernel_size": 5}
# Parameters each method accepts, with their defaults (None: computed from the budget).
PARAMS = {
    "streaming_llm": {"n_sink": 4},
    "h2o": {"recent": None, "causal": True},
    "snapkv": dict(_SNAP),
    "pyramidkv": {**_SNAP, "layer": _REQUIRED, "num_layers": _REQUIRED, "beta": 20},
    "adakv": {**_SNAP, "alpha": 0.2},
    "quest": {"page_size": 16},
}


def _params(method: str, params: dict, for_select: bool) -> dict:
    if method not in PARAMS:
        raise BadRequest(f"unknown eviction method {method!r}: use one of {', '.join(METHODS)}")
    allowed = PARAMS[method]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise BadRequest(f"{method} takes no parameter {', '.join(unknown)}: its parameters are "
                         f"{', '.join(allowed) or 'none'}")
    out = {**allowed, **params}
    if method == "pyramidkv" and not for_select:  # the layer only sets the budget
        out = {name: v for name, v in out.items() if v is not _REQUIRED}
    missing = [name for name, v in out.items() if v is _REQUIRED]
    if missing:
        raise BadRequest(f"{method} needs {', '.join(missing)}: pass e.g. layer=0, num_layers=32")
    return out


def _int(name: str, value, lo: int, hi: int | None = None, fix: str = "") -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{name}={value!r} must be an integer {span}" + (f": {fix}" if fix else ""))
    return value


# -- scores -------------------------------------------------------------------------------------------------


def _streaming_scores(k: torch.Tensor, n_sink: int) -> torch.Tensor:
    B, H, L, _ = k.shape
    s = torch.arange(L, device=k.device, dtype=torch.float32)
    s[:n_sink] = float("inf")
    return s.expand(B, H, L).clone()


def _h2o_scores(q, k, recent: int, causal: bool, impl: str) -> torch.Tensor:
    s = attention_mass(q, k, causal=causal, impl=impl)
    if recent:
        s[..., s.shape[-1] - recent:] = float("inf")
    return s


def _snapkv_scores(q, k, window: int, kernel_size: int, impl: str) -> torch.Tensor:
    L, Lq = k.shape[2], q.shape[2]
    _int("window", window, 1, L, "the observation window is the last `window` keys; at most L")
    if Lq < window:
        raise BadRequest(f"snapkv needs the last window={window} queries but q has Lq={Lq}: pass the last "
                         "`window` post-RoPE queries of the prompt, or lower window")
    _int("kernel_size", kernel_size, 1, fix="an odd pooling width (SnapKV uses 5)")
    if kernel_size % 2 == 0:
        raise BadRequest(f"kernel_size={kernel_size} must be odd so pooling stays centred: use e.g. 5")
    # NOTE: mean over the window queries, pooling and the GQA mean are all linear, so the mass kernel
    # averages the group first and pooling runs once per KV head (kvpress pools each query head).
    s = attention_mass(q[:, :, Lq - window:], k, causal=True, impl=impl) / window
    prefix = s[..., : L - window]
    if prefix.shape[-1]:
        B, H, n = prefix.shape
        prefix = F.avg_pool1d(prefix.reshape(B * H, 1, n), kernel_size, stride=1, padding=kernel_size // 2)
        prefix = prefix.view(B, H, n)
    inf = torch.full_like(s[..., L - window:], float("inf"))
    return torch.cat([prefix, inf], dim=-1)


def _quest_scores(q, k, page_size: int, impl: str) -> torch.Tensor:
    kmin, kmax = _quest.page_minmax(k, page_size, impl=impl)
    return _quest.page_bound(q[:, :, -1], kmin, kmax, impl=impl)


def score(method: str, q: torch.Tensor, k: torch.Tensor, *, impl: str = "auto", **params) -> torch.Tensor:
    """Eviction scores of ``method`` (see the module docstring): fp32 ``[B, Hkv, L]``, or ``[B, Hkv, P]``
    page scores for quest. Higher is kept first; ``+inf`` is always kept."""
    p = _params(method, params, for_select=False)
    check_qk(q, k)
    L = k.shape[2]
    if method == "streaming_llm":
        return _streaming_scores(k, _int("n_sink", p["n_sink"], 0, L, "at most L sink tokens"))
    if method == "h2o":
        recent = 0 if p["recent"] is None else _int("recent", p["recent"], 0, L, "at most L recent tokens")
        return _h2o_scores(q, k, recent, bool(p["causal"]), impl)
    if method == "quest":
        return _quest_scores(q, k, _quest._check_page_size(p["page_size"]), impl)
    return _snapkv_scores(q, k, p["window"], p["kernel_size"], impl)


# -- selection ----------------------------------------------------------------------------------------------


def _top_sorted(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` best scores per row, ascending; ties go to the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n]
    return order.sort(dim=-1).values


def pyramid_budgets(budget: int, num_layers: int, L: int, *, window: int = 64, beta: float = 20) -> list[int]:
    """PyramidKV's per-layer budgets (layer 0 first), summing exactly to ``num_layers * budget``.

    Every layer keeps the ``window`` observation keys; the rest ``extra = budget - window`` is spread as a
    pyramid: the last layer gets ``min = extra / beta``, the first ``max = 2 * extra - min``, and the
    layers between are linearly interpolated (so the average is ``extra``). If ``window + max`` would
    exceed ``L``, ``max`` is clamped to ``L - window`` and ``min = 2 * extra - max`` keeps the average
    (as kvpress does). The real-valued budgets ``window + ...`` are rounded by largest remainder (ties to
    the lower layer), which keeps the sum exact, every budget in ``[window, L]`` and the sequence
    non-increasing. ``num_layers == 1`` gives ``[budget]``.
    """
    _int("num_layers", num_layers, 1, fix="the model's number of layers")
    _int("window", window, 0, L, "at most L")
    _int("budget", budget, max(window, 1), L, "between window and L keys per layer")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 1:
        raise BadRequest(f"beta={beta!r} must be a number >= 1 (PyramidKV uses 20)")
    if num_layers == 1:
        return [budget]
    extra = Fraction(budget - window)
    lo = extra / Fraction(beta)
    hi = 2 * extra - lo
    if hi > L - window:
        hi = Fraction(L - window)
        lo = 2 * extra - hi
    step = (hi - lo) / (num_layers - 1)
    real = [window + hi - i * step for i in range(num_layers)]
    ints = [r.numerator // r.denominator for r in real]
    short = num_layers * budget - sum(ints)
    by_remainder = sorted(range(num_layers), key=lambda i: (-(real[i] - ints[i]), i))
    for i in by_remainder[:short]:
        ints[i] += 1
    assert sum(ints) == num_layers * budget and all(window <= b <= L for b in ints)
    return ints


def _adakv_select(scores: torch.Tensor, budget: int, alpha: float, window: int) -> torch.Tensor:
    B, H, L = scores.shape
    n_safe = int(alpha * budget)
    s = scores.clone()
    if n_safe:
        s.scatter_(-1, torch.topk(s, n_safe, dim=-1).indices, float("inf"))
    flat = torch.sort(s.reshape(B, H * L), dim=-1, descending=True, stable=True).indices[:, : H * budget]
    mask = torch.zeros(B, H * L, dtype=torch.bool, device=s.device)
    mask.scatter_(1, flat, True)
    mask = mask.view(B, H, L)
    width = min(L, H * budget - (H - 1) * max(n_safe, window))
    pos = torch.arange(L, device=s.device).expand(B, H, L)
    # kept positions first in ascending order, dropped ones (moved past L) after: then cut to width
    ranked = torch.where(mask, pos, pos + L).sort(dim=-1).values[..., :width]
    assert int(mask.sum(-1).max()) <= width
    return torch.where(ranked < L, ranked, torch.full_like(ranked, -1))


def select(method: str, q: torch.Tensor, k: torch.Tensor, budget: int, *, impl: str = "auto",
           **params) -> torch.Tensor:
    """Kept indices ``[B, Hkv, n]`` (int64, ascending) of ``method`` for ``budget`` keys per head (quest:
    pages; pyramidkv: n is the layer's own budget; adakv: -1-padded, see the module docstring)."""
    p = _params(method, params, for_select=True)
    L = check_qk(q, k)[4]
    if method == "quest":
        page_size = _quest._check_page_size(p["page_size"])
        P = _quest.num_pages(L, page_size)
        _int("budget", budget, 1, P, f"quest's budget counts pages of {page_size} tokens; L={L} has {P}")
        return _top_sorted(_quest_scores(q, k, page_size, impl), budget)
    _int("budget", budget, 1, L, f"at most the L={L} keys (no compression is needed at budget L)")
    if method == "streaming_llm":
        n_sink = _int("n_sink", p["n_sink"], 0, budget, "the sinks are kept within the budget")
        return _top_sorted(_streaming_scores(k, n_sink), budget)
    if method == "h2o":
        recent = budget // 2 if p["recent"] is None else p["recent"]
        recent = _int("recent", recent, 0, budget, "the recent window is kept within the budget")
        return _top_sorted(_h2o_scores(q, k, recent, bool(p["causal"]), impl), budget)
    window = _int("window", p["window"], 1, L, "the observation window is the last `window` keys; at most L")
    if budget < window:
        raise BadRequest(f"budget={budget} is below window={window}: the observation window is always kept, "
                         "so raise budget or lower window")
    scores = _snapkv_scores(q, k, window, p["kernel_size"], impl)
    if method == "snapkv":
        return _top_sorted(scores, budget)
    if method == "pyramidkv":
        n = _int("num_layers", p["num_layers"], 1, fix="the model's number of layers")
        layer = _int("layer", p["layer"], 0, n - 1, "layers count from 0")
        return _top_sorted(scores, pyramid_budgets(budget, n, L, window=window, beta=p["beta"])[layer])
    alpha = p["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise BadRequest(f"alpha={alpha!r} must be a fraction in [0, 1] (AdaKV's safeguard uses 0.2)")
    return _adakv_select(scores, budget, float(alpha), window)


# -- compression --------------------------------------------------------------------------------------------


def compress(k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the kept tokens: ``k [B, Hkv, L, Dk]``, ``v [B, Hkv, L, Dv]``, ``kept [B, Hkv, n]`` ->
    ``k [B, Hkv, n, Dk]``, ``v [B, Hkv, n, Dv]``; a ``-1`` slot (adakv padding) gathers a zero row."""
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise BadRequest(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, Hkv, L, D] with equal B, Hkv, L")
    if kept.dim() != 3 or kept.shape[:2] != k.shape[:2] or kept.dtype not in (torch.int32, torch.int64):
        raise BadRequest(f"kept must be integer indices [B, Hkv, n] matching k's {tuple(k.shape[:2])}; got "
                         f"{kept.dtype} {tuple(kept.shape)}: pass select()'s output")
    L = k.shape[2]
    if kept.numel() and (int(kept.min()) < -1 or int(kept.max()) >= L):
        raise BadRequest(f"kept indices must lie in [0, {L}) (or -1 for padding): select them on these keys")
    idx = kept.long().clamp(min=0).unsqueeze(-1)
    pad = (kept < 0).unsqueeze(-1)

    def gather(x: torch.Tensor) -> torch.Tensor:
        out = torch.gather(x, 2, idx.expand(-1, -1, -1, x.shape[-1]))
        return out.masked_fill(pad, 0)

    return gather(k), gather(v)
