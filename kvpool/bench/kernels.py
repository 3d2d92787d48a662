"""``kvpool bench kernels``: the local kernels against their floors, in one run.

- gather/scatter between a vLLM-layout paged cache and 256-token pool chunks, beside a plain
  ``torch`` copy of the same bytes on the same device (the floor: a paged copy cannot beat it);
- quantize/dequantize throughput of each storage format (GB/s of raw KV in);
- eviction scoring time of each method at 32K context (the last 64 queries scoring every key).

On a GPU the Triton kernels run; on a CPU their PyTorch references (the interpreter is for
tests), with a smaller model so the whole run stays well under five minutes.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from kvpool.progress import Progress


def _timer(device: torch.device):
    def timed(fn, reps: int) -> float:
        fn()  # warm-up (and Triton compilation)
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return timed


def run(device: str | None = None, context: int = 32768, reps: int = 5, progress: bool = True) -> dict:
    from kvpool.kernels import dequantize, gather, quantize, scatter, score, vllm_layout
    from kvpool.kernels.quant import FORMATS
    from kvpool.kernels.scoring import METHODS

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    impl = "triton" if gpu else "torch"
    timed = _timer(dev)
    # Llama-3-8B's KV on a GPU (32 MiB chunks in bf16); a quarter of its layers on a CPU.
    layers, heads, dim, block, chunk = (32 if gpu else 8), 8, 128, 16, 256
    dtype = torch.bfloat16 if gpu else torch.float32
    num_blocks = 4096 if gpu else 512
    steps = 3 + len(FORMATS) + len(METHODS)
    out: dict = {"device": str(dev) if not gpu else torch.cuda.get_device_name(dev), "impl": impl,
                 "layers": layers, "kv_heads": heads, "head_dim": dim, "dtype": str(dtype).removeprefix("torch."),
                 "chunk_tokens": chunk, "block_size": block}
    with Progress(steps, "bench kernels", enabled=progress) as bar:
        layout = vllm_layout("gpu" if gpu else "cpu")
        cache = [torch.randn(num_blocks, heads, block, 2 * dim, device=dev).to(dtype) for _ in range(layers)]
        g = torch.Generator().manual_seed(0)
        blocks = torch.randperm(num_blocks, generator=g)[: chunk // block]
        slots = (blocks[:, None] * block + torch.arange(block)).reshape(-1).to(dev)
        dst = torch.empty(layers, 2, chunk, heads, dim, device=dev, dtype=dtype)
        src = torch.empty_like(dst).copy_(dst)
        nbytes = dst.numel() * dst.element_size()
        t_copy = timed(lambda: dst.copy_(src), reps * 4)
        bar.advance()
        t_gather = timed(partial(gather, cache, slots, layout, out=dst, impl=impl), reps * 4)
        bar.advance()
        t_scatter = timed(partial(scatter, src, cache, slots, layout, impl=impl), reps * 4)
        bar.advance()
        out |= {"chunk_bytes": nbytes, "copy_gbps": nbytes / t_copy / 1e9,
                "gather_gbps": nbytes / t_gather / 1e9, "scatter_gbps": nbytes / t_scatter / 1e9,
                "gather_vs_copy": t_copy / t_gather, "scatter_vs_copy": t_copy / t_scatter}
        del cache
        quant = {}
        for fmt in FORMATS:
            q = quantize(dst, fmt, impl=impl, **({"residual": 0} if "kivi" in fmt else {}))
            tq = timed(partial(quantize, dst, fmt, impl=impl, **({"residual": 0} if "kivi" in fmt else {})), reps)
            td = timed(partial(dequantize, q, impl=impl), reps)
            quant[fmt] = {"quantize_gbps": nbytes / tq / 1e9, "dequantize_gbps": nbytes / td / 1e9,
                          "ratio": nbytes / q.nbytes}
            bar.advance()
        out["quant"] = quant
        hq, window = 32, 64
        qs = torch.randn(1, hq, window, dim, device=dev, dtype=dtype)
        ks = torch.randn(1, heads, context, dim, device=dev, dtype=dtype)
        scoring = {}
        for m in METHODS:
            params = {"layer": 0, "num_layers": 32} if m == "pyramidkv" else {}
            scoring[m] = timed(partial(score, m, qs, ks, impl=impl, **params), max(2, reps // 2)) * 1e3
            bar.advance()
        out["score_ms"] = scoring
        out["context"] = context
    return out


def format_table(r: dict) -> str:
    lines = [f"{r['device']} ({r['impl']}); {r['layers']} layers x {r['kv_heads']} KV heads x {r['head_dim']}, "
             f"{r['dtype']}, {r['chunk_tokens']}-token chunks ({r['chunk_bytes'] >> 20} MiB), block size {r['block_size']}",
             f"{'paged copy':<28}{'GB/s':>8}{'vs copy':>9}",
             f"{'plain torch copy (floor)':<28}{r['copy_gbps']:>8.2f}",
             f"{'gather (cache -> chunk)':<28}{r['gather_gbps']:>8.2f}{r['gather_vs_copy']:>9.2f}",
             f"{'scatter (chunk -> cache)':<28}{r['scatter_gbps']:>8.2f}{r['scatter_vs_copy']:>9.2f}",
             "",
             f"{'format':<12}{'quant GB/s':>12}{'dequant GB/s':>14}{'ratio':>8}"]
    for fmt, q in r["quant"].items():
        lines.append(f"{fmt:<12}{q['quantize_gbps']:>12.2f}{q['dequantize_gbps']:>14.2f}{q['ratio']:>8.2f}")
    lines += ["", f"scoring at {r['context']} tokens (64 queries, 32 query heads):"]
    lines += [f"  {m:<14}{ms:>9.2f} ms" for m, ms in r["score_ms"].items()]
    return "\n".join(lines)
