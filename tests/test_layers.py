"""The layering rule: the core (``kvpool/``, every module of it, benchmarks included) and the
kernels import neither Ray nor an engine; the engine-neutral connector helpers import no engine at
import time. Entry points that dispatch upward (the CLI) import lazily."""

import os
import pkgutil
import subprocess
import sys

import kvpool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ["ray", "transformers", "vllm", "sglang"]
# connectors/ modules that any engine's connector uses, so none may pull an engine in
NEUTRAL = ["kvpool.connectors.pools", "kvpool.connectors.tenancy", "kvpool.connectors.breakeven", "kvpool.connectors.weights",
           "kvpool.connectors.families", "kvpool.connectors.bench.weights", "kvpool.connectors.vllm_config",
           # the router runs beside engines, not in them: no engine, no Ray
           "kvpool.connectors.route.main", "kvpool.connectors.route.proxy", "kvpool.connectors.route.spec"]


def modules_under(folder: str, package: str) -> list[str]:
    return [package] + [m.name for m in pkgutil.walk_packages([os.path.join(ROOT, folder)], prefix=package + ".")]


def core_modules() -> list[str]:
    # kvpool/ holds the core; connectors/, kernels/ and cluster/ are installed under kvpool too,
    # from their own folders, so walking kvpool/ finds the core alone.
    return modules_under("kvpool", "kvpool")


def test_the_walk_finds_every_core_module():
    mods = core_modules()
    assert {"kvpool.cli", "kvpool.store", "kvpool.pool", "kvpool.codec", "kvpool.index.redis_index",
            "kvpool.bench.store", "kvpool.sim.run"} <= set(mods)
    assert not [m for m in mods if m.startswith(("kvpool.cluster", "kvpool.connectors", "kvpool.kernels"))]
    assert len(mods) > 30 and kvpool.__file__.startswith(os.path.join(ROOT, "kvpool"))


def test_core_and_kernels_import_neither_ray_nor_an_engine():
    mods = core_modules() + modules_under("kernels", "kvpool.kernels") + NEUTRAL
    code = (f"import sys\nfor m in {mods!r}: __import__(m)\n"
            f"print([m for m in {FORBIDDEN!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=180)
    assert out.stdout.strip() == "[]", out.stdout


MAX_LINES = 400


def test_every_module_outside_the_tests_reads_in_one_sitting():
    """One concept a module: none of the product, its benchmarks or its demos passes 400 lines
    (split where the concepts part)."""
    long = []
    for folder in ("kvpool", "connectors", "kernels", "cluster"):
        for root, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8") as f:
                        n = sum(1 for _ in f)
                    if n > MAX_LINES:
                        long.append(f"{os.path.relpath(path, ROOT)} ({n} lines)")
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_run_from_the_checkout_its_kernels_folder_never_shadows_hugging_faces_kernels():
    """``python -m`` from the checkout (and a Ray worker of a driver started there) has the checkout
    on sys.path, where ``kernels/`` would be imported as Hugging Face's ``kernels`` package, which
    transformers imports: importing kvpool takes the checkout off the path."""
    code = ("import importlib.util, sys\nbefore = importlib.util.find_spec('kernels')\nimport kvpool\n"
            "after = importlib.util.find_spec('kernels')\n"
            "print(before.origin if before else None); print(after.origin if after else None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"})
    before, after = out.stdout.split()
    ours = os.path.join(ROOT, "kernels", "__init__.py")
    assert before == ours  # the checkout is on the path before kvpool is imported: the control
    assert after != ours
    import kvpool.kernels

    assert kvpool.kernels.__file__ == ours  # kvpool's own kernels, under their installed name
