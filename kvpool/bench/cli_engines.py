"""``kvpool bench`` commands that run engines (transformers, vLLM, its server) or their checkpoints:
ttft, route, pool-modes, weights, importance, sliding, quality. Each imports its benchmark when it runs."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvpool.errors import BadRequest
from kvpool.jsonout import show


def _bench_ttft(args: argparse.Namespace) -> int:
    from kvpool.connectors.bench import ttft as bench_ttft

    real = args.model == "smollm2"
    default = "1024,4096,8192" if real else "4096" if args.engine == "vllm-server" else "1024,4096,16384"
    try:
        contexts = [int(c) for c in (args.context or default).split(",")]
    except ValueError:
        raise BadRequest(f"--context {args.context!r}: give token counts, e.g. 1024,4096") from None
    kw = dict(backend=args.backend, repeats=args.repeats, compare_local=args.compare_local, model=args.model)
    rows = bench_ttft.run(args.engine, contexts, progress=True, **kw)  # progress: on stderr
    show(args, rows, bench_ttft.format_table)
    if real:
        from kvpool.connectors.bench import ttft_real as bench_ttft_real

        why = bench_ttft_real.failures(rows)
    elif args.engine == "vllm-server":
        from kvpool.connectors.bench import vllm_server as vllm_server_bench

        why = vllm_server_bench.failures(rows)
    else:
        why = []
    for w in why:
        print(f"bench ttft: {w}", file=sys.stderr)
    return 1 if why else 0


def _bench_route(args: argparse.Namespace) -> int:
    from kvpool.connectors.bench import route, route_measure

    result = route.run(args.runs, args.tenants, args.conversations, args.turns, args.system_tokens, args.user_tokens,
                       args.answer_tokens, args.model, progress=True)  # progress: on stderr
    show(args, result, route_measure.format_table)
    if not result["ok"]:
        print("bench route: the two arms' answers differ", file=sys.stderr)
        return 1
    return 0


def _bench_pool_modes(args: argparse.Namespace) -> int:
    from kvpool.connectors.bench import pool_modes

    result = pool_modes.run(args.context, args.repeats, progress=True)  # progress: on stderr
    show(args, result, pool_modes.format_table)
    for why in pool_modes.failures(result):
        print(f"bench pool-modes: {why}", file=sys.stderr)
    return 1 if pool_modes.failures(result) else 0


def _bench_weights(args: argparse.Namespace) -> int:
    from kvpool.connectors.bench import weights as bench_weights

    try:
        result = bench_weights.run(args.size_gib, args.rounds, args.dir, progress=not args.json)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    show(args, result, bench_weights.format_table)
    return 0


def _bench_importance(args: argparse.Namespace) -> int:
    from kvpool.connectors.bench import importance as bench_importance

    result = bench_importance.run(model_name=args.model, docs=args.docs, hot=args.hot, doc_tokens=args.doc_tokens,
                                  capacity=args.capacity, requests=args.requests, seeds=args.seeds,
                                  progress=not args.json)
    show(args, result, bench_importance.format_table)
    return 0


def _bench_sliding(args: argparse.Namespace) -> int:
    from kvpool.connectors.bench import sliding as bench_sliding

    rows = bench_sliding.run(args.context, args.rounds, progress=not args.json)
    show(args, rows, bench_sliding.format_table)
    return 0


def _bench_quality(args: argparse.Namespace) -> int:
    from kvpool.connectors.bench import quality as bq

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(n for n in text.split(",") if n and n != "none")

    try:
        budgets = tuple(float(b) for b in args.budgets.split(",") if b) if args.budgets else None
    except ValueError:
        raise BadRequest(f"--budgets {args.budgets!r}: give fractions of the context, e.g. 0.5,0.25") from None
    base = bq.QUICK if args.quick else bq.Settings()
    given = {"context": args.context, "scored": args.scored, "greedy": args.greedy, "prompts": args.prompts,
             "chunk_tokens": args.chunk_tokens, "formats": names(args.formats), "budgets": budgets,
             "threads": args.threads}
    settings = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None},
                                   methods=names(args.methods))
    result = bq.run(settings, progress=True)
    show(args, result, bq.format_table)
    if args.plot:
        print(f"bench quality: plot written to {bq.plot(result, args.plot)}", file=sys.stderr)
    return 0


def add_engine_benches(bsub) -> None:
    """Adds the engines' benchmarks to ``kvpool bench``'s subcommands."""
    bt = bsub.add_parser("ttft", help="time to first token with and without the pool (same prompt, same run)")
    bt.add_argument("--engine", choices=["hf", "vllm", "vllm-server"], default="hf",
                    help="vllm-server: vLLM's OpenAI server, cold vs its own prefix-cache hit vs a pool hit")
    bt.add_argument("--model", choices=["random", "qwen2", "smollm2", "gemma2", "mamba2", "qwen3-next"], default="random",
                    help="random: a random-weight Llama (exactness); qwen2 (vllm-server): a random-weight Qwen2 "
                    "a small Qwen2 shape (5 layers, hidden 768, 12 heads over 3 KV heads); smollm2: the real SmolLM2-135M-Instruct on "
                    "real English prompts, its answers with and without the pool compared; gemma2 (vllm): a "
                    "random-weight Gemma 2 (sliding and full layers) with vLLM's hybrid allocator on, then off; "
                    "mamba2, qwen3-next (hf): random-weight models with recurrent layers, their state stored in "
                    "the chunks")
    bt.add_argument("--context", default=None, help="prompt lengths in tokens, comma-separated (default "
                    "1024,4096,16384; vllm-server: one, default 4096; smollm2: 1024,4096,8192, the last measured "
                    "at 8192 minus the answer)")
    bt.add_argument("--backend", choices=["local", "node"], default=None,
                    help="the pool: local (in-process) or node (a pool started outside the engine, reached "
                    "through the node's shard); default: node for vllm-server, local otherwise")
    bt.add_argument("--repeats", type=int, default=None, help="vllm and vllm-server: repetitions of each case, medians "
                    "and ranges (default 5; vllm: 1 above 4K tokens)")
    bt.add_argument("--compare-local", action=argparse.BooleanOptionalAction, default=True,
                    help="vllm-server with --backend node: also the in-process pool, in the same run")
    bt.set_defaults(func=_bench_ttft)
    br = bsub.add_parser("route", help="kvpool route through two vLLM servers on a two-node pool: tier-aware vs "
                         "round-robin in the same run (TTFT, tokens from the same node, answers equal)")
    br.add_argument("--runs", type=int, default=5, help="runs, a fresh workload each (default 5): medians and ranges")
    br.add_argument("--tenants", type=int, default=3, help="tenants an arm (default 3)")
    br.add_argument("--conversations", type=int, default=2, help="conversations a tenant (default 2)")
    br.add_argument("--turns", type=int, default=4, help="turns a conversation (default 4)")
    br.add_argument("--system-tokens", type=int, default=1024, help="a tenant's system prompt (default 1024)")
    br.add_argument("--user-tokens", type=int, default=64, help="a user turn (default 64)")
    br.add_argument("--answer-tokens", type=int, default=32, help="an answer, greedy (default 32)")
    br.add_argument("--model", choices=["random", "tiny"], default="random",
                    help="random: the benchmark Llama (8 layers, 16 KiB of KV a token); tiny: the tests' 2-layer one")
    br.set_defaults(func=_bench_route)
    bm = bsub.add_parser("pool-modes", help="the single-node pool (one process, no Ray) beside the pool on a local "
                         "Ray head: processes, memory, start, kvpool stats, TTFT of a restart hit through vLLM's server")
    bm.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    bm.add_argument("--repeats", type=int, default=5, help="prompts, medians and ranges over them (default 5)")
    bm.set_defaults(func=_bench_pool_modes)
    bw = bsub.add_parser("weights", help="cost of keying a model by its checkpoint (the files fingerprint and the "
                         "sample of the loaded tensors): first start and later ones, beside a plain read")
    bw.add_argument("--size-gib", type=float, default=16.0, help="size of the simulated checkpoint")
    bw.add_argument("--rounds", type=int, default=3)
    bw.add_argument("--dir", default=None, help="where to write it (default /var/tmp)")
    bw.set_defaults(func=_bench_weights)
    bl = bsub.add_parser("sliding", help="what keeping every layer's KV costs sliding-window models (transformers)")
    bl.add_argument("--context", type=int, default=8192)
    bl.add_argument("--rounds", type=int, default=3)
    bl.set_defaults(func=_bench_sliding)
    bm = bsub.add_parser("importance", help="the importance policy fed the real model's attention mass vs adaptive "
                         "and lru: hit rate on long documents with a few hot ones")
    bm.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny (random weights: a smoke test)")
    bm.add_argument("--docs", type=int, default=11)
    bm.add_argument("--hot", type=int, default=3)
    bm.add_argument("--doc-tokens", type=int, default=512)
    bm.add_argument("--capacity", type=int, default=64, help="pool size in chunks (32 tokens each)")
    bm.add_argument("--requests", type=int, default=300)
    bm.add_argument("--seeds", type=int, default=3)
    bm.set_defaults(func=_bench_importance)
    bq = bsub.add_parser("quality", help="the lossy storage formats and token eviction against the model's own KV, "
                         "on the real model (SmolLM2-135M) and real text: bytes, perplexity, KL, greedy tokens")
    bq.add_argument("--context", type=int, default=None, help="context tokens per passage (default 1024)")
    bq.add_argument("--scored", type=int, default=None, help="continuation tokens scored (default 128)")
    bq.add_argument("--greedy", type=int, default=None, help="greedy tokens compared (default 64)")
    bq.add_argument("--prompts", type=int, default=None, help="passages (default 3)")
    bq.add_argument("--chunk-tokens", type=int, default=None, help="the pool's chunk (default 256)")
    bq.add_argument("--formats", default=None, help="comma-separated (default fp8,int8,int4-kivi,int2-kivi; "
                    "none for none)")
    bq.add_argument("--methods", default=None, help="eviction methods, comma-separated (default all; none for none)")
    bq.add_argument("--budgets", default=None, help="eviction budgets as fractions of the context (default "
                    "0.5,0.25,0.125)")
    bq.add_argument("--threads", type=int, default=None, help="torch threads (default 1: on a shared machine one "
                    "thread decoded several times faster than two)")
    bq.add_argument("--quick", action="store_true", help="tiny settings (one short passage), for a smoke test")
    bq.add_argument("--plot", nargs="?", const="docs/quality.png", default=None,
                    help="write the plot (PNG) there (default docs/quality.png)")
    bq.set_defaults(func=_bench_quality)
