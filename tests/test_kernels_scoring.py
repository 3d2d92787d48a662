"""Eviction scoring and selection kernels: Triton (under the interpreter on CPU) against the PyTorch
references, and pinned selections on small hand-made attention patterns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import BadRequest
from kvpool.kernels import quest
from kvpool.kernels.attention_mass import attention_mass, attention_mass_ref
from kvpool.kernels.scoring import compress, pyramid_budgets, score, select

ATOL = RTOL = 1e-5


def rand_qk(B, Hq, Hkv, Lq, L, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    return q, k


def axis(D, scale=1.0):
    """A vector along the first coordinate: queries along it attend to keys along it."""
    v = torch.zeros(D)
    v[0] = scale
    return v


def planted_qk(Hq, Hkv, Lq, L, D, heavy, weight=16.0, q_heads=None):
    """Queries all equal to e0 (heads in q_heads; the others zero), keys zero except the heavy ones,
    which get weight * e0: a logit of weight/sqrt(D) against every query, 0 elsewhere."""
    q = torch.zeros(1, Hq, Lq, D)
    for h in range(Hq) if q_heads is None else q_heads:
        q[0, h] = axis(D)
    k = torch.zeros(1, Hkv, L, D)
    for h, j in heavy:
        k[0, h, j] = axis(D, weight)
    return q, k


def rows(kept):
    return kept.tolist()


# -- attention mass kernel --------------------------------------------------------------------------------

MASS_SHAPES = [  # B, Hq, Hkv, Lq, L, D, causal
    (1, 2, 2, 37, 37, 16, True),     # GQA 1, odd L, causal prefill (Lq == L)
    (2, 4, 1, 64, 131, 32, True),    # GQA 4, queries are the last 64 of 131 positions
    (1, 8, 1, 5, 200, 64, False),    # GQA 8, no mask
    (1, 8, 2, 200, 200, 24, True),   # GQA 4, several query and key tiles, D not a power of two
    (1, 2, 1, 1, 77, 8, True),       # one decode query, D below tl.dot's 16
]


@pytest.mark.parametrize("B,Hq,Hkv,Lq,L,D,causal", MASS_SHAPES)
def test_attention_mass_triton_matches_reference(B, Hq, Hkv, Lq, L, D, causal):
    q, k = rand_qk(B, Hq, Hkv, Lq, L, D, seed=L)
    got = attention_mass(q, k, causal=causal, impl="triton")
    ref = attention_mass_ref(q, k, causal=causal)
    assert got.shape == (B, Hkv, L) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    # every query row is a distribution: the mass sums to Lq per (batch, kv head)
    torch.testing.assert_close(got.sum(-1), torch.full((B, Hkv), float(Lq)), atol=1e-3, rtol=0)


def test_attention_mass_reference_is_causal_and_group_averaged():
    q, k = rand_qk(1, 4, 2, 6, 10, 8, seed=3)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) / math.sqrt(8)
    # query i sits at position 4 + i: it sees keys 0..4+i
    mask = torch.arange(10)[None, :] > torch.arange(6)[:, None] + 4
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1).sum(2)
    want = (p[:, 0::2] + p[:, 1::2]) / 2
    torch.testing.assert_close(attention_mass_ref(q, k), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(attention_mass(q, k, impl="triton"), want, atol=ATOL, rtol=RTOL)
    # the last key is seen only by the last query
    assert attention_mass_ref(q[:, :, :5], k[:, :, :9])[..., -1].gt(0).all()


def test_attention_mass_fp16_inputs_work_in_fp32():
    q, k = rand_qk(1, 4, 1, 40, 70, 32, seed=5, dtype=torch.float16)
    got = attention_mass(q, k, impl="triton")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, attention_mass_ref(q.float(), k.float()), atol=ATOL, rtol=RTOL)


# -- quest kernels ----------------------------------------------------------------------------------------

QUEST_SHAPES = [  # B, Hq, Hkv, L, D, page_size
    (1, 1, 1, 37, 16, 16),     # partial last page
    (2, 4, 1, 100, 32, 16),
    (1, 8, 1, 131, 64, 5),     # odd page size, GQA 8
    (1, 8, 2, 256, 24, 16),    # 16 full pages, D not a power of two
]


@pytest.mark.parametrize("B,Hq,Hkv,L,D,page", QUEST_SHAPES)
def test_quest_kernels_match_reference(B, Hq, Hkv, L, D, page):
    q, k = rand_qk(B, Hq, Hkv, 3, L, D, seed=L + page)
    kmin, kmax = quest.page_minmax(k, page, impl="triton")
    rmin, rmax = quest.page_minmax_ref(k, page)
    P = -(-L // page)
    assert kmin.shape == (B, Hkv, P, D)
    assert torch.equal(kmin, rmin) and torch.equal(kmax, rmax)  # min/max are exact
    got = quest.page_bound(q[:, :, -1], kmin, kmax, impl="triton")
    torch.testing.assert_close(got, quest.page_bound_ref(q[:, :, -1], rmin, rmax), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(score("quest", q, k, impl="triton", page_size=page),
                               score("quest", q, k, impl="torch", page_size=page), atol=ATOL, rtol=RTOL)


def test_quest_minmax_covers_only_the_valid_tokens_of_the_last_page():
    _, k = rand_qk(1, 1, 1, 1, 37, 8, seed=1)
    kmin, kmax = quest.page_minmax(k, 16, impl="triton")
    assert kmin.shape[2] == 3
    for p, (a, b) in enumerate([(0, 16), (16, 32), (32, 37)]):
        assert torch.equal(kmin[0, 0, p], k[0, 0, a:b].amin(0))
        assert torch.equal(kmax[0, 0, p], k[0, 0, a:b].amax(0))


def test_quest_bound_is_an_upper_bound_of_every_key_in_the_page():
    q, k = rand_qk(2, 3, 3, 1, 90, 16, seed=2)
    bound = score("quest", q, k, impl="triton", page_size=8)
    dots = torch.einsum("bhd,bhld->bhl", q[:, :, -1], k)
    dots = F.pad(dots, (0, 96 - 90), value=float("-inf")).view(2, 3, 12, 8).amax(-1)
    assert (bound >= dots - 1e-5).all()
    assert (bound > dots + 1e-3).any()  # a bound, not the exact maximum


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (8, 2)])
def test_quest_picks_the_page_holding_a_planted_key(Hq, Hkv):
    q, k = rand_qk(1, Hq, Hkv, 4, 100, 16, seed=7)
    k *= 0.1
    q[:, :, -1] = axis(16)           # the decode query looks along e0 ...
    k[:, :, 3 * 16 + 5] = axis(16, 4.0)  # ... where page 3 holds a key
    for impl in ("triton", "torch"):
        assert rows(select("quest", q, k, 1, impl=impl)) == [[[3]] * Hkv]
        kept = select("quest", q, k, 3, impl=impl)
        assert kept.shape == (1, Hkv, 3) and (kept == 3).any(-1).all()
        assert (kept.diff(dim=-1) > 0).all()
    # earlier queries do not matter, only the last one
    q2 = q.clone()
    q2[:, :, :-1] = -q2[:, :, :-1]
    assert torch.equal(score("quest", q2, k), score("quest", q, k))


def test_quest_page_token_indices():
    pages = torch.tensor([[[1, 6]]])
    tok = quest.page_token_indices(pages, 16, 100)
    assert rows(tok) == [[list(range(16, 32)) + list(range(96, 100)) + [-1] * 12]]


# -- scores: Triton == reference for every method ---------------------------------------------------------

SCORE_SHAPES = [  # B, Hq, Hkv, Lq, L, D
    (1, 2, 2, 37, 37, 16),
    (2, 4, 1, 64, 131, 32),
    (1, 8, 1, 200, 200, 64),
]
METHOD_PARAMS = [
    ("h2o", {}),
    ("h2o", {"recent": 5}),
    ("snapkv", {"window": 16}),
    ("adakv", {"window": 16}),
    ("pyramidkv", {"window": 16}),
]


@pytest.mark.parametrize("B,Hq,Hkv,Lq,L,D", SCORE_SHAPES)
@pytest.mark.parametrize("method,params", METHOD_PARAMS)
def test_scores_triton_match_reference(method, params, B, Hq, Hkv, Lq, L, D):
    q, k = rand_qk(B, Hq, Hkv, Lq, L, D, seed=B * L)
    got = score(method, q, k, impl="triton", **params)
    ref = score(method, q, k, impl="torch", **params)
    assert got.shape == (B, Hkv, L)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got[fin], ref[fin], atol=ATOL, rtol=RTOL)
    assert torch.equal(score(method, q, k, **params), ref)  # auto on CPU is the reference


def kvpress_style_snapkv(q, k, window, kernel_size=5):
    """SnapKV as kvpress computes it: per query head, pool, then the GQA mean; window at +inf."""
    B, Hq, Lq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    qw = q[:, :, -window:].float()
    s = qw @ k.float().repeat_interleave(Hq // Hkv, dim=1).transpose(-1, -2) / math.sqrt(D)
    s = s + torch.triu(torch.full_like(s, float("-inf")), diagonal=L - window + 1)
    attn = torch.softmax(s, dim=-1)[..., :-window].mean(-2)
    pooled = F.avg_pool1d(attn, kernel_size, padding=kernel_size // 2, stride=1)
    pooled = pooled.view(B, Hkv, Hq // Hkv, L - window).mean(2)
    return F.pad(pooled, (0, window), value=float("inf"))


@pytest.mark.parametrize("Hq,Hkv,L,window", [(4, 4, 61, 8), (8, 2, 130, 16), (8, 1, 99, 1)])
def test_snapkv_scores_follow_the_kvpress_definition(Hq, Hkv, L, window):
    q, k = rand_qk(1, Hq, Hkv, 40, L, 16, seed=L)
    want = kvpress_style_snapkv(q, k, window)
    for impl in ("triton", "torch"):
        got = score("snapkv", q, k, impl=impl, window=window)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], atol=ATOL, rtol=RTOL)
    # only the last `window` queries count
    q2 = q.clone()
    q2[:, :, : 40 - window] = torch.randn(1, Hq, 40 - window, 16)
    assert torch.equal(score("snapkv", q2, k, window=window), score("snapkv", q, k, window=window))


# -- selections on hand-made patterns ---------------------------------------------------------------------


def test_streaming_llm_keeps_sinks_and_recent_tokens():
    q, k = rand_qk(2, 4, 2, 1, 50, 8)
    want = [0, 1, 2, 3] + list(range(44, 50))
    kept = select("streaming_llm", q, k, 10)
    assert kept.dtype == torch.int64 and rows(kept) == [[want] * 2] * 2
    assert rows(select("streaming_llm", q, k, 6, n_sink=0, impl="triton")[0, 0]) == list(range(44, 50))
    s = score("streaming_llm", q, k, n_sink=2)
    assert s[0, 0, :2].isinf().all() and rows(s[0, 0, 2:5]) == [2.0, 3.0, 4.0]


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_h2o_keeps_the_heavy_hitter_and_the_recent_window(impl):
    # equal logits everywhere except key 10: causal prefill, GQA 4
    q, k = planted_qk(4, 1, 64, 64, 16, heavy=[(0, 10)])
    kept = select("h2o", q, k, 8, impl=impl)  # recent = 4
    # besides the heavy hitter, causal accumulation favours the earliest keys (H2O's known bias)
    assert rows(kept) == [[[0, 1, 2, 10, 60, 61, 62, 63]]]
    _, flat = planted_qk(4, 1, 64, 64, 16, heavy=[])
    assert rows(select("h2o", q, flat, 8, impl=impl)) == [[[0, 1, 2, 3, 60, 61, 62, 63]]]
    assert rows(select("h2o", q, k, 8, impl=impl, recent=0)) == [[[0, 1, 2, 3, 4, 5, 6, 10]]]


def snapkv_pattern(Lq=40, L=128, window=16):
    """Window queries look along e0; key 20 lies along it, the window keys point away (low attention)."""
    q, k = planted_qk(2, 1, Lq, L, 16, heavy=[(0, 20)])
    k[0, 0, L - window:] = axis(16, -16.0)
    return q, k


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_snapkv_keeps_the_window_and_the_pooled_heavy_hitter(impl):
    q, k = snapkv_pattern()
    window = list(range(112, 128))
    kept = select("snapkv", q, k, 21, impl=impl, window=16)
    # pooling (kernel 5) spreads key 20's weight over 18..22; the window is kept despite low attention
    assert rows(kept) == [[[18, 19, 20, 21, 22] + window]]
    assert rows(select("snapkv", q, k, 16, impl=impl, window=16)) == [[window]]


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_pyramidkv_layers_keep_their_own_budget(impl):
    q, k = snapkv_pattern()
    budgets = pyramid_budgets(24, 4, 128, window=16)
    # 16 + 15.6, 16 + 10.53, 16 + 5.47, 16 + 0.4: largest remainders round the first two up
    assert budgets == [32, 27, 21, 16] and sum(budgets) == 4 * 24
    total = 0
    for layer in range(4):
        kept = select("pyramidkv", q, k, 24, impl=impl, window=16, layer=layer, num_layers=4)
        assert kept.shape == (1, 1, budgets[layer])
        # every layer keeps the window; those with room for it keep the pooled heavy hitter
        pooled = {18, 19, 20, 21, 22} if budgets[layer] >= 21 else set()
        assert set(range(112, 128)) | pooled <= set(rows(kept)[0][0])
        total += kept.shape[-1]
    assert rows(select("pyramidkv", q, k, 24, impl=impl, window=16, layer=3, num_layers=4)) == [[list(range(112, 128))]]
    assert total == 4 * 24


def test_pyramid_budgets_pinned():
    b = pyramid_budgets(100, 32, 1000, window=16)
    assert sum(b) == 3200 and b[0] == 180 and b[-1] == 20  # 16 + (2*84 - 4.2), 16 + 84/20
    assert b[:4] == [180, 175, 170, 164]
    # clamped: layer 0 cannot exceed L, so the first layer gets L and the average is kept
    assert pyramid_budgets(100, 8, 150, window=16) == [150, 136, 121, 107, 93, 79, 64, 50]
    assert pyramid_budgets(100, 1, 150, window=16) == [100]
    assert pyramid_budgets(16, 5, 150, window=16) == [16] * 5


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_pyramid_budgets_sum_exactly(data):
    L = data.draw(st.integers(1, 5000))
    window = data.draw(st.integers(0, min(L, 128)))
    budget = data.draw(st.integers(max(window, 1), L))
    n = data.draw(st.integers(1, 80))
    beta = data.draw(st.one_of(st.integers(1, 40), st.floats(1.0, 40.0)))
    b = pyramid_budgets(budget, n, L, window=window, beta=beta)
    assert len(b) == n and sum(b) == n * budget
    assert all(window <= x <= L for x in b)
    assert all(x >= y for x, y in zip(b, b[1:]))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_adakv_shares_the_budget_across_heads(impl):
    # head 0 has a heavy hitter at 20; head 1 is flat (zero queries): after the safeguard, the spare
    # slots go to head 0's pooled heavy hitter, then to head 1's flat keys (lowest index first)
    q, k = planted_qk(2, 2, 8, 64, 16, heavy=[(0, 20)], q_heads=[0])
    kept = select("adakv", q, k, 8, impl=impl, window=4, alpha=0.25)
    recent = [60, 61, 62, 63]
    assert kept.shape == (1, 2, 12)  # min(64, 2*8 - 1*max(2, 4))
    assert rows(kept) == [[[18, 19, 20, 21, 22] + recent + [-1] * 3, [2, 3, 4] + recent + [-1] * 5]]
    assert rows((kept >= 0).sum(-1)) == [[9, 7]]


@pytest.mark.parametrize("B,Hq,Hkv,L,budget,window,alpha", [
    (2, 8, 4, 96, 20, 8, 0.2), (1, 8, 1, 64, 10, 4, 0.5), (1, 16, 2, 131, 40, 16, 0.0), (2, 4, 4, 50, 50, 8, 0.2)])
def test_adakv_invariants(B, Hq, Hkv, L, budget, window, alpha):
    q, k = rand_qk(B, Hq, Hkv, 32, L, 16, seed=L)
    kept = select("adakv", q, k, budget, impl="triton", window=window, alpha=alpha)
    assert torch.equal(kept, select("adakv", q, k, budget, impl="torch", window=window, alpha=alpha))
    n_min = max(int(alpha * budget), window)
    assert kept.shape == (B, Hkv, min(L, Hkv * budget - (Hkv - 1) * n_min))
    counts = (kept >= 0).sum(-1)
    assert rows(counts.sum(-1)) == [Hkv * budget] * B  # the layer's total, exactly
    assert (counts >= n_min).all()
    scores = score("adakv", q, k, window=window)
    for b in range(B):
        for h in range(Hkv):
            row = kept[b, h]
            idx = row[: counts[b, h]]
            assert (row[counts[b, h]:] == -1).all() and (idx.diff() > 0).all()
            assert set(range(L - window, L)) <= set(idx.tolist())
            dropped = torch.ones(L, dtype=torch.bool)
            dropped[idx] = False
            if dropped.any():  # a head keeps the best of its own scores
                assert scores[b, h, idx].min() >= scores[b, h, dropped].max()


def test_select_is_ascending_and_within_budget_for_random_inputs():
    q, k = rand_qk(2, 4, 2, 30, 90, 16, seed=11)
    for method, params, n in [("streaming_llm", {}, 25), ("h2o", {}, 25), ("h2o", {"causal": False}, 25),
                              ("snapkv", {"window": 10}, 25), ("quest", {"page_size": 8}, 5)]:
        a = select(method, q, k, n, impl="triton", **params)
        assert torch.equal(a, select(method, q, k, n, impl="torch", **params))
        assert a.shape == (2, 2, n) and (a.diff(dim=-1) > 0).all()


# -- compress ---------------------------------------------------------------------------------------------


def test_compress_gathers_the_kept_rows():
    B, H, L = 2, 3, 20
    k = torch.arange(B * H * L * 4, dtype=torch.float32).view(B, H, L, 4)
    v = -torch.arange(B * H * L * 6, dtype=torch.float32).view(B, H, L, 6)  # another head_dim
    kept = torch.tensor([[[0, 5, 19], [1, 2, 3], [7, -1, -1]], [[4, 8, 9], [10, 11, 12], [-1, -1, -1]]])
    kk, vv = compress(k, v, kept)
    assert kk.shape == (B, H, 3, 4) and vv.shape == (B, H, 3, 6)
    for b in range(B):
        for h in range(H):
            for i, j in enumerate(kept[b, h].tolist()):
                if j < 0:
                    assert not kk[b, h, i].any() and not vv[b, h, i].any()
                else:
                    assert torch.equal(kk[b, h, i], k[b, h, j]) and torch.equal(vv[b, h, i], v[b, h, j])


def test_compress_after_select():
    q, k = snapkv_pattern()
    v = torch.randn(1, 1, 128, 16)
    kept = select("snapkv", q, k, 21, window=16)
    kk, vv = compress(k, v, kept)
    assert torch.equal(kk[0, 0, 2], k[0, 0, 20]) and torch.equal(vv[0, 0, 5:], v[0, 0, 112:])


# -- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,fix", [
    (lambda q, k: select("h2o", q[:, :3], k, 8), "multiple of Hkv"),
    (lambda q, k: select("h2o", q, k, 65), "at most the L=64"),
    (lambda q, k: select("h2o", q, k, 0), "budget=0"),
    (lambda q, k: select("lru", q, k, 8), "use one of streaming_llm, h2o"),
    (lambda q, k: score("snapkv", q, k, windw=8), "its parameters are window, kernel_size"),
    (lambda q, k: select("snapkv", q, k, 8, window=16), "raise budget or lower window"),
    (lambda q, k: select("snapkv", q[:, :, :4], k, 20, window=16), "lower window"),
    (lambda q, k: score("snapkv", q, k, window=8, kernel_size=4), "must be odd"),
    (lambda q, k: select("pyramidkv", q, k, 20, window=16), "needs layer, num_layers"),
    (lambda q, k: select("pyramidkv", q, k, 20, window=16, layer=4, num_layers=4), "layers count from 0"),
    (lambda q, k: select("adakv", q, k, 20, window=16, alpha=1.5), "fraction in [0, 1]"),
    (lambda q, k: select("quest", q, k, 5), "counts pages of 16 tokens"),
    (lambda q, k: select("streaming_llm", q, k, 3), "sinks are kept within the budget"),
    (lambda q, k: select("h2o", q, k, 8, recent=9), "recent window is kept within the budget"),
    (lambda q, k: score("h2o", q, k[:, :, :10]), "causal=False"),
    (lambda q, k: score("h2o", q, k[..., :8]), "[B, Hkv, L, D]"),
    (lambda q, k: score("h2o", q, k, impl="cuda"), "is not one of"),
    (lambda q, k: compress(k, k, torch.full((1, 2, 3), 64)), "select them on these keys"),
    (lambda q, k: compress(k, k, torch.zeros(1, 2, 3)), "pass select()'s output"),
])
def test_bad_input_is_a_bad_request_naming_the_fix(call, fix):
    q, k = rand_qk(1, 4, 2, 64, 64, 16)
    with pytest.raises(BadRequest) as e:
        call(q, k)
    assert fix in str(e.value)
    assert e.value.status == 400
