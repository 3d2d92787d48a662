"""The package as users install it: the sdist and the wheel built from it (as `make dist` and an installer build
them), installed NOT editable into a fresh virtualenv, and run from there, outside the checkout.

The fresh virtualenv borrows this one's site-packages for the dependencies (torch, transformers, ...) through a
.pth file, so nothing is downloaded or reinstalled. This virtualenv's own kvpool is an editable install (a
``__editable__`` finder started by a .pth file in its site-packages); Python processes .pth files only in a site
directory, never in a folder that a .pth file adds, so that finder never runs in the fresh one, and every test
asserts that each kvpool module it imports came from the wheel."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib  # Python >= 3.11, as both of the suite's virtualenvs

REPO = Path(__file__).resolve().parent.parent
# Run by `make venv` (it fetches Mooncake's shared libraries at set-up), never by the installed product.
DEV_ONLY = {"kvpool/node/get-mooncake-libs.sh"}
# Subpackages that a hand-kept package list once left out: every command that opens an index needs them.
ONCE_MISSED = ("kvpool.index", "kvpool.policies", "kvpool.sim")


def package_dirs() -> dict[str, str]:
    """pyproject.toml's package-dir: installed package -> folder of the checkout."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def source_files() -> dict[str, str]:
    """Every file of the checkout's package folders -> the path it must have in the wheel."""
    out = {}
    for package, folder in package_dirs().items():
        root = REPO / folder
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                rel = path.relative_to(root).as_posix()
                out[f"{folder}/{rel}"] = "/".join([*package.split("."), rel])
    return out


def run(cmd, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{r.args} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Builds the sdist from a copy of the checkout's sources and the wheel from the sdist, and installs the wheel
    into a fresh virtualenv; yields (the virtualenv, the wheel, a scratch folder outside the checkout)."""
    root = tmp_path_factory.mktemp("installed")
    src, dist, venv = root / "src", root / "dist", root / "venv"
    src.mkdir()
    # a copy: the build writes build/ and *.egg-info beside the sources, and must not see a stale build/ there
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in package_dirs().values():
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # setuptools' own PEP 517 hooks, with this virtualenv's setuptools: offline, as `python -m build` runs them
    # (-P: the sources' kernels/ folder must not shadow the `kernels` package transformers imports)
    sdist = ok(run([sys.executable, "-P", "-c", f"from setuptools import build_meta as b; print(b.build_sdist({str(dist)!r}))"],
                   cwd=src)).stdout.split()[-1]
    ok(run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
            str(dist / sdist)], cwd=root))
    (wheel,) = dist.glob("kvpool-*.whl")
    ok(run([sys.executable, "-m", "venv", "--without-pip", str(venv)]))
    site = Path(ok(run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]))
                .stdout.strip())
    deps = sysconfig.get_paths()["purelib"]  # this virtualenv's: the dependencies, not its editable kvpool (above)
    (site / "deps-from-the-test-venv.pth").write_text(deps + "\n")
    ok(run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
            "--no-index", str(wheel)], cwd=root))
    yield venv, wheel, root


def test_the_wheel_holds_every_module_and_file_of_the_package_folders(installed):
    _, wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = source_files()
    missing = sorted(src for src, dst in expected.items() if dst not in names and src not in DEV_ONLY)
    assert not missing, f"the wheel lacks {len(missing)} files of the checkout: {missing[:20]}"
    assert not {f"{'/'.join(p.split('.'))}/__init__.py" for p in ONCE_MISSED} - names
    # nothing outside kvpool: no generic top-level name ("kernels" is a PyPI package) is claimed
    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert {n.split("/")[0] for n in names} == {"kvpool", f"kvpool-{version}.dist-info"}
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def env_outside(root: Path, venv: Path) -> dict[str, str]:
    """An environment for the fresh virtualenv: its bin first, a scratch HOME and run dir, and nothing of this
    one's (no PYTHONPATH, no Ray address, no pool variables)."""
    drop = ("RAY_", "KVPOOL_", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    home, rundir = root / "home", root / "run"
    home.mkdir(exist_ok=True)
    rundir.mkdir(mode=0o700, exist_ok=True)
    env.update({"HOME": str(home), "KVPOOL_RUN_DIR": str(rundir), "VIRTUAL_ENV": str(venv),
                "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"})
    return env


IMPORTS = """
import importlib, json, sys
mods = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}
print(json.dumps({"mods": mods, "prefix": sys.prefix}))
"""


def test_the_installed_wheel_runs_the_commands(installed):
    venv, _, root = installed
    env = env_outside(root, venv)
    kvpool = str(venv / "bin" / "kvpool")  # the console script the wheel installed
    assert Path(kvpool).is_file()
    python = str(venv / "bin" / "python")
    r = ok(run([python, "-c", IMPORTS, "kvpool", *ONCE_MISSED, "kvpool.cli", "kvpool.connectors", "kvpool.kernels",
                "kvpool.cluster", "kvpool.connectors.route"], env=env, cwd=root))
    got = json.loads(r.stdout)
    assert Path(got["prefix"]) == venv
    site = str(venv / "lib")
    assert all(f.startswith(site) for f in got["mods"].values()), got["mods"]  # the wheel's, not the checkout's
    try:
        r = ok(run([kvpool, "up", "--dram", "32MiB", "--page-size", "4MiB"], env=env, cwd=root))
        assert "one process (pid" in r.stdout and "no Ray" in r.stdout, r.stdout
        pid = json.loads((root / "home" / ".kvpool" / "pool.json").read_text())["pid"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0].decode() == python and b"kvpool.cluster.solo" in cmdline, cmdline  # the pool runs the wheel
        r = ok(run([kvpool, "connect", "vllm"], env=env, cwd=root))
        cfg = json.loads(r.stdout.strip().splitlines()[-1])
        assert cfg["kv_connector"] == "KVPoolConnector" and cfg["kv_connector_module_path"] == "kvpool.connectors.vllm"
        r = ok(run([kvpool, "stats", "--json"], env=env, cwd=root))
        assert json.loads(r.stdout)["mode"] == "single-node"
        r = ok(run([kvpool, "sim", "--workload", "chat", "--requests", "60", "--capacity", "64", "--policy", "lru",
                    "--no-belady", "--json"], env=env, cwd=root))
        rows = {row["policy"]: row for row in json.loads(r.stdout)}  # the policy's replay beside the infinite cache's
        assert rows["lru"]["capacity"] == 64 and 0 < rows["lru"]["hit_rate"] <= rows["infinite"]["hit_rate"], rows
        r = ok(run([kvpool, "route", "--help"], env=env, cwd=root))
        assert r.stdout.startswith("usage: kvpool route"), r.stdout[:200]
        r = ok(run([kvpool, "down"], env=env, cwd=root))
        assert f"stopped the pool's process (pid {pid}" in r.stdout, r.stdout
        assert os.listdir(env["KVPOOL_RUN_DIR"]) == []
    finally:
        run([kvpool, "down"], env=env, cwd=root)


ENTRY_POINTS = """
import importlib.metadata as md, importlib.util, json, sys
(ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvpool"]
fn = ep.load()  # vLLM loads its general plugins by this group and name, then calls each
fn()  # without vLLM installed it returns at once: nothing to wrap
spec = importlib.util.find_spec("kvpool.connectors.vllm")  # vLLM imports kv_connector_module_path by name
(script,) = [e for e in md.entry_points(group="console_scripts") if e.name == "kvpool"]
print(json.dumps({"value": ep.value, "plugin": sys.modules[fn.__module__].__file__, "connector": spec.origin,
                  "dist": str(ep.dist.locate_file("")), "script": script.value, "vllm": "vllm" in sys.modules}))
"""


def test_the_vllm_plugin_and_connector_resolve_by_name_from_the_wheel(installed):
    """vLLM is not in this virtualenv (it is in .venv-engines): the plugin entry point is loaded and called by name
    (it needs no vLLM to import), and the connector's module, which imports vLLM, is found by the name vLLM imports
    it by, in the wheel, and defines the class the engine's config names."""
    venv, _, root = installed
    env = env_outside(root, venv)
    r = ok(run([str(venv / "bin" / "python"), "-c", ENTRY_POINTS], env=env, cwd=root))
    got = json.loads(r.stdout)
    site = str(venv / "lib")
    assert got["value"] == "kvpool.connectors.vllm_plugin:register" and got["script"] == "kvpool.cli:main", got
    assert got["plugin"].startswith(site) and got["connector"].startswith(site) and got["dist"].startswith(site), got
    assert not got["vllm"]
    tree = ast.parse(Path(got["connector"]).read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert "KVPoolConnector" in classes, sorted(classes)
