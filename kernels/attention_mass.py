"""Attention mass per key: how much softmax attention each key receives from a set of queries.

``attention_mass(q, k)[b, h, j] = mean_{q-heads g of kv-head h} sum_i softmax_j(q_gi . k_j / sqrt(D))``

This is the heavy part of attention-based eviction scores (H2O sums it over every query,
SnapKV over the last ``window`` queries). Queries are the *last* ``Lq`` positions of the
sequence, so with ``causal=True`` query ``i`` sees keys ``j <= i + (L - Lq)`` (standard causal
masking when ``Lq == L``; no masking at all for a single decode query).

The Triton path never materializes the ``Lq x L`` matrix: a first kernel computes each query
row's log-sum-exp with an online softmax over key tiles (as flash attention's forward does), a
second kernel re-walks the query tiles for each key tile and sums ``exp(s - lse)`` down the
columns. Memory is ``O(Lq + L)`` per (batch, head); compute is two ``Lq x L x D`` passes.
Every program owns its output slots, so results are deterministic (no atomics).
"""

from __future__ import annotations

import math

import torch

from kvpool.errors import BadRequest

from ._backend import HAVE_TRITON, resolve_impl

if HAVE_TRITON:
    import triton
    import triton.language as tl

# NOTE: fp32 tiles are multiplied in full IEEE precision so that the Triton path matches the
# reference to 1e-5; "tf32x3" would be faster on tensor cores at ~fp32 accuracy and "tf32" faster
# still (~1e-3 relative error, enough for ranking keys) - to be chosen when benchmarked on a GPU.
DOT_PRECISION = "ieee"
BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per tile


def check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate ``q [B, Hq, Lq, D]`` and ``k [B, Hkv, L, D]``; returns ``(B, Hq, Hkv, Lq, L, D)``."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise BadRequest(f"{name} must be a 4-D tensor [B, heads, tokens, head_dim]; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.is_floating_point():
            raise BadRequest(f"{name} has dtype {t.dtype}: pass floating-point queries and keys")
    B, Hq, Lq, D = q.shape
    Bk, Hkv, L, Dk = k.shape
    if B != Bk or D != Dk:
        raise BadRequest(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim: "
                         "pass q as [B, Hq, Lq, D] and k as [B, Hkv, L, D]")
    if Hkv == 0 or Hq % Hkv != 0:
        raise BadRequest(f"Hq={Hq} query heads is not a multiple of Hkv={Hkv} key heads: pass the "
                         "model's query and KV heads unchanged (GQA groups Hq/Hkv query heads per KV head)")
    if min(B, Hq, Lq, L, D) == 0:
        raise BadRequest(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}; pass at least one token")
    return B, Hq, Hkv, Lq, L, D


def attention_mass_ref(q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
                       scale: float | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`attention_mass`: materializes the full attention matrix."""
    B, Hq, Hkv, Lq, L, D = check_qk(q, k)
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = k.float().repeat_interleave(G, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [B, Hq, Lq, L]
    if causal:
        i = torch.arange(Lq, device=q.device)[:, None] + (L - Lq)
        j = torch.arange(L, device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return p.sum(dim=2).view(B, Hkv, G, L).mean(dim=2)


if HAVE_TRITON:

    @triton.jit
    def _row_lse_kernel(q_ptr, k_ptr, lse_ptr,
                        sqb, sqh, sqm, sqd, skb, skh, skn, skd,
                        Hq, G, Lq, L, D, offset, scale,
                        CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        """One program per (b, q-head, query tile): log-sum-exp of each row's scaled scores."""
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = pid_bh // Hq
        hk = (pid_bh % Hq) // G
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, BD)
        q_ptrs = q_ptr + b * sqb + (pid_bh % Hq) * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        q = q * scale
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        hi = L
        if CAUSAL:  # keys past the tile's last query are masked for every row: skip them
            hi = tl.minimum(L, offset + (pid_m + 1) * BM)
        for start in range(0, hi, BN):
            offs_n = start + tl.arange(0, BN)
            kt_ptrs = k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd
            kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < L) & (offs_d[:, None] < D), other=0.0).to(tl.float32)
            s = tl.dot(q, kt, input_precision=PRECISION)
            valid = offs_n[None, :] < L
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + offset)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # NOTE: every row sees key 0 (offset >= 0), which lies in the first tile, so m_new is
            # finite from the first tile on and exp(-inf - m_new) is a clean 0.
            l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
            m_i = m_new
        tl.store(lse_ptr + pid_bh * Lq + offs_m, m_i + tl.log(l_i), mask=offs_m < Lq)

    @triton.jit
    def _column_mass_kernel(q_ptr, k_ptr, lse_ptr, out_ptr,
                            sqb, sqh, sqm, sqd, skb, skh, skn, skd,
                            Hq, Hkv, G, Lq, L, D, offset, scale, inv_g,
                            CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        """One program per (b, kv-head, key tile): column sums of softmax over every query of the
        GQA group, averaged over the group's query heads."""
        pid_bh = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_d = tl.arange(0, BD)
        kt_ptrs = k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd
        kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < L) & (offs_d[:, None] < D), other=0.0).to(tl.float32)
        acc = tl.zeros([BN], tl.float32)
        lo = 0
        if CAUSAL:  # queries before the tile's first key see none of it: start at the first that can
            lo = (tl.maximum(pid_n * BN - offset, 0) // BM) * BM
        for g in range(G):
            h = hk * G + g
            for start in range(lo, Lq, BM):
                offs_m = start + tl.arange(0, BM)
                q_ptrs = q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd
                q = tl.load(q_ptrs, mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D), other=0.0).to(tl.float32)
                q = q * scale
                lse = tl.load(lse_ptr + (b * Hq + h) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
                s = tl.dot(q, kt, input_precision=PRECISION)
                valid = (offs_m[:, None] < Lq) & (offs_n[None, :] < L)
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + offset)
                p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
                acc += tl.sum(p, axis=0)
        tl.store(out_ptr + pid_bh * L + offs_n, acc * inv_g, mask=offs_n < L)


def _attention_mass_triton(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    B, Hq, Hkv, Lq, L, D = check_qk(q, k)
    G = Hq // Hkv
    offset = L - Lq if causal else 0
    BD = max(16, triton.next_power_of_2(D))  # tl.dot needs every tile dim >= 16
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    out = torch.empty((B, Hkv, L), dtype=torch.float32, device=q.device)
    common = (*q.stride(), *k.stride())
    _row_lse_kernel[(B * Hq, triton.cdiv(Lq, BLOCK_M))](
        q, k, lse, *common, Hq, G, Lq, L, D, offset, scale,
        CAUSAL=causal, PRECISION=DOT_PRECISION, BM=BLOCK_M, BN=BLOCK_N, BD=BD)
    _column_mass_kernel[(B * Hkv, triton.cdiv(L, BLOCK_N))](
        q, k, lse, out, *common, Hq, Hkv, G, Lq, L, D, offset, scale, 1.0 / G,
        CAUSAL=causal, PRECISION=DOT_PRECISION, BM=BLOCK_M, BN=BLOCK_N, BD=BD)
    return out


def attention_mass(q: torch.Tensor, k: torch.Tensor, *, causal: bool = True, scale: float | None = None,
                   impl: str = "auto") -> torch.Tensor:
    """Softmax attention each key receives, summed over the queries and averaged over the GQA group.

    ``q [B, Hq, Lq, D]`` are the last ``Lq`` (post-RoPE) queries of the sequence, ``k [B, Hkv, L, D]``
    its keys; ``scale`` defaults to ``1/sqrt(D)``. Returns fp32 ``[B, Hkv, L]``; each query head's
    row sums to ``Lq`` before the group average, so the result sums to ``Lq`` over ``L``.
    """
    Lq, L, D = check_qk(q, k)[3:]
    if causal and Lq > L:
        raise BadRequest(f"causal attention needs Lq <= L (got Lq={Lq}, L={L}): pass only the last L "
                         "queries, or causal=False")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if resolve_impl(impl, q, k) == "torch":
        return attention_mass_ref(q, k, causal=causal, scale=scale)
    return _attention_mass_triton(q, k, causal, scale)
