"""The engine checks for a machine with an NVIDIA GPU and the official engines installed (CI has
neither): ``python -m kvpool.connectors.bench.gpu_check vllm|sglang``.

- ``vllm``: the official vLLM (CUDA) with the kvpool connector on a random tiny Llama: a second
  run of the same prompt in a fresh engine loads its prefix from the pool (the connector reports
  the matched tokens) and yields the cold run's tokens and log-probs; then the TTFT table of
  ``kvpool bench ttft --engine vllm`` for 1K/4K/16K.
- ``sglang``: SGLang's real server (``sglang.launch_server``) with kvpool as its HiCache storage
  backend on a pool the check starts, the same prompt across a server restart: the answer is the
  same and its prefix comes from kvpool (:mod:`kvpool.connectors.bench.gpu_check_sglang`; ``--dry-run``
  prints the commands, ``--python`` names SGLang's interpreter).

Without a GPU either mode says so and exits with 2.

NOTE: prepared, not yet run: no GPU machine has been lent to this project's tasks so far.
"""

from __future__ import annotations

import json
import sys
import tempfile

USAGE = "usage: python -m kvpool.connectors.bench.gpu_check vllm|sglang [sglang options: --dry-run, --python PATH]"


def check_vllm(argv: list[str]) -> int:
    import torch

    if argv:
        print(f"the vllm check takes no options, got {argv}; {USAGE}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"vLLM GPU check not run: torch {torch.__version__} sees no CUDA GPU here; run it on a machine with an "
              "NVIDIA GPU and the official vLLM (.ci/gpu-check)", file=sys.stderr)
        return 2
    import numpy as np

    from kvpool.connectors.bench import ttft as bench_ttft
    from kvpool.connectors.bench import vllm_engine as vllm_bench

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


def check_sglang(argv: list[str]) -> int:
    from kvpool.connectors.bench import gpu_check_sglang

    return gpu_check_sglang.main(argv)


def main(argv: list[str]) -> int:
    checks = {"vllm": check_vllm, "sglang": check_sglang}
    if not argv or argv[0] not in checks:
        print(USAGE, file=sys.stderr)
        return 2
    return checks[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
