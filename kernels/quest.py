"""Quest page metadata and query-aware page scores (Tang et al., 2024, "Quest").

Keys are cut into pages of ``page_size`` tokens (the last page may be partial). Each page keeps the
elementwise minimum ``m`` and maximum ``M`` of its keys over the tokens; for a query ``q`` the page's
score ``sum_d max(q_d * M_d, q_d * m_d)`` is an upper bound of ``q . k_t`` for every key ``k_t`` of
the page, so the pages with the highest bounds are the ones that can hold the strongest keys.

Two kernels, because in serving the metadata is built once per page (at prefill or when a page
fills) while the bound is recomputed for every decode query:
- :func:`page_minmax` : keys ``[B, Hkv, L, D]`` -> ``(kmin, kmax)`` each fp32 ``[B, Hkv, P, D]``;
- :func:`page_bound`  : query ``[B, Hq, D]`` and the metadata -> fp32 ``[B, Hkv, P]``, the bound
  averaged over the query heads of each GQA group.
"""

from __future__ import annotations

import torch

from kvpool.errors import BadRequest

from ._backend import HAVE_TRITON, resolve_impl

if HAVE_TRITON:
    import triton
    import triton.language as tl

BLOCK_P = 16  # pages per program


def num_pages(L: int, page_size: int) -> int:
    return -(-L // page_size)


def _check_page_size(page_size) -> int:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise BadRequest(f"page_size={page_size!r}: pass a positive integer number of tokens per page")
    return page_size


def page_minmax_ref(k: torch.Tensor, page_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`page_minmax`: pads the last page with +-inf and reduces."""
    B, H, L, D = k.shape
    P = num_pages(L, page_size)
    kf = k.float()
    pad = P * page_size - L
    lo = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("inf")).view(B, H, P, page_size, D)
    hi = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(B, H, P, page_size, D)
    return lo.amin(dim=3), hi.amax(dim=3)


def page_bound_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`page_bound`."""
    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    G = Hq // Hkv
    qf = q.float().view(B, Hkv, G, 1, D)
    bound = torch.maximum(qf * kmax[:, :, None], qf * kmin[:, :, None]).sum(dim=-1)  # [B, Hkv, G, P]
    return bound.mean(dim=2)


if HAVE_TRITON:

    @triton.jit
    def _tile(Hkv, BP: tl.constexpr, BD: tl.constexpr):
        """This program's (b, kv-head) row, its tile of BP pages and the BD lanes of a head."""
        pid_bh = tl.program_id(0)
        offs_p = tl.program_id(1) * BP + tl.arange(0, BP)
        return pid_bh, pid_bh // Hkv, pid_bh % Hkv, offs_p, tl.arange(0, BD)

    @triton.jit
    def _page_minmax_kernel(k_ptr, min_ptr, max_ptr, skb, skh, skn, skd,
                            Hkv, L, D, P, PAGE: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr):
        """One program per (b, kv-head, tile of BP pages): walks the page's tokens, one row per page
        at a time, keeping running elementwise min and max."""
        pid_bh, b, hk, offs_p, offs_d = _tile(Hkv, BP, BD)
        dmask = offs_d[None, :] < D
        lo = tl.full([BP, BD], float("inf"), tl.float32)
        hi = tl.full([BP, BD], float("-inf"), tl.float32)
        base = k_ptr + b * skb + hk * skh
        for t in range(PAGE):
            tok = offs_p * PAGE + t
            valid = (tok[:, None] < L) & dmask  # also masks pages past P (their tokens are >= L)
            x = tl.load(base + tok[:, None] * skn + offs_d[None, :] * skd, mask=valid, other=0.0).to(tl.float32)
            lo = tl.where(valid, tl.minimum(lo, x), lo)
            hi = tl.where(valid, tl.maximum(hi, x), hi)
        out = pid_bh * P * D + offs_p[:, None] * D + offs_d[None, :]
        omask = (offs_p[:, None] < P) & dmask
        tl.store(min_ptr + out, lo, mask=omask)
        tl.store(max_ptr + out, hi, mask=omask)

    @triton.jit
    def _page_bound_kernel(q_ptr, min_ptr, max_ptr, out_ptr, sqb, sqh, sqd,
                           Hkv, G, P, D, inv_g, BP: tl.constexpr, BD: tl.constexpr):
        """One program per (b, kv-head, tile of BP pages): the bound for each query head of the
        group, averaged."""
        pid_bh, b, hk, offs_p, offs_d = _tile(Hkv, BP, BD)
        mask = (offs_p[:, None] < P) & (offs_d[None, :] < D)
        meta = pid_bh * P * D + offs_p[:, None] * D + offs_d[None, :]
        lo = tl.load(min_ptr + meta, mask=mask, other=0.0)
        hi = tl.load(max_ptr + meta, mask=mask, other=0.0)
        acc = tl.zeros([BP], tl.float32)
        for g in range(G):
            qv = tl.load(q_ptr + b * sqb + (hk * G + g) * sqh + offs_d * sqd, mask=offs_d < D, other=0.0)
            qv = qv.to(tl.float32)[None, :]
            acc += tl.sum(tl.maximum(qv * hi, qv * lo), axis=1)
        tl.store(out_ptr + pid_bh * P + offs_p, acc * inv_g, mask=offs_p < P)


def page_minmax(k: torch.Tensor, page_size: int = 16, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page elementwise min and max of the keys ``k [B, Hkv, L, D]``: two fp32 ``[B, Hkv, P, D]``
    with ``P = ceil(L / page_size)``; the last page covers only its valid tokens."""
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or not k.is_floating_point() or k.shape[2] == 0:
        raise BadRequest("k must be a non-empty floating-point tensor [B, Hkv, L, D]")
    page_size = _check_page_size(page_size)
    if resolve_impl(impl, k) == "torch":
        return page_minmax_ref(k, page_size)
    B, H, L, D = k.shape
    P = num_pages(L, page_size)
    kmin = torch.empty((B, H, P, D), dtype=torch.float32, device=k.device)
    kmax = torch.empty_like(kmin)
    BD = triton.next_power_of_2(D)
    _page_minmax_kernel[(B * H, triton.cdiv(P, BLOCK_P))](
        k, kmin, kmax, *k.stride(), H, L, D, P, PAGE=page_size, BP=BLOCK_P, BD=BD)
    return kmin, kmax


def page_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Quest page scores for one query per head ``q [B, Hq, D]`` (the decode query): fp32
    ``[B, Hkv, P]``, ``sum_d max(q_d * kmax_d, q_d * kmin_d)`` averaged over each GQA group."""
    if q.dim() != 3 or kmin.dim() != 4 or kmin.shape != kmax.shape:
        raise BadRequest(f"q must be [B, Hq, D] and kmin, kmax [B, Hkv, P, D] alike; got q {tuple(q.shape)}, "
                         f"kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, P, Dk = kmin.shape
    if B != Bk or D != Dk:
        raise BadRequest(f"q {tuple(q.shape)} and page metadata {tuple(kmin.shape)} disagree on batch or head_dim")
    if Hkv == 0 or Hq % Hkv != 0:
        raise BadRequest(f"Hq={Hq} query heads is not a multiple of Hkv={Hkv} key heads: pass the "
                         "model's query and KV heads unchanged")
    if resolve_impl(impl, q, kmin, kmax) == "torch":
        return page_bound_ref(q, kmin, kmax)
    kmin = kmin.float().contiguous()
    kmax = kmax.float().contiguous()
    out = torch.empty((B, Hkv, P), dtype=torch.float32, device=q.device)
    BD = triton.next_power_of_2(D)
    _page_bound_kernel[(B * Hkv, triton.cdiv(P, BLOCK_P))](
        q, kmin, kmax, out, *q.stride(), Hkv, Hq // Hkv, P, D, 1.0 / (Hq // Hkv), BP=BLOCK_P, BD=BD)
    return out


def page_token_indices(pages: torch.Tensor, page_size: int, L: int) -> torch.Tensor:
    """Token indices covered by kept pages ``[B, Hkv, n]`` (ascending page ids): ``[B, Hkv, n * page_size]``,
    ascending, with ``-1`` for the slots of a partial last page past ``L`` (and for ``-1`` pages), ready
    for :func:`kvpool.kernels.scoring.compress`."""
    page_size = _check_page_size(page_size)
    tok = pages.unsqueeze(-1) * page_size + torch.arange(page_size, device=pages.device)
    tok = torch.where((pages.unsqueeze(-1) >= 0) & (tok < L), tok, torch.full_like(tok, -1))
    return tok.flatten(-2)
