"""``kvpool bench ttft``: time to first token with and without the pool, same run, same prompt.

- ``hf``: a random-weight Llama (8 layers, hidden 512, 8 heads over 4 KV heads, fp32) through the
  transformers connector on an in-process pool. Cold: the whole prompt computed; warm: the prefix
  loaded from the pool (all whole chunks but the last, which holds the token whose logits are
  needed) and the rest computed. ``same_output``: the greedy tokens of both runs are identical.
  ``backend="node"``: the pool runs outside this process (a Ray head and ``kvpool up``, started
  by :class:`kvpool.connectors.bench.node_pool_proc.NodePool`) and the connector reaches it through
  a NodeClient, as an engine on a cluster does.
- ``vllm``: delegated to ``kvpool.connectors.bench.vllm_engine`` (run it with the engines' virtualenv).
- ``vllm-server``: vLLM's OpenAI server, the pool on the node path (and the in-process pool for
  comparison): :mod:`kvpool.connectors.bench.vllm_server`.

``model="smollm2"``: the same on the real model, SmolLM2-135M-Instruct, with real English prompts
and their greedy answers compared (:mod:`kvpool.connectors.bench.ttft_real`).
"""

from __future__ import annotations

import itertools
import os
import statistics

import torch

from kvpool.errors import BadRequest
from kvpool.progress import Progress


def bench_model():
    from kvpool.connectors.hf_model import tiny_llama

    return tiny_llama(0, layers=8, hidden=512, heads=8, kv_heads=4, vocab=4096)


def small_qwen2():
    """A random-weight Qwen2 in a small shape measured through vLLM's server: 5 layers, hidden
    768, 12 heads over 3 KV heads (head dim 64: 7.5 KiB of fp32 KV per token, against the
    benchmark Llama's 16 KiB). MLP width and vocabulary (not part of the shape measured): 4 x hidden, and the
    benchmark's 4,096 tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=4096, hidden_size=768, intermediate_size=4 * 768, num_hidden_layers=5,
                      num_attention_heads=12, num_key_value_heads=3, max_position_embeddings=32768,
                      initializer_range=0.2, tie_word_embeddings=False, use_sliding_window=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def hybrid_model():
    """A random-weight Gemma 2 in the benchmark Llama's shape (8 layers, hidden 512, 8 heads over 4
    KV heads of 64), sliding (window 1,024) and full layers alternating: vLLM's hybrid allocator
    pages it as a full-attention group and a sliding-window group."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64,
                       sliding_window=1024, max_position_embeddings=32768, initializer_range=0.2,
                       tie_word_embeddings=True)  # vLLM's Gemma ties them
    torch.manual_seed(0)
    return Gemma2ForCausalLM(cfg).eval()


STATE_MODELS = ("mamba2", "qwen3-next")


def state_model(name: str):
    """A random-weight model with recurrent layers, fp32, whose state the pool stores
    (kvpool.connectors.hf_state): ``mamba2`` (8 Mamba-2 layers, hidden 512, 16 heads of 64, state
    64, scan chunk 256) or ``qwen3-next`` (8 layers, gated DeltaNet and attention alternating,
    hidden 512; attention 8 heads over 2 KV heads of 64; 4 experts of 256)."""
    import transformers

    common = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, initializer_range=0.2,
                  tie_word_embeddings=False)
    if name == "mamba2":
        cfg = transformers.Mamba2Config(**common, state_size=64, num_heads=16, head_dim=64, expand=2, n_groups=1,
                                        conv_kernel=4, chunk_size=256)
    else:
        cfg = transformers.Qwen3NextConfig(**common, intermediate_size=1024, num_attention_heads=8,
                                           num_key_value_heads=2, head_dim=64, linear_num_value_heads=8,
                                           linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                                           linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                           full_attention_interval=2, max_position_embeddings=32768)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _random_prompts(contexts: list[int]) -> list[torch.Tensor]:
    return [torch.randint(0, 4096, (1, ctx), generator=torch.Generator().manual_seed(i))
            for i, ctx in enumerate(contexts)]


def run_hf(contexts: list[int], new_tokens: int = 4, progress: bool = True, chunk_tokens: int = 256,
           backend: str = "local", model: str = "random") -> list[dict]:
    from kvpool.connectors.hf import HFConnector
    from kvpool.connectors.hf_model import model_spec
    from kvpool.connectors.pools import local_pool
    from kvpool.tenants import Tenant, TenantRegistry

    # NOTE: random weights drive softmax and norms into denormal floats, which x86 handles ~3.5x
    # slower (measured: a 256-token forward 2.26 s -> 0.64 s); flushing them to zero is what
    # inference servers run with, and it applies to the cold and the warm runs alike.
    torch.set_flush_denormal(True)
    if model == "smollm2":
        from kvpool.connectors.bench import ttft_real as real
        from kvpool.connectors.demo import smollm2

        sizes = real.fit(contexts)
        m = smollm2.load()[0]
        prompts = [torch.tensor([p]) for p in real.prompts([n for _, n in sizes])]
        model_id, new_tokens = smollm2.MODEL_ID, real.ANSWER_TOKENS
    elif model in STATE_MODELS:
        m, prompts, model_id, sizes = state_model(model), _random_prompts(contexts), f"kvpool/bench-{model}", None
    else:
        m, prompts, model_id, sizes = bench_model(), _random_prompts(contexts), "kvpool/bench-llama", None
    spec = model_spec(m, model_id=model_id, chunk_tokens=chunk_tokens)
    chunks = sum(p.shape[1] // chunk_tokens + 1 for p in prompts)
    node = pool = None
    if backend == "node":
        from kvpool.connectors.bench.node_pool_proc import NodePool
        from kvpool.connectors.pools import open_pool

        heads = spec.num_kv_heads  # the pool stores a slice per KV head (kvpool.slices)
        node = NodePool(spec.chunk_nbytes // heads, (chunks + 8) * heads, progress)
    try:
        if node is not None:
            node.start()
            pool = open_pool(spec, node.connector_config())
            conn = HFConnector(m, pool, tenant=node.credential)  # a secured pool: the tenant's credential
        else:
            pool = local_pool(spec, TenantRegistry([Tenant("bench")]), chunks)
            conn = HFConnector(m, pool, tenant="bench")
        rows = _measure_hf(conn, prompts, new_tokens, progress, backend, reps_upto=0 if sizes else 4096)
        for r, (asked, _) in zip(rows, sizes or ()):  # the real model: its answers, in words
            r.update(model="smollm2", asked_context=asked, answer=real.answer_text(r["answer_tokens"]))
        return rows
    finally:
        if node is not None:
            node.close()
        elif pool is not None:
            pool.store.close()


def _measure_hf(conn, prompts: list[torch.Tensor], new_tokens: int, progress: bool, backend: str,
                reps_upto: int = 4096) -> list[dict]:
    """Per prompt: cold (no pool) and warm (its prefix loaded from the pool), each the median of 3
    runs when the prompt has at most ``reps_upto`` tokens, else of one."""
    rows = []
    conn.generate(prompts[0][:, :512], 2, use_pool=False)  # warm-up (first-call set-up): not counted
    with Progress(len(prompts), "bench ttft (hf)", enabled=progress) as bar:
        for ids in prompts:
            ctx = ids.shape[1]
            reps = 3 if ctx <= reps_upto else 1
            cold_s, warm_s, cold_tok, warm_tok, loaded = [], [], None, None, 0
            for _ in range(reps):
                cold_tok, cold = conn.generate(ids, new_tokens, use_pool=False)
                cold_s.append(cold.seconds)
            fill = conn.prefill(ids)  # fills the pool (a first request would; with recurrent layers chunk by chunk)
            for _ in range(reps):
                warm_tok, warm = conn.generate(ids, new_tokens)
                warm_s.append(warm.seconds)
                loaded = warm.loaded_tokens
            c, w = statistics.median(cold_s), statistics.median(warm_s)
            rows.append({"engine": "hf", "backend": backend, "context": ctx, "cold_ttft_s": c, "warm_ttft_s": w,
                         "speedup": c / w, "loaded_tokens": loaded, "same_output": cold_tok == warm_tok,
                         "cold_runs_s": cold_s, "warm_runs_s": warm_s, "answer_tokens": cold_tok,
                         "fill_s": fill.seconds, "fill_vs_cold": fill.seconds / c, "chunk_bytes": conn.spec.chunk_nbytes,
                         "stored_bytes_per_token": conn.spec.chunk_nbytes / conn.spec.chunk_tokens})
            bar.advance(note=f"{ctx} tokens")
    return rows


def run_vllm(vllm_bench, contexts: list[int], progress: bool, repeats: int | None = None,
             model: str = "random") -> list[dict]:
    """The same random Llama as the transformers rows, saved for vLLM (or ``model="smollm2"``: the
    real model's checkpoint and prompts, or ``"gemma2"``: :func:`hybrid_model`, measured with vLLM's
    hybrid allocator on and again with it off, where vLLM pages every layer in one group); per
    context: cold, the pool hit in a fresh engine and vLLM's own prefix-cache hit in that same
    engine (medians of ``repeats``: default 5 up to 4K tokens, 1 above)."""
    import tempfile

    import numpy as np

    torch.set_flush_denormal(True)
    # NOTE: vLLM's CPU backend reserves most of the machine's memory for its KV cache unless told
    # otherwise; 2 GiB holds the 16K context of the benchmark model (64 KiB per token).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpool-ttft-") as d:
        if model == "smollm2":
            from kvpool.connectors.bench import ttft_real as real
            from kvpool.connectors.demo import smollm2

            sizes = real.fit(contexts, answer_tokens=1)
            prompts, d, max_len = real.prompts([n for _, n in sizes]), str(smollm2.checkpoint()), real.max_positions()
        else:
            sizes, max_len = [(c, c) for c in contexts], None
            (hybrid_model() if model == "gemma2" else bench_model()).save_pretrained(d)
            prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 4096, ctx)] for i, ctx in enumerate(contexts)]
        allocators = {"hybrid": {}, "off": {"disable_hybrid_kv_cache_manager": True}} if model == "gemma2" else {None: {}}
        with Progress(len(contexts) * len(allocators), "bench ttft (vllm)", enabled=progress) as bar:
            for ((asked, ctx), tokens), (allocator, engine_args) in itertools.product(zip(sizes, prompts),
                                                                                     allocators.items()):
                reps = repeats if repeats is not None else 5 if ctx <= 4096 else 1
                r = vllm_bench.measure_ttft(tokens, d, repeats=reps, max_model_len=max_len or max(2048, ctx + 64),
                                            **engine_args)
                rows.append({"engine": "vllm", "context": ctx, "repeats": reps, "protocol": r["protocol"],
                             "cold_ttft_s": r["cold_ttft_s"],
                             "warm_ttft_s": r["warm_ttft_s"], "native_hit_ttft_s": r["native_hit_ttft_s"],
                             "speedup": r["cold_ttft_s"] / r["warm_ttft_s"], "warm_vs_native": r["warm_vs_native"],
                             **{f"{k}_runs_s": r[f"{k}_runs_s"] for k in ("cold", "warm", "native")},
                             "loaded_tokens": r["warm_loaded_tokens"], "same_output": r["same_output"],
                             "logprob_max_diff": r["logprob_max_diff"],
                             "pool_vs_native_logprob_diff": r["pool_vs_native_logprob_diff"],
                             "warm_load_s": r["warm_load_s"], "warm_load_pool_s": r["warm_load_pool_s"]})
                if model == "smollm2":
                    rows[-1].update(model="smollm2", asked_context=asked, answer_tokens=r["cold_tokens"],
                                    answer=real.answer_text(r["cold_tokens"]))
                if allocator is not None:
                    rows[-1].update(model=model, hybrid_allocator=allocator, kv_cache_groups=r["kv_cache_groups"])
                bar.advance(note=f"{ctx} tokens" + (f", hybrid allocator {allocator}" if allocator else ""))
    return rows


def run(engine: str, contexts: list[int], progress: bool = True, backend: str | None = None,
        repeats: int | None = None, compare_local: bool = True, model: str = "random") -> list[dict] | dict:
    if model not in ("random", "smollm2", "qwen2", "gemma2", *STATE_MODELS):
        raise BadRequest(f"--model {model!r}: choose random (the random-weight benchmark Llama), qwen2, smollm2, "
                         f"gemma2, {' or '.join(STATE_MODELS)}")
    if model == "gemma2" and engine != "vllm":
        raise BadRequest("--model gemma2 (vLLM's hybrid allocator, on and off) is measured with --engine vllm only")
    if model in STATE_MODELS and engine != "hf":
        raise BadRequest(f"--model {model} (recurrent state in the pool) is measured with --engine hf only")
    if model == "qwen2" and engine != "vllm-server":
        raise BadRequest("--model qwen2 (the small Qwen2 shape) is measured with --engine vllm-server only")
    if engine == "hf":
        if backend not in (None, "local", "node"):
            raise BadRequest(f"--backend {backend!r}: the transformers benchmark runs local or node")
        return run_hf(contexts, progress=progress, backend=backend or "local", model=model)
    if engine == "vllm-server" and model == "smollm2":
        if repeats is not None:
            raise BadRequest("--repeats is the random-weight server benchmark's; with --model smollm2 each context "
                             "is measured once per run: run the command again for more")
        _need_vllm(engine)
        from kvpool.connectors.bench import ttft_real as bench_ttft_real

        return bench_ttft_real.run_server(contexts, backend or "node", progress=progress)
    if engine == "vllm-server":
        _need_vllm(engine)
        from kvpool.connectors.bench import vllm_server as vllm_server_bench

        if len(contexts) != 1:
            raise BadRequest("--engine vllm-server measures one --context (e.g. 4096)")
        backend = backend or "node"
        if backend not in ("node", "local"):
            raise BadRequest(f"--backend {backend!r}: the server benchmark runs node or local")
        backends = (backend, "local") if backend == "node" and compare_local else (backend,)
        return vllm_server_bench.run(contexts[0], repeats or 5, backends, progress=progress,
                                     model="qwen2" if model == "qwen2" else "random")
    if backend not in (None, "local"):
        raise BadRequest(f"--backend {backend!r}: --engine vllm runs its in-process pool (local) only")
    if engine == "vllm":
        try:
            from kvpool.connectors.bench import vllm_engine as vllm_bench
        except ImportError as e:
            raise BadRequest(f"vLLM is not importable here ({e}): run `.venv-engines/bin/kvpool bench ttft "
                             "--engine vllm` (make engines builds that virtualenv)") from None
        return run_vllm(vllm_bench, contexts, progress, repeats=repeats, model=model)
    raise BadRequest(f"engine {engine!r}: choose hf, vllm or vllm-server")


def _need_vllm(engine: str) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise BadRequest(f"vLLM is not importable here ({e}): run `.venv-engines/bin/kvpool bench ttft "
                         f"--engine {engine}` (make engines builds that virtualenv)") from None


def format_table(rows: list[dict] | dict) -> str:
    if isinstance(rows, dict):  # vllm-server
        from kvpool.connectors.bench import vllm_server as vllm_server_bench

        return vllm_server_bench.format_table(rows)
    if rows and rows[0].get("model") == "smollm2":
        from kvpool.connectors.bench import ttft_real as bench_ttft_real

        return bench_ttft_real.format_table(rows)
    lines = [f"{'engine':<7}{'context':>8}{'cold s':>9}{'warm s':>9}{'speed-up':>10}{'native hit s':>14}"
             f"{'warm/native':>13}  same output"]
    for r in rows:
        native = r.get("native_hit_ttft_s")
        ratio = r.get("warm_vs_native")
        lines.append(f"{r['engine']:<7}{r['context']:>8}{r['cold_ttft_s']:>9.3f}{r['warm_ttft_s']:>9.3f}"
                     f"{r['cold_ttft_s'] / r['warm_ttft_s']:>9.1f}x{'' if native is None else f'{native:.3f}':>14}"
                     f"{'' if ratio is None else f'{ratio:.2f}x':>13}  {r['same_output']}")
        if "hybrid_allocator" in r:
            lines.append(f"        vLLM's hybrid allocator {r['hybrid_allocator']}: {r['kv_cache_groups']} KV cache "
                         f"group(s), {r['loaded_tokens']} tokens loaded")
        if "fill_s" in r:
            lines.append(f"        the saving prefill {r['fill_s']:.3f} s ({r['fill_vs_cold']:.2f}x cold); "
                         f"{r['chunk_bytes'] / 2**20:.2f} MiB a chunk, {r['stored_bytes_per_token'] / 1024:.1f} KiB a token")
        if native is not None:
            lines.append("        runs (s): " + "; ".join(
                f"{k} {min(r[f'{k}_runs_s']):.3f}-{max(r[f'{k}_runs_s']):.3f}" for k in ("cold", "warm", "native")
                if r.get(f"{k}_runs_s")))
    return "\n".join(lines)
