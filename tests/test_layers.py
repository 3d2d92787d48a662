"""The layering rule: the core (``kvpool/``) imports neither Ray nor an engine; ``kernels`` is pure
torch. Entry points that dispatch upward (the CLI, the cluster benchmark) import lazily."""

import subprocess
import sys

CORE = ["kvpool", "kvpool.store", "kvpool.pool", "kvpool.cache", "kvpool.index", "kvpool.index.redis_index",
        "kvpool.sim.run", "kvpool.health", "kvpool.bench.store", "kvpool.bench.index", "kvpool.bench.kernels",
        "kvpool.bench.concurrency", "kvpool.cli", "kvpool.kernels", "kvpool.connectors.pools",
        "kvpool.connectors.breakeven", "kvpool.connectors.weights", "kvpool.connectors.families",
        "kvpool.connectors.bench_weights"]
FORBIDDEN = ["ray", "transformers", "vllm", "sglang"]


def test_core_imports_neither_ray_nor_an_engine():
    code = (f"import sys\nfor m in {CORE!r}: __import__(m)\n"
            f"print([m for m in {FORBIDDEN!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
