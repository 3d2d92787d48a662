"""The model zoo (tests/zoo.py) through vLLM's CPU build with KVPoolConnector.

For each family vLLM serves with one attention KV cache group (full, or sliding-window: Mistral's
window shorter than the prompt, so only its tail is loaded): a prompt run cold saves its
chunks, the same prompt again loads them from the pool, and tokens and log-probs must equal the
cold run's exactly (prefix caching off: every reuse comes from the pool). For the families whose
KV transformers and vLLM compute alike (``CROSS_ENGINE``), chunks saved by the transformers
connector from the same checkpoint folder are loaded by vLLM and give vLLM's own greedy tokens;
for every other family the keys are the engine's own, so vLLM never loads them. Families the
connector cannot serve (a sliding window shorter than a chunk, MLA, GPT-NeoX whose CPU prefill is
not reproducible) are refused at engine start with the reason.
"""

from __future__ import annotations

import pytest
from conftest import need_engines

need_engines("vllm")

import torch  # noqa: E402
import zoo  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine, worker_connector  # noqa: E402
from kvpool.connectors.breakeven import BreakEven  # noqa: E402
from kvpool.connectors.families import CROSS_ENGINE, UnsupportedModel  # noqa: E402
from kvpool.connectors.hf import HFConnector  # noqa: E402
from kvpool.connectors.pools import close_local_pools  # noqa: E402

CHUNK = 64  # two vLLM blocks of 32
N = 200  # prompt tokens: three whole chunks and 8 more
POOL = {"backend": "local", "chunk_tokens": CHUNK, "dram_mib": 64, "breakeven_margin": 0.0}
LOGPROB_TOL = 2e-3  # transformers and vLLM compute the same fp32 KV with different kernels

# NOTE: the connector declares SupportsHMA, so vLLM's hybrid allocator stays on: Gemma 2/3 come as
# one KV cache group per layer kind and share of layers (full ones and sliding ones, each with block
# ids of its own; their loads are asynchronous), Mistral's layers all slide (one sliding-window
# group). Every window below is shorter than the prompt, so vLLM has freed the first chunks' blocks
# of the sliding layers at the load; "gemma2-paged-full" is the zoo's window of 40, shorter than a
# chunk, served with vLLM's allocator off (every layer paged as full attention), the fix the refusal
# of "gemma2-window40" names.
SERVED = ["llama", "qwen2", "qwen3", "phi", "gpt2", "gemma2", "gemma3", "gemma2-paged-full", "mistral-window96",
          "mistral-long-window"]
VARIANTS = {  # name: (zoo family, fields)
    "mistral-window96": ("mistral", dict(sliding_window=96)),
    "gemma2": ("gemma2", dict(sliding_window=96)), "gemma3": ("gemma3", dict(sliding_window=96)),
    "gemma2-paged-full": ("gemma2", {}), "gemma2-window40": ("gemma2", {}),
}
GROUPS = {"gemma2": 3, "gemma3": 3, "gemma2-paged-full": 1}  # KV cache groups vLLM makes (default: 1)
REFUSED = {
    "mistral": r"sliding window \(40 tokens\) is shorter than a pool chunk \(chunk_tokens=64\)",
    "gemma2-window40": r"sliding window \(40 tokens\) is shorter .*--disable-hybrid-kv-cache-manager",
    "deepseek-v3-mla": "latent",
    "gpt-neox": "reproducibly",
}
OVERRIDES = {
    # dense layers: vLLM's CPU MoE needs an EP group; and head dims vLLM's AMX MLA backend packs (on a CPU with
    # AMX it loads the weights before the connector starts, and refuses 48 input features)
    "deepseek-v3-mla": dict(first_k_dense_replace=3, qk_nope_head_dim=64, v_head_dim=32),
    **{name: dict(tie_word_embeddings=True) for name in VARIANTS if name.startswith("gemma")},  # vLLM's Gemma ties them
}

ENGINE_ARGS = {"gemma2-paged-full": dict(disable_hybrid_kv_cache_manager=True)}
# vLLM's CPU build picks its AMX MLA backend on a CPU with AMX, which takes only 16-bit weights
if "amx_tile" in open("/proc/cpuinfo").read():
    ENGINE_ARGS["deepseek-v3-mla"] = dict(dtype="bfloat16")


def folder_of(tmp_path_factory, name: str) -> str:
    d = str(tmp_path_factory.mktemp(name))
    family, fields = VARIANTS.get(name, (name, {}))
    zoo.build(family, **{**OVERRIDES.get(name, {}), **fields}).save_pretrained(d)
    return d


def generate(llm, tokens, salt=None):
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    conn = scheduler_connector(llm)
    before = conn.stats().get("loaded_tokens", 0)
    prompt = {"prompt_token_ids": list(tokens), **({"cache_salt": salt} if salt else {})}
    o = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    return list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)], \
        conn.stats().get("loaded_tokens", 0) - before


@pytest.mark.parametrize("family", SERVED)
def test_vllm_loads_give_the_tokens_of_recomputing(tmp_path_factory, family):
    from transformers import AutoModelForCausalLM

    close_local_pools()
    folder = folder_of(tmp_path_factory, family)
    pool = {**POOL, "pool": f"vzoo-{family}"}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = HFConnector(model, config={k: v for k, v in pool.items() if k != "breakeven_margin"},
                     breakeven=BreakEven(margin=0.0))
    shared = [int(t) for t in zoo.prompt(N, seed=1)[0]]
    assert hf.prefill(torch.tensor([shared])).saved_chunks == N // CHUNK
    llm = make_engine(folder, pool, enable_prefix_caching=False, max_model_len=1024, **ENGINE_ARGS.get(family, {}))
    try:
        assert len(scheduler_connector(llm).groups) == GROUPS.get(family, 1)
        spec = scheduler_connector(llm).spec
        assert spec.weights == hf.spec.weights and spec.weights.startswith("files:")
        own = [int(t) for t in zoo.prompt(N, seed=2)[0]]
        cold_tokens, cold_lps, cold_loaded = generate(llm, own)
        warm_tokens, warm_lps, warm_loaded = generate(llm, own)
        assert (cold_loaded, warm_loaded) == (0, N // CHUNK * CHUNK)
        assert warm_tokens == cold_tokens and warm_lps == cold_lps  # bit for bit
        ref_tokens, ref_lps, _ = generate(llm, shared, salt="recompute")  # nobody's secret: not cached, cold
        tokens, lps, loaded = generate(llm, shared)
        if model.config.architectures[0] in CROSS_ENGINE:
            assert spec.fingerprint() == hf.spec.fingerprint() and loaded == N // CHUNK * CHUNK
            assert tokens == ref_tokens
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= LOGPROB_TOL
        else:
            assert spec.engine == "vllm" and loaded == 0  # transformers' chunks are not vLLM's
    finally:
        shutdown_engine(llm)
        close_local_pools()


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_vllm_cannot_serve_through_the_pool_are_refused_at_start(tmp_path_factory, family):
    folder = folder_of(tmp_path_factory, family)
    with pytest.raises(UnsupportedModel, match=REFUSED[family]) as e:
        make_engine(folder, {**POOL, "pool": f"vzoo-{family}"}, enable_prefix_caching=False, max_model_len=1024,
                    **ENGINE_ARGS.get(family, {}))
    assert "without" in str(e.value)  # and it says what to do instead
    close_local_pools()


def test_sliding_window_chunks_are_saved_while_vllm_holds_their_blocks(tmp_path_factory):
    """Prefill in steps of one block (32 tokens) with a 96-token window: vLLM frees each block once
    it leaves the window, mid-prefill, so each chunk must be saved in the step that completes it.
    A second prompt sharing only the first two chunks then loads the window's tail out of them
    (tokens 32-127) and answers as recomputing does; so does the whole prompt (its tail only)."""
    close_local_pools()
    folder = folder_of(tmp_path_factory, "mistral-window96")
    llm = make_engine(folder, {**POOL, "pool": "vzoo-sliding-steps"}, enable_prefix_caching=False,
                      max_model_len=1024, max_num_batched_tokens=32, max_num_seqs=1)
    try:
        prompt = [int(t) for t in zoo.prompt(N, seed=5)[0]]
        cold = generate(llm, prompt)
        assert cold[2] == 0
        branch = prompt[: 2 * CHUNK] + [int(t) for t in zoo.prompt(N - 2 * CHUNK, seed=6)[0]]
        ref = generate(llm, branch, salt="recompute")  # nobody's secret: computed, not cached
        got = generate(llm, branch)
        assert got[2] == 2 * CHUNK and got[:2] == ref[:2]  # its two shared chunks loaded, the same answer
        again = generate(llm, prompt)
        assert again[2] == N // CHUNK * CHUNK and again[:2] == cold[:2]
    finally:
        shutdown_engine(llm)
        close_local_pools()


def test_a_failed_load_of_several_groups_is_recomputed_whole_and_reported_by_request(tmp_path_factory):
    """Gemma 2 in vLLM's three KV cache groups: its loads are asynchronous. A chunk corrupted after
    the lookup fails the load: the worker reports the request (``failed_recving``), never a block
    (vLLM refuses block-level failures with several groups), vLLM recomputes it whole with the cold
    answer, the scheduler does not ask the pool again for it, and the recompute saves the chunks
    again, so the next request loads them."""
    close_local_pools()
    folder = folder_of(tmp_path_factory, "gemma2")
    llm = make_engine(folder, {**POOL, "pool": "vzoo-gemma2-failed"}, enable_prefix_caching=False, max_model_len=1024)
    try:
        conn = scheduler_connector(llm)
        assert len(conn.groups) == 3 and conn.async_loads
        prompt = [int(t) for t in zoo.prompt(N, seed=8)[0]]
        cold = generate(llm, prompt)
        assert cold[2] == 0 and conn.counters.get("saved_chunks", 0) == N // CHUNK
        pool = conn.pool
        keys = pool.addresses("default", pool.keys("default", prompt[: N // CHUNK * CHUNK]))
        tier, page = pool.store.locate(keys[0][0])  # chunk 0's first head slice
        pool.store.slab(tier).page(page)[:64] ^= 0xFF
        worker = worker_connector().worker
        reported, failures = len(worker.failed_history), conn.counters.get("load_failures", 0)
        bad = generate(llm, prompt)
        assert bad[:2] == cold[:2] and bad[2] == 0  # recomputed: the cold answer, nothing loaded
        assert conn.counters.get("load_failures", 0) == failures + 1
        assert len(worker.failed_history) == reported  # reported by request, not by block
        again = generate(llm, prompt)  # the recompute saved every chunk again
        assert again[:2] == cold[:2] and again[2] == N // CHUNK * CHUNK
    finally:
        shutdown_engine(llm)
        close_local_pools()


def test_bench_ttft_measures_a_hybrid_model_with_the_allocator_on_and_off():
    """``kvpool bench ttft --engine vllm --model gemma2``: one tiny run through the CLI; with vLLM's
    hybrid allocator on (two groups, asynchronous loads) and off (one group), the pool hit loads
    every whole chunk and answers as recomputing does."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "ttft", "--engine", "vllm", "--model", "gemma2",
                        "--context", "600", "--repeats", "1", "--json"], cwd=repo, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    rows = json.loads(r.stdout)
    assert [(x["hybrid_allocator"], x["kv_cache_groups"]) for x in rows] == [("hybrid", 2), ("off", 1)]
    for x in rows:
        assert x["same_output"] and x["loaded_tokens"] == 512 and x["cold_ttft_s"] > 0 < x["warm_ttft_s"], x
