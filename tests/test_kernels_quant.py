"""KV quantization (fp8, int8, KIVI int4/int2): Triton (under the interpreter on CPU) against the
PyTorch reference bit for bit, error bounds, the residual window, packing, payload round trips,
compression ratios and input errors."""

from __future__ import annotations

import math

import pytest
import torch

from kvpool.errors import BadRequest
from kvpool.kernels import quant_kivi
from kvpool.kernels._backend import HAVE_TRITON, triton_runs_on
from kvpool.kernels.quant import FORMATS, QuantizedKV, compression_ratio, dequantize, quantize
from kvpool.spec import STORAGE_FORMATS

needs_triton = pytest.mark.skipif(
    not (HAVE_TRITON and triton_runs_on(torch.device("cpu"))), reason="Triton cannot run on CPU here"
)

# (fmt, params): every format, fp8/int8 with both scale granularities.
VARIANTS = [
    ("fp8", {}),
    ("fp8", {"granularity": "layer"}),
    ("int8", {}),
    ("int8", {"granularity": "layer"}),
    ("int4-kivi", {}),
    ("int2-kivi", {}),
    ("int4-kivi", {"group": 16, "residual": 5}),
    ("int2-kivi", {"group": 8, "residual": 0}),
]
VARIANT_IDS = [f + "".join(f"-{k}={v}" for k, v in p.items()) for f, p in VARIANTS]


def make_kv(shape, dtype=torch.float32, seed=0):
    """Random KV ``[..., 2, T, H, D]`` with per-channel key offsets and a few outliers, as real
    keys have (the reason KIVI quantizes keys per channel)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    D = shape[-1]
    x[..., 0, :, :, :] += 4 * torch.randn(D, generator=g)
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (8,), generator=g)] *= 20
    return x.to(dtype)


def assert_same_quantized(a: QuantizedKV, b: QuantizedKV):
    assert (a.fmt, a.shape, a.dtype, a.params) == (b.fmt, b.shape, b.dtype, b.params)
    ta, tb = a.tensors(), b.tensors()
    assert list(ta) == list(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name], tb[name]), f"{name} differs"


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (tells -0.0 from 0.0, unlike torch.equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --------------------------------------------------------------------------- Triton == reference


@needs_triton
@pytest.mark.parametrize("fmt, params", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("shape", [(2, 2, 45, 8, 16), (1, 2, 70, 1, 64), (2, 19, 2, 128), (1, 2, 2, 37, 2, 32)],
                         ids=["H8-D16", "H1-D64", "noLayerDim-H2-D128", "twoLeadDims"])
def test_triton_matches_reference_bf16(fmt, params, shape):
    x = make_kv(shape, torch.bfloat16, seed=len(shape) + shape[-1])
    ref = quantize(x, fmt, impl="torch", **params)
    tri = quantize(x, fmt, impl="triton", **params)
    assert_same_quantized(ref, tri)
    out_ref, out_tri = dequantize(ref, impl="torch"), dequantize(tri, impl="triton")
    assert out_ref.shape == x.shape and out_ref.dtype == x.dtype
    assert bits_equal(out_ref, out_tri)


@needs_triton
@pytest.mark.parametrize("fmt, params", VARIANTS[::2] + VARIANTS[5:6], ids=VARIANT_IDS[::2] + VARIANT_IDS[5:6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference_other_dtypes(fmt, params, dtype):
    x = make_kv((2, 2, 77, 2, 64), dtype, seed=3)
    ref = quantize(x, fmt, impl="torch", **params)
    tri = quantize(x, fmt, impl="triton", **params)
    assert_same_quantized(ref, tri)
    assert bits_equal(dequantize(ref, impl="torch"), dequantize(tri, impl="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, params", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_triton_on_cuda_matches_cpu_reference(fmt, params, dtype):
    """The compiled kernels (not the interpreter) against the CPU reference, bit for bit."""
    x = make_kv((2, 2, 300, 8, 128), dtype, seed=6)
    ref = quantize(x, fmt, impl="torch", **params)
    gpu = quantize(x.cuda(), fmt, impl="triton", **params)
    assert all(t.is_cuda for t in gpu.tensors().values())
    host = QuantizedKV(gpu.fmt, gpu.shape, gpu.dtype, gpu.params, **{n: t.cpu() for n, t in gpu.tensors().items()})
    assert_same_quantized(ref, host)
    assert bits_equal(dequantize(ref, impl="torch"), dequantize(gpu, impl="triton").cpu())


def test_non_contiguous_input_quantizes_like_its_copy():
    base = make_kv((2, 2, 90, 4, 32), seed=5)
    view = base[:, :, 10:80]  # not contiguous
    assert not view.is_contiguous()
    for fmt in FORMATS:
        assert_same_quantized(quantize(view, fmt, impl="torch"), quantize(view.contiguous(), fmt, impl="torch"))


# --------------------------------------------------------------------------- fp8 encoding


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from kvpool.kernels.quant_fp8 import _e4m3_code

    @triton.jit
    def _encode_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
        """The quant kernel's encoding step alone (clamp to +-448, then the bit pattern)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        y = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, _e4m3_code(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.uint8), mask=mask)


def e4m3_edge_values() -> torch.Tensor:
    """Every finite e4m3 value (both zeros), every midpoint between neighbours (ties), the fp32
    neighbours of all of those, values past saturation, and tiny values that round to +-0."""
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite)]
    pos = torch.sort(finite[finite > 0]).values
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32
    mids = torch.cat([mids, pos[:1] / 2])  # tie between 0 and the smallest subnormal
    base = torch.cat([pos, mids, torch.tensor([448.5, 464.0, 479.9, 480.0, 1e4, 3e38, 1e-30, 2.0 ** -12])])
    bits = base.view(torch.int32)
    around = torch.cat([base, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
    return torch.cat([around, -around, torch.tensor([0.0, -0.0])])


@needs_triton
def test_fp8_encoding_matches_torch_on_every_edge():
    x = e4m3_edge_values()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out, want)
    # The set really holds ties, subnormals, signed zeros and saturation.
    assert {0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE} <= set(out.tolist())
    assert 0x7F not in out.tolist() and 0xFF not in out.tolist()  # never NaN


@needs_triton
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp8_codes_are_torch_float8_of_the_scaled_input(impl):
    """Rows whose amax is 448 have scale exactly 1, so codes must be torch's float8 of x itself."""
    values = e4m3_edge_values()
    values = values[values.abs() < 448]
    D = 32
    n = -(-values.numel() // (D - 1))
    rows = torch.cat([values, torch.zeros(n * (D - 1) - values.numel())]).view(n, D - 1)
    rows = torch.cat([torch.full((n, 1), 448.0), rows], 1)
    x = rows.view(1, 2, n // 2, 1, D) if n % 2 == 0 else torch.cat([rows, rows[:1]]).view(1, 2, (n + 1) // 2, 1, D)
    q = quantize(x, "fp8", impl=impl)
    assert torch.equal(q.scales, torch.ones_like(q.scales))
    assert torch.equal(q.codes, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert bits_equal(dequantize(q, impl=impl), x.to(torch.float8_e4m3fn).float())


@needs_triton
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp8_saturates_when_the_scale_rounds_low(impl):
    """For many amax, fl(amax / fl(amax / 448)) > 448: that value must saturate to 448 (0x7E)."""
    amax = torch.linspace(1.0, 1.001, 101)
    amax = amax[amax / (amax / 448) > 448][:4]
    assert amax.numel() == 4
    x = torch.zeros(1, 2, 2, 1, 16)
    x.view(-1, 16)[:, 0] = amax
    x.view(-1, 16)[:, 1] = -amax
    q = quantize(x, "fp8", impl=impl)
    assert q.codes.view(-1, 16)[:, 0].tolist() == [0x7E] * 4
    assert q.codes.view(-1, 16)[:, 1].tolist() == [0xFE] * 4


# --------------------------------------------------------------------------- int8 and KIVI exact cases


@needs_triton
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_int8_rounds_half_to_even(impl):
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.0, 3.49, -3.51, 0.0, 0, 0, 0, 0])
    q = quantize(row.view(1, 2, 1, 1, 8), "int8", impl=impl)
    assert torch.equal(q.scales, torch.ones(1, 2, 1, 1))
    assert q.codes.view(-1).tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -127, 3, -4, 0, 0, 0, 0, 0]


@needs_triton
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_input_takes_unit_scales_and_decodes_exactly(impl, fmt):
    x = torch.zeros(2, 2, 40, 2, 16, dtype=torch.bfloat16)
    q = quantize(x, fmt, impl=impl, **({"residual": 0, "group": 8} if "kivi" in fmt else {}))
    assert torch.equal(q.scales, torch.ones_like(q.scales)) and q.scales.numel() > 0
    assert not q.codes.float().any()
    assert torch.equal(dequantize(q, impl=impl), x)


@needs_triton
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_kivi_key_codes_layout(impl):
    """Keys x[t, h, d] = t over a group of 16 tokens: min 0, scale 1, code t for every channel,
    so channels (2i, 2i+1) pack to byte t | t << 4; values x = d: per-token codes d % 16."""
    G, H, D = 16, 2, 32
    x = torch.zeros(1, 2, G, H, D)
    x[0, 0] = torch.arange(G, dtype=torch.float32)[:, None, None]
    x[0, 1] = torch.arange(D, dtype=torch.float32) % G
    q = quantize(x, "int4-kivi", impl=impl, group=G, residual=0)
    assert q.codes.shape == (1, 2, G, H, D // 2)
    assert torch.equal(q.codes[0, 0], (torch.arange(G) * 17).to(torch.uint8)[:, None, None].expand(G, H, D // 2))
    assert torch.equal(q.scales, torch.ones(1, 1, H, D)) and torch.equal(q.mins, torch.zeros(1, 1, H, D))
    even, odd = torch.arange(0, G, 2), torch.arange(1, G, 2)
    assert torch.equal(q.codes[0, 1, 0, 0], (even | odd << 4).repeat(D // G).to(torch.uint8))
    assert torch.equal(dequantize(q, impl=impl), x)


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_round_trip_and_bit_order(bits):
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (3, 5, 64), generator=g).to(torch.uint8)
    packed = quant_kivi.pack_ref(q, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant_kivi.unpack_ref(packed, bits), q)
    first = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    want = 0x21 if bits == 4 else 0b00_11_10_01  # low bits first
    assert quant_kivi.pack_ref(first, bits)[0].item() == want


# --------------------------------------------------------------------------- error bounds


@needs_triton
@pytest.mark.parametrize("granularity", ["token_head", "layer"])
def test_fp8_relative_error_bound(granularity):
    x = make_kv((2, 2, 24, 4, 64), seed=11)
    x.view(-1)[::97] *= 1e-5  # some values land in e4m3's subnormal range
    q = quantize(x, "fp8", impl="triton", granularity=granularity)
    out = dequantize(q, impl="triton")
    scale = q.scales[..., None] if granularity == "token_head" else q.scales[:, :, None, None, None]
    normal = (x / scale).abs() >= 2.0 ** -6
    err = (out - x).abs()
    assert normal.float().mean() > 0.9
    rel = err[normal] / x.abs()[normal]
    assert rel.max() <= 2.0 ** -4 + 2.0 ** -20
    assert rel.max() > 2.0 ** -5  # the bound is nearly reached: the test can tell a worse encoder
    # Subnormal range: steps of 2**-9 * scale, so at most half a step off.
    sub_err = (err / scale.expand_as(x))[~normal]
    assert sub_err.numel() > 50
    assert sub_err.max() <= 2.0 ** -10 * (1 + 2.0 ** -12)


@needs_triton
def test_int8_error_is_at_most_half_a_step():
    x = make_kv((2, 2, 24, 4, 64), seed=12)
    q = quantize(x, "int8", impl="triton")
    err = (dequantize(q, impl="triton") - x).abs()
    steps = err / q.scales[..., None]
    assert steps.max() <= 0.5 + 1e-5
    assert steps.max() > 0.45


@needs_triton
@pytest.mark.parametrize("fmt", ["int4-kivi", "int2-kivi"])
@pytest.mark.parametrize("group, residual, D", [(32, 32, 64), (16, 5, 16), (32, 0, 16)])
def test_kivi_error_is_at_most_half_a_step_per_group(fmt, group, residual, D):
    x = make_kv((2, 2, 83, 2, D), seed=group + D)
    q = quantize(x, fmt, impl="triton", group=group, residual=residual)
    out = dequantize(q, impl="triton")
    tq = q.codes.shape[2]
    assert tq == ((83 - residual) // group) * group and tq > 0
    gv = min(group, D)
    kscale = q.scales.repeat_interleave(group, dim=1)  # [L, Tq, H, D]
    vscale = q.value_scales.repeat_interleave(gv, dim=-1)
    for part, scale, mins in ((0, kscale, q.mins.repeat_interleave(group, dim=1)),
                              (1, vscale, q.value_mins.repeat_interleave(gv, dim=-1))):
        xs = x[:, part, :tq]
        err = (out[:, part, :tq] - xs).abs()
        slack = 2.0 ** -20 * (mins.abs() + 16 * scale)  # fp32 rounding of x - min, / scale, * scale, + min
        assert (err <= scale / 2 + slack).all()
        assert (err / scale).max() > 0.4


# --------------------------------------------------------------------------- residual window


@pytest.mark.parametrize("T, group, residual, tq", [
    (80, 32, 32, 32), (64, 32, 32, 32), (95, 32, 32, 32), (96, 32, 32, 64), (63, 32, 32, 0),
    (100, 16, 5, 80), (10, 4, 0, 8), (31, 32, 0, 0), (20, 4, 40, 0),
])
def test_kivi_token_split_rule(T, group, residual, tq):
    assert quant_kivi.quantized_tokens(T, group, residual) == tq
    x = make_kv((1, 2, T, 1, 16), torch.bfloat16, seed=T)
    q = quantize(x, "int4-kivi", impl="torch", group=group, residual=residual)
    assert q.codes.shape == (1, 2, tq, 1, 8)
    assert q.residual.shape == (1, 2, T - tq, 1, 16)
    assert T - tq >= min(residual, T)


@needs_triton
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["int4-kivi", "int2-kivi"])
def test_kivi_residual_window_is_exact(impl, fmt):
    x = make_kv((2, 2, 75, 2, 32), torch.bfloat16, seed=7)
    q = quantize(x, fmt, impl=impl, group=16, residual=10)
    tq = 64  # floor((75 - 10) / 16) * 16: the last 11 tokens stay
    assert bits_equal(q.residual, x[:, :, tq:].contiguous())
    out = dequantize(q, impl=impl)
    assert bits_equal(out[:, :, tq:], x[:, :, tq:])
    assert not torch.equal(out[:, :, :tq], x[:, :, :tq])  # the rest is lossy


def test_kivi_with_fewer_tokens_than_the_window_is_lossless():
    x = make_kv((2, 2, 20, 2, 32), torch.float16, seed=8)
    q = quantize(x, "int2-kivi", impl="torch")
    assert q.codes.numel() == 0 and q.scales.numel() == 0
    assert bits_equal(dequantize(q), x)
    assert bits_equal(QuantizedKV.from_bytes(q.to_bytes()).residual, x)


# --------------------------------------------------------------------------- payloads


@pytest.mark.parametrize("fmt, params", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("shape, dtype", [((3, 2, 50, 2, 32), torch.bfloat16), ((2, 40, 1, 16), torch.float16),
                                          ((2, 1, 2, 45, 2, 16), torch.float32)], ids=["bf16-5d", "f16-4d", "f32-6d"])
def test_payload_round_trip_is_lossless(fmt, params, shape, dtype):
    x = make_kv(shape, dtype, seed=9)
    q = quantize(x, fmt, impl="torch", **params)
    data = q.to_bytes()
    assert isinstance(data, bytes)
    assert q.nbytes < len(data) <= q.nbytes + 300
    back = QuantizedKV.from_bytes(data)
    assert_same_quantized(q, back)
    assert back.shape == shape and back.dtype == dtype and back.nbytes == q.nbytes
    assert bits_equal(dequantize(back), dequantize(q))
    assert QuantizedKV.from_bytes(bytearray(data)).to_bytes() == data


def test_corrupt_payloads_are_bad_requests():
    q = quantize(make_kv((1, 2, 40, 2, 16), seed=1), "int4-kivi", group=8, residual=4)
    data = q.to_bytes()
    with pytest.raises(BadRequest, match="magic"):
        QuantizedKV.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(BadRequest, match="cut short"):
        QuantizedKV.from_bytes(data[:-1])
    with pytest.raises(BadRequest, match="trailing"):
        QuantizedKV.from_bytes(data + b"\0")
    with pytest.raises(BadRequest, match="prefix"):
        QuantizedKV.from_bytes(data[:3])
    # A header whose shape disagrees with its tensors (tokens 40 -> 48: same digit count).
    tampered = data.replace(b"\x28\x02\x10", b"\x30\x02\x10", 1)
    assert tampered != data
    with pytest.raises(BadRequest, match="implies"):
        QuantizedKV.from_bytes(tampered)


# --------------------------------------------------------------------------- compression


def expected_nbytes(fmt, L, T, H, D, in_bytes, group=32, residual=32):
    n = L * 2 * T * H * D
    if fmt in ("fp8", "int8"):
        return n + L * 2 * T * H * 4
    bits = 4 if fmt == "int4-kivi" else 2
    tq = ((T - residual) // group) * group
    codes = L * 2 * tq * H * D * bits // 8
    key_meta = 2 * L * (tq // group) * H * D * 4
    value_meta = 2 * L * tq * H * (D // min(group, D)) * 4
    return codes + key_meta + value_meta + L * 2 * (T - tq) * H * D * in_bytes


@pytest.mark.parametrize("fmt, residual, ratio", [
    ("fp8", None, 1.94), ("int8", None, 1.94), ("int4-kivi", 32, 2.21), ("int4-kivi", 0, 2.67),
    ("int2-kivi", 32, 2.91), ("int2-kivi", 0, 4.00),
])
def test_compression_ratio_of_a_pool_chunk(fmt, residual, ratio):
    """A bf16 pool chunk of 2 layers x 256 tokens x 8 KV heads x 128 (scales and mins are fp32)."""
    L, T, H, D = 2, 256, 8, 128
    x = make_kv((L, 2, T, H, D), torch.bfloat16, seed=4)
    params = {} if residual is None else {"residual": residual}
    q = quantize(x, fmt, impl="torch", **params)
    assert q.input_nbytes == x.numel() * 2
    assert q.nbytes == expected_nbytes(fmt, L, T, H, D, 2, residual=residual or 0)
    assert compression_ratio(q) == pytest.approx(ratio, abs=0.005)


# --------------------------------------------------------------------------- errors


def test_formats_are_the_spec_storage_formats():
    assert set(FORMATS) | {"raw"} == set(STORAGE_FORMATS)


@pytest.mark.parametrize("fmt", ["raw", "nf4", "FP8"])
def test_unknown_format_names_the_choices(fmt):
    with pytest.raises(BadRequest) as e:
        quantize(make_kv((1, 2, 4, 1, 16)), fmt)
    assert all(f in str(e.value) for f in FORMATS)
    assert isinstance(e.value, ValueError) and e.value.status == 400


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.float8_e4m3fn])
def test_wrong_dtype_is_a_bad_request(dtype):
    with pytest.raises(BadRequest, match="float32, float16 or bfloat16"):
        quantize(torch.zeros(1, 2, 4, 1, 16).to(dtype), "int8")


@pytest.mark.parametrize("shape", [(2, 4, 16), (3, 4, 1, 16), (1, 2, 0, 1, 16)])
def test_wrong_shape_is_a_bad_request(shape):
    with pytest.raises(BadRequest, match=r"\[\.\.\., 2, tokens, kv_heads, head_dim\]|empty"):
        quantize(torch.zeros(shape), "fp8")


@pytest.mark.parametrize("fmt, params, match", [
    ("fp8", {"group": 32}, "takes parameters"),
    ("int8", {"granularity": "channel"}, "granularity"),
    ("int4-kivi", {"granularity": "layer"}, "takes parameters"),
    ("int4-kivi", {"group": 0}, "group must be an int >= 1"),
    ("int2-kivi", {"residual": -1}, "residual must be an int >= 0"),
    ("int2-kivi", {"group": 2.0}, "group must be an int"),
    ("int4-kivi", {"group": 6}, "must divide head_dim"),  # 6 does not divide 16
    ("int2-kivi", {"group": 2}, "multiple of 4"),  # 2 channels cannot fill a byte of int2 codes
])
def test_bad_parameters_name_the_fix(fmt, params, match):
    with pytest.raises(BadRequest, match=match):
        quantize(torch.zeros(1, 2, 8, 1, 16), fmt, **params)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_a_bad_request(bad):
    x = torch.zeros(1, 2, 8, 1, 16)
    x[0, 1, 3, 0, 5] = bad
    with pytest.raises(BadRequest, match="NaN or inf"):
        quantize(x, "fp8")


def test_bad_impl_and_non_quantized_inputs():
    with pytest.raises(BadRequest, match="impl"):
        quantize(torch.zeros(1, 2, 8, 1, 16), "fp8", impl="cuda")
    with pytest.raises(BadRequest, match="QuantizedKV"):
        dequantize(torch.zeros(3))
    with pytest.raises(BadRequest, match="torch.Tensor"):
        quantize([[0.0]], "fp8")


def test_dequantize_refuses_a_container_whose_tensors_do_not_fit_its_format():
    q = quantize(make_kv((1, 2, 70, 2, 16), seed=3), "int4-kivi", group=16, residual=4)
    bad = QuantizedKV(q.fmt, q.shape, q.dtype, q.params, **{**q.tensors(), "codes": q.codes[:, :, :16]})
    with pytest.raises(BadRequest, match="implies"):
        dequantize(bad)
    wrong_params = QuantizedKV(q.fmt, q.shape, q.dtype, (("group", 32), ("residual", 4)), **q.tensors())
    with pytest.raises(BadRequest, match="implies"):
        dequantize(wrong_params)


def test_auto_impl_on_cpu_is_the_reference():
    x = make_kv((1, 2, 40, 2, 32), torch.bfloat16, seed=2)
    for fmt in FORMATS:
        q = quantize(x, fmt)
        assert_same_quantized(q, quantize(x, fmt, impl="torch"))
        assert math.isclose(compression_ratio(q), q.input_nbytes / q.nbytes)
