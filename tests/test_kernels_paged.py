"""Paged gather/scatter and scrub: Triton (interpreter on CPU) against the PyTorch references, bit
for bit, across every cache layout; hand-placed values pinning each layout's physical meaning;
and the errors that must leave the cache untouched."""

from __future__ import annotations

import pytest
import torch

from kvpool.errors import BadRequest
from kvpool.kernels.layouts import sglang_layout, vllm_layout
from kvpool.kernels.paged import (
    gather,
    gather_ref,
    scatter,
    scatter_ref,
    scrub,
    scrub_blocks,
    scrub_blocks_ref,
    scrub_ref,
)

LAYOUTS = ("vllm_cpu", "vllm_gpu", "sglang_layer_first", "sglang_page_first", "sglang_page_first_direct")
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# Helpers


def layout_of(name):
    engine, variant = name.split("_", 1)
    return vllm_layout(variant) if engine == "vllm" else sglang_layout(variant)


def bits(t):
    return t.view(INT_OF[t.element_size()])


def rand_bits(shape, dtype, gen):
    """Random bit patterns of ``dtype`` (NaNs and all): copies must move them unchanged."""
    itype = INT_OF[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(itype)
    return torch.randint(info.min, info.max, shape, dtype=itype, generator=gen).view(dtype)


def make_cache(name, layers, blocks, block_size, heads, dim, dtype, seed=0):
    """A random cache of the named layout with ``blocks * block_size`` slots. vLLM caches are
    per-layer lists (the GPU variant a permuted, non-contiguous view of [NB, BS, H, 2D] memory);
    SGLang's non-direct layouts have one slot per block, so capacity = blocks * block_size."""
    gen = torch.Generator().manual_seed(seed)
    size = blocks * block_size
    if name == "vllm_cpu":
        return [rand_bits((blocks, heads, block_size, 2 * dim), dtype, gen) for _ in range(layers)]
    if name == "vllm_gpu":
        return [rand_bits((blocks, block_size, heads, 2 * dim), dtype, gen).permute(0, 2, 1, 3) for _ in range(layers)]
    if name == "sglang_layer_first":
        return rand_bits((2, layers, size, heads, dim), dtype, gen)
    if name == "sglang_page_first":
        return rand_bits((2, size, layers, heads, dim), dtype, gen)
    assert name == "sglang_page_first_direct"
    return rand_bits((2, blocks, layers, block_size, heads, dim), dtype, gen)


def clone_cache(cache):
    if isinstance(cache, torch.Tensor):
        return cache.clone()
    # keep the GPU variant's non-contiguous strides
    return [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x) for x in cache]


def same_bits(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(bits(a), bits(b))
    return len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def block_table_slots(block_ids, block_size, tokens):
    """The slots an engine's block table gives: token i lives at block_ids[i // BS], offset i % BS."""
    return torch.tensor([block_ids[i // block_size] * block_size + i % block_size for i in range(tokens)])


def random_slots(capacity, tokens, seed):
    return torch.randperm(capacity, generator=torch.Generator().manual_seed(seed))[:tokens]


# (layout, layers, heads, head_dim, block_size, tokens, dtype): odd token counts, GQA head counts,
# two block sizes, a non-power-of-two head_dim, every layout and dtype width.
CASES = [
    ("vllm_cpu", 2, 1, 16, 16, 1, torch.float32),
    ("vllm_cpu", 3, 2, 64, 16, 33, torch.bfloat16),
    ("vllm_cpu", 2, 8, 16, 32, 7, torch.float16),
    ("vllm_gpu", 2, 4, 16, 16, 33, torch.float32),
    ("vllm_gpu", 2, 2, 64, 32, 7, torch.bfloat16),
    ("vllm_gpu", 1, 8, 24, 16, 1, torch.float16),
    ("sglang_layer_first", 3, 2, 16, 16, 33, torch.float16),
    ("sglang_layer_first", 2, 1, 64, 32, 7, torch.bfloat16),
    ("sglang_page_first", 2, 4, 16, 16, 7, torch.float32),
    ("sglang_page_first", 2, 8, 16, 16, 33, torch.bfloat16),
    ("sglang_page_first_direct", 2, 2, 16, 16, 33, torch.float16),
    ("sglang_page_first_direct", 3, 4, 64, 32, 1, torch.float32),
    ("vllm_cpu", 2, 2, 16, 16, 7, torch.float8_e4m3fn),
]


# ---------------------------------------------------------------------------------------------
# Triton == reference, round trips


@pytest.mark.parametrize("name,layers,heads,dim,bs,tokens,dtype", CASES)
def test_triton_matches_reference_bit_for_bit(name, layers, heads, dim, bs, tokens, dtype):
    blocks = 6
    layout = layout_of(name)
    cache = make_cache(name, layers, blocks, bs, heads, dim, dtype, seed=tokens)
    slots = random_slots(blocks * bs, tokens, seed=tokens + 1)

    got = gather(cache, slots, layout, impl="triton")
    want = gather_ref(cache, slots, layout)
    assert got.shape == (layers, 2, tokens, heads, dim) and got.dtype == dtype
    assert same_bits(got, want)

    chunk = rand_bits(tuple(got.shape), dtype, torch.Generator().manual_seed(7))
    by_triton, by_ref = clone_cache(cache), clone_cache(cache)
    scatter(chunk, by_triton, slots, layout, impl="triton")
    scatter_ref(chunk, by_ref, slots, layout)
    assert same_bits(by_triton, by_ref)
    assert not same_bits(by_triton, cache)  # the scatter wrote something

    # Round trip: the written tokens read back exactly; every other slot is untouched.
    assert same_bits(gather(by_triton, slots, layout, impl="triton"), chunk)
    others = torch.tensor(sorted(set(range(blocks * bs)) - set(slots.tolist())))
    assert same_bits(gather_ref(by_triton, others, layout), gather_ref(cache, others, layout))


@pytest.mark.parametrize("name", LAYOUTS)
def test_block_table_order_and_int32_slots(name):
    """Non-contiguous, descending block ids ([4, 3, 2, 1]) as an engine's block table hands them."""
    bs = 16
    layout = layout_of(name)
    cache = make_cache(name, 2, 6, bs, 2, 16, torch.bfloat16, seed=3)
    slots = block_table_slots([4, 3, 2, 1], bs, 50).to(torch.int32)
    got = gather(cache, slots, layout, impl="triton")
    assert same_bits(got, gather_ref(cache, slots.long(), layout))
    # token 0 is block 4 offset 0, token 16 is block 3 offset 0: i.e. slots 64 and 48
    single = gather_ref(cache, torch.tensor([64, 48]), layout)
    assert same_bits(got[:, :, [0, 16]], single)


def test_gather_into_strided_out_and_empty_slots():
    layout = vllm_layout("gpu")
    cache = make_cache("vllm_gpu", 2, 4, 16, 2, 16, torch.float16, seed=5)
    slots = random_slots(64, 9, seed=5)
    out = torch.zeros(9, 2, 2, 2, 16, dtype=torch.float16).permute(1, 2, 0, 3, 4)  # [L, 2, T, H, D], strided
    returned = gather(cache, slots, layout, out=out, impl="triton")
    assert returned is out
    assert same_bits(out, gather_ref(cache, slots, layout))
    for impl in ("triton", "torch"):
        empty = gather(cache, torch.tensor([], dtype=torch.int64), layout, impl=impl)
        assert empty.shape == (2, 2, 0, 2, 16)


def test_layers_below_layer_zero_and_stacked_tensor():
    """Per-layer tensors in any memory order (layer 1 below layer 0: negative offsets), and a
    stacked [L, NB, H, BS, 2D] tensor reading the same as its list of layers."""
    gen = torch.Generator().manual_seed(11)
    big = rand_bits((3, 4, 2, 16, 32), torch.float32, gen)
    layout = vllm_layout("cpu")
    slots = random_slots(64, 20, seed=11)
    reversed_layers = [big[2], big[1], big[0]]
    got = gather(reversed_layers, slots, layout, impl="triton")
    assert same_bits(got, gather_ref(reversed_layers, slots, layout))
    assert same_bits(got.flip(0), gather(big, slots, layout, impl="triton"))
    chunk = rand_bits((3, 2, 20, 2, 16), torch.float32, gen)
    a, b = big.clone(), big.clone()
    scatter(chunk, [a[2], a[1], a[0]], slots, layout, impl="triton")
    scatter_ref(chunk.flip(0), b, slots, layout)
    assert same_bits(a, b)


# ---------------------------------------------------------------------------------------------
# Physical meaning: values placed by hand at the address each layout documents


def physical_case(name, layers, blocks, bs, heads, dim):
    """Raw flat buffers, the cache seen through them, and where element (layer, kv, slot, head,
    dim) physically lives: ``where(...) -> (buffer index, flat position)``. The positions are
    written out from each engine's documented layout, independently of kvpool's views."""
    size = blocks * bs
    if name == "vllm_cpu":  # per (block, head) row of BS*2D: K transposed [D, BS], then V [BS, D]
        raws = [torch.zeros(blocks * heads * bs * 2 * dim) for _ in range(layers)]
        cache = [r.view(blocks, heads, bs, 2 * dim) for r in raws]

        def where(l, kv, s, h, d):
            b, o = divmod(s, bs)
            row = (b * heads + h) * bs * 2 * dim
            return l, row + (d * bs + o if kv == 0 else bs * dim + o * dim + d)
    elif name == "vllm_gpu":  # memory [NB, BS, H, 2D] (K then V on the last axis), seen as [NB, H, BS, 2D]
        raws = [torch.zeros(blocks * bs * heads * 2 * dim) for _ in range(layers)]
        cache = [r.view(blocks, bs, heads, 2 * dim).permute(0, 2, 1, 3) for r in raws]

        def where(l, kv, s, h, d):
            b, o = divmod(s, bs)
            return l, ((b * bs + o) * heads + h) * 2 * dim + kv * dim + d
    elif name == "sglang_layer_first":  # (2, L, size, H, D)
        raws = [torch.zeros(2 * layers * size * heads * dim)]
        cache = raws[0].view(2, layers, size, heads, dim)

        def where(l, kv, s, h, d):
            return 0, (((kv * layers + l) * size + s) * heads + h) * dim + d
    elif name == "sglang_page_first":  # (2, size, L, H, D)
        raws = [torch.zeros(2 * size * layers * heads * dim)]
        cache = raws[0].view(2, size, layers, heads, dim)

        def where(l, kv, s, h, d):
            return 0, (((kv * size + s) * layers + l) * heads + h) * dim + d
    else:  # (2, pages, L, page_size, H, D), slot = page * page_size + offset
        raws = [torch.zeros(2 * blocks * layers * bs * heads * dim)]
        cache = raws[0].view(2, blocks, layers, bs, heads, dim)

        def where(l, kv, s, h, d):
            p, o = divmod(s, bs)
            return 0, ((((kv * blocks + p) * layers + l) * bs + o) * heads + h) * dim + d
    return raws, cache, where


def code(l, kv, s, h, d):
    """A distinct, exactly representable value for every element."""
    return float(1 + ((((l * 2 + kv) * 1000 + s) * 8 + h) * 8 + d))


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_physical_meaning_of_each_layout(name, impl):
    layers, blocks, bs, heads, dim = 2, 3, 4, 2, 3
    raws, cache, where = physical_case(name, layers, blocks, bs, heads, dim)
    elems = [(l, kv, s, h, d) for l in range(layers) for kv in range(2) for s in range(blocks * bs)
             for h in range(heads) for d in range(dim)]
    placed = set()
    for e in elems:
        i, pos = where(*e)
        raws[i][pos] = code(*e)
        placed.add((i, pos))
    # the documented layout is a bijection onto the raw memory
    assert len(placed) == len(elems) == sum(r.numel() for r in raws)

    layout = layout_of(name)
    slots = [7, 0, 11, 4, 5]
    got = gather(cache, torch.tensor(slots), layout, impl=impl)
    want = torch.tensor([[[[[code(l, kv, s, h, d) for d in range(dim)] for h in range(heads)] for s in slots]
                          for kv in range(2)] for l in range(layers)])
    assert torch.equal(got, want)

    # scatter writes token t's K/V of head h exactly where the engine will read it
    for r in raws:
        r.zero_()
    scatter(want, cache, torch.tensor(slots), layout, impl=impl)
    for l in range(layers):
        for kv in range(2):
            for s in range(blocks * bs):
                for h in range(heads):
                    for d in range(dim):
                        i, pos = where(l, kv, s, h, d)
                        expect = code(l, kv, s, h, d) if s in slots else 0.0
                        assert raws[i][pos].item() == expect, (l, kv, s, h, d)


def test_vllm_cpu_geometry_of_the_observed_tensor():
    """vLLM's CPU cache seen in the wild: [16384, 2, 32, 128] / [8192, 4096, 128, 1] is 16384
    blocks of 32 tokens, 2 kv heads, head_dim 64 (meta tensor: no memory)."""
    x = torch.empty((16384, 2, 32, 128), dtype=torch.bfloat16, device="meta")
    assert x.stride() == (8192, 4096, 128, 1)
    views, geo = vllm_layout("cpu").views([x, x])
    assert (geo.num_layers, geo.num_blocks, geo.block_size, geo.kv_heads, geo.head_dim) == (2, 16384, 32, 2, 64)
    assert geo.capacity == 16384 * 32
    # [NB, BS, H, D] each. K is transposed in a block: a token 1, a dim 32 (= BS); V: a token 64,
    # a dim 1, starting 32*64 elements after K. A head is 4096, a block 8192 for both.
    k, v = views[0]
    assert k.shape == v.shape == (16384, 32, 2, 64)
    assert k.stride() == (8192, 1, 4096, 32)
    assert v.stride() == (8192, 64, 4096, 1)
    assert v.storage_offset() - k.storage_offset() == 2048
    assert vllm_layout(torch.device("cpu")) == vllm_layout("cpu")
    assert vllm_layout("cuda") == vllm_layout("gpu")


# ---------------------------------------------------------------------------------------------
# Scrub


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32])
def test_scrub_zeroes_exactly_the_pages(dtype):
    page_numel, pages = 300, 7
    gen = torch.Generator().manual_seed(2)
    buf = rand_bits((pages * page_numel + 50,), dtype, gen)  # a tail shorter than a page
    bits(buf)[bits(buf) == 0] = 1  # no zero is there by chance
    ids = torch.tensor([6, 0, 3, 3])  # the last whole page, the first, a repeat
    by_triton, by_ref = buf.clone(), buf.clone()
    scrub(by_triton, ids, page_numel, impl="triton")
    scrub_ref(by_ref, ids, page_numel)
    assert same_bits(by_triton, by_ref)
    for p in range(pages + 1):
        part = bits(by_triton)[p * page_numel:(p + 1) * page_numel]
        if p in (0, 3, 6):
            assert (part == 0).all(), p
        else:
            assert torch.equal(part, bits(buf)[p * page_numel:(p + 1) * page_numel]), p


def test_scrub_uint8_slab_in_multi_block_pages():
    """A page larger than one program's block (4096) is zeroed to its last byte, no further."""
    page_numel = 5000
    slab = torch.full((3 * page_numel,), 0xAB, dtype=torch.uint8)
    scrub(slab, torch.tensor([1], dtype=torch.int32), page_numel, impl="triton")
    assert (slab[:page_numel] == 0xAB).all() and (slab[page_numel:2 * page_numel] == 0).all()
    assert (slab[2 * page_numel:] == 0xAB).all()


@pytest.mark.parametrize("name", LAYOUTS)
def test_scrub_blocks(name):
    bs, blocks = 16, 5
    layout = layout_of(name)
    cache = make_cache(name, 2, blocks, bs, 2, 16, torch.float16, seed=9)
    for t in [cache] if isinstance(cache, torch.Tensor) else cache:
        bits(t)[bits(t) == 0] = 1  # no zero by chance
    # SGLang's layer_first/page_first have one slot a block; page_first_direct a page of bs slots
    one_slot = name in ("sglang_layer_first", "sglang_page_first")
    per_block = 1 if one_slot else bs
    n_blocks = blocks * bs // per_block
    ids = torch.tensor([n_blocks - 1, 1, 1])
    by_triton, by_ref = clone_cache(cache), clone_cache(cache)
    scrub_blocks(by_triton, ids, layout, impl="triton")
    scrub_blocks_ref(by_ref, ids, layout)
    assert same_bits(by_triton, by_ref)
    scrubbed = {b * per_block + o for b in (1, n_blocks - 1) for o in range(per_block)}
    gone = torch.tensor(sorted(scrubbed))
    kept = torch.tensor(sorted(set(range(blocks * bs)) - scrubbed))
    assert (bits(gather_ref(by_triton, gone, layout)) == 0).all()
    assert same_bits(gather_ref(by_triton, kept, layout), gather_ref(cache, kept, layout))


# ---------------------------------------------------------------------------------------------
# Errors: BadRequest before any write


def small_vllm(dtype=torch.float32):
    return make_cache("vllm_cpu", 2, 4, 16, 2, 16, dtype, seed=1)  # 64 slots


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("bad", [[3, 64], [-1, 5], [200]])
def test_out_of_range_slots_are_refused_before_any_write(impl, bad):
    layout = vllm_layout("cpu")
    cache = small_vllm()
    before = clone_cache(cache)
    chunk = torch.zeros(2, 2, len(bad), 2, 16)
    with pytest.raises(BadRequest, match="out of range"):
        scatter(chunk, cache, torch.tensor(bad), layout, impl=impl)
    with pytest.raises(BadRequest, match="out of range"):
        gather(cache, torch.tensor(bad), layout, impl=impl)
    assert same_bits(cache, before)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_duplicate_scatter_slot_is_refused(impl):
    layout = sglang_layout("page_first_direct")
    cache = make_cache("sglang_page_first_direct", 2, 4, 16, 2, 16, torch.float16, seed=4)
    before = clone_cache(cache)
    chunk = torch.zeros(2, 2, 3, 2, 16, dtype=torch.float16)
    with pytest.raises(BadRequest, match="slot 9 appears more than once"):
        scatter(chunk, cache, torch.tensor([9, 2, 9]), layout, impl=impl)
    assert same_bits(cache, before)
    gather(cache, torch.tensor([9, 2, 9]), layout, impl=impl)  # reading a slot twice is fine


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_chunk_dtype_shape_and_slot_type_are_checked(impl):
    layout = vllm_layout("cpu")
    cache = small_vllm()
    before = clone_cache(cache)
    slots = torch.tensor([1, 2, 3])
    with pytest.raises(BadRequest, match="convert"):
        scatter(torch.zeros(2, 2, 3, 2, 16, dtype=torch.float16), cache, slots, layout, impl=impl)
    with pytest.raises(BadRequest, match=r"need \(2, 2, 3, 2, 16\)"):
        scatter(torch.zeros(2, 2, 4, 2, 16), cache, slots, layout, impl=impl)
    with pytest.raises(BadRequest, match=r"need \(2, 2, 3, 2, 16\)"):
        gather(cache, slots, layout, out=torch.zeros(2, 2, 3, 16, 2), impl=impl)
    with pytest.raises(BadRequest, match="1-D integer"):
        scatter(torch.zeros(2, 2, 3, 2, 16), cache, slots.float(), layout, impl=impl)
    with pytest.raises(BadRequest, match="1-D integer"):
        gather(cache, slots.view(3, 1), layout, impl=impl)
    assert same_bits(cache, before)


def test_wrong_cache_shapes_are_refused():
    slots = torch.tensor([0])
    with pytest.raises(BadRequest, match=r"\[num_blocks, kv_heads, block_size, 2\*head_dim\]"):
        gather([torch.zeros(4, 2, 16)], slots, vllm_layout("gpu"))
    with pytest.raises(BadRequest, match="layer 1"):
        gather([torch.zeros(4, 2, 16, 32), torch.zeros(5, 2, 16, 32)], slots, vllm_layout("cpu"))
    with pytest.raises(BadRequest, match="layer 1"):
        gather([torch.zeros(4, 2, 16, 32), torch.zeros(4, 2, 16, 32, dtype=torch.float16)], slots, vllm_layout("cpu"))
    with pytest.raises(BadRequest, match="list"):
        gather({"layer.0": torch.zeros(4, 2, 16, 32)}, slots, vllm_layout("cpu"))
    strided = torch.zeros(4, 16, 2, 32).permute(0, 2, 1, 3)
    with pytest.raises(BadRequest, match="vllm_layout\\('gpu'\\)"):
        gather([strided], slots, vllm_layout("cpu"))
    gather([strided], slots, vllm_layout("gpu"))  # the GPU variant reads it through its strides
    with pytest.raises(BadRequest, match=r"\(2, L, size, H, D\)"):
        gather(torch.zeros(3, 2, 8, 2, 16), slots, sglang_layout("layer_first"))
    with pytest.raises(BadRequest, match=r"\(2, pages, L, page_size, H, D\)"):
        gather(torch.zeros(2, 4, 2, 2, 16), slots, sglang_layout("page_first_direct"))
    with pytest.raises(BadRequest, match="unknown sglang layout"):
        sglang_layout("head_first")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_scrub_checks(impl):
    buf = torch.ones(1000)
    with pytest.raises(BadRequest, match="page 3 is out of range"):
        scrub(buf, torch.tensor([0, 3]), 300, impl=impl)  # page 3 would run past the end
    with pytest.raises(BadRequest, match="page -1 is out of range"):
        scrub(buf, torch.tensor([-1]), 300, impl=impl)
    with pytest.raises(BadRequest, match="positive int"):
        scrub(buf, torch.tensor([0]), 0, impl=impl)
    with pytest.raises(BadRequest, match="contiguous"):
        scrub(torch.ones(10, 10).t(), torch.tensor([0]), 10, impl=impl)
    cache = small_vllm()
    before = clone_cache(cache)
    with pytest.raises(BadRequest, match="block 4 is out of range"):
        scrub_blocks(cache, torch.tensor([0, 4]), vllm_layout("cpu"), impl=impl)
    assert torch.equal(buf, torch.ones(1000)) and same_bits(cache, before)


def test_vector_width_hint_only_claims_what_holds():
    """The Triton kernel tells the GPU compiler every row start is a multiple of this many
    elements (16-byte accesses); a wrong claim would misalign them, so it must be conservative."""
    from kvpool.kernels.paged import _vector_width

    fp16_strides = (64 * 1024, 2 * 16 * 64 * 4, 2 * 64 * 4, 2 * 64, 1)  # a vLLM GPU view, D=64, H=4
    assert _vector_width(2, 64, fp16_strides, 4096, [0, 1 << 20]) == 8
    assert _vector_width(4, 64, fp16_strides, 4096, [0]) == 4  # 16 bytes of fp32
    assert _vector_width(2, 20, (40, 40 * 16, 40 * 2, 20, 1), 4096, [0]) == 4  # head_dim 20: 4 | 20
    assert _vector_width(2, 64, fp16_strides, 4096 + 2, [0]) == 1  # base one element off
    assert _vector_width(2, 64, fp16_strides, 4096 + 4, [0]) == 2
    assert _vector_width(2, 64, fp16_strides, 4096, [0, 6]) == 2  # a layer 6 elements away
    assert _vector_width(2, 64, (128, 8, 1, 64, 2), 4096, [0]) == 1  # dims not unit-stride
    assert _vector_width(1, 64, fp16_strides, 4096, [0]) == 16


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
@pytest.mark.parametrize("consecutive", [True, False])
def test_layers_in_one_allocation_and_consecutive_slots_take_the_fast_paths_exactly(variant, consecutive):
    """vLLM allocates every layer in one buffer at an even spacing and a fresh engine hands out
    ascending blocks: the reference path's shortcuts for both must equal the Triton kernel."""
    layers, blocks, bs, heads, dim = 3, 8, 16, 2, 16
    g = torch.Generator().manual_seed(3)
    shape = (layers, blocks, heads, bs, 2 * dim) if variant == "cpu" else (layers, blocks, bs, heads, 2 * dim)
    whole = rand_bits(shape, torch.float32, g)

    def layers_of(buf):  # per-layer views of one buffer, as vLLM hands them over
        return list(buf.unbind(0)) if variant == "cpu" else [x.permute(0, 2, 1, 3) for x in buf.unbind(0)]

    def clone_cache(_):
        return layers_of(whole.clone())

    cache = layers_of(whole)
    slots = torch.arange(2 * bs, 5 * bs + 3) if consecutive else random_slots(blocks * bs, 3 * bs + 3, seed=4)
    layout = vllm_layout(variant)
    assert same_bits(gather(cache, slots, layout, impl="torch"), gather(cache, slots, layout, impl="triton"))
    chunk = rand_bits((layers, 2, slots.shape[0], heads, dim), torch.float32, torch.Generator().manual_seed(5))
    by_torch, by_triton = clone_cache(cache), clone_cache(cache)
    scatter(chunk, by_torch, slots, layout, impl="torch")
    scatter(chunk, by_triton, slots, layout, impl="triton")
    assert same_bits(by_torch, by_triton) and not same_bits(by_torch, cache)


# ---------------------------------------------------------------------------------------------
# One head of a cache (a pool slice goes straight into its head)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_caches_heads_take_their_slices_and_leave_the_others(name, impl):
    from kvpool.kernels.paged import BoundCache

    heads, tokens = 4, 21
    cache = make_cache(name, 2, 4, 16, heads, 16, torch.float32, seed=7)
    layout = layout_of(name)
    slots = random_slots(64, tokens, seed=3)
    chunk = rand_bits((2, 2, tokens, heads, 16), torch.float32, torch.Generator().manual_seed(4))
    whole, by_head = clone_cache(cache), clone_cache(cache)
    BoundCache(whole, layout).scatter(chunk, slots, impl=impl)
    bound = BoundCache(by_head, layout)
    for h in (2, 0, 3, 1):
        part = bound.heads(h, h + 1)
        assert part.geo.kv_heads == 1
        part.scatter(chunk[..., h: h + 1, :].contiguous(), slots, impl=impl)
        assert same_bits(part.gather(slots, impl=impl), chunk[..., h: h + 1, :])
    assert same_bits(whole, by_head)  # every head went where the whole chunk puts it
    one = clone_cache(cache)
    BoundCache(one, layout).heads(1, 3).scatter(chunk[..., 1:3, :].contiguous(), slots, impl=impl)
    got = gather_ref(one, slots, layout)
    assert same_bits(got[..., 1:3, :], chunk[..., 1:3, :])
    assert same_bits(got[..., [0, 3], :], gather_ref(cache, slots, layout)[..., [0, 3], :])  # the others untouched
    with pytest.raises(BadRequest, match="not among"):
        bound.heads(3, 5)
