"""The engine checks for a machine with an NVIDIA GPU and the official engines installed (CI has
neither): ``python -m kvpool.connectors.gpu_check vllm|sglang``.

- ``vllm``: the official vLLM (CUDA) with the kvpool connector on a random tiny Llama: a second
  run of the same prompt in a fresh engine loads its prefix from the pool (the connector reports
  the matched tokens) and yields the cold run's tokens and log-probs; then the TTFT table of
  ``kvpool bench ttft --engine vllm`` for 1K/4K/16K.
- ``sglang``: prints the command that serves the same model with kvpool as SGLang's HiCache
  storage backend, and the two requests that show a storage hit (SGLang's server has to run in
  its own process, so this check guides it rather than running it).

NOTE: prepared, not yet run: no GPU machine has been lent to this project's tasks so far.
"""

from __future__ import annotations

import json
import sys
import tempfile


def check_vllm() -> int:
    import numpy as np
    import torch

    from kvpool.connectors import bench_ttft, vllm_bench

    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 4096, 1000)]
    with tempfile.TemporaryDirectory(prefix="kvpool-gpu-") as d:
        bench_ttft.bench_model().to(torch.float16).save_pretrained(d)
        r = vllm_bench.measure_ttft(tokens, d, dtype="float16", block_size=16, repeats=3)
    print(json.dumps({k: v for k, v in r.items() if not k.endswith("_runs_s")}, indent=2, default=str))
    ok = r["same_output"] and r["warm_loaded_tokens"] > 0
    rows = bench_ttft.run("vllm", [1024, 4096, 16384], progress=False)
    print(bench_ttft.format_table(rows))
    print("vLLM GPU check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


def check_sglang() -> int:
    extra = {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang", "class_name": "KVPoolStorage",
             "dram_mib": 4096}
    print("Serve (GPU, official SGLang installed), with a small local model directory MODEL:")
    print("  python -m sglang.launch_server --model-path MODEL --page-size 64 --enable-hierarchical-cache \\\n"
          "    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "
          f"'{json.dumps(extra)}'")
    print("Then send the same long prompt twice with the device and host caches flushed in between\n"
          "(POST /flush_cache); the second response's cached tokens come from kvpool (the server's\n"
          "storage hit metrics rise) and its output tokens equal the first's.")
    return 0


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    sys.exit({"vllm": check_vllm, "sglang": check_sglang}[which]())
