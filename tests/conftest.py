"""Shared test helpers: small stores and pools built by plain functions."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest

from kvpool import ChunkStore, KVSpec, Namespace, StoreConfig, Tenant, TenantRegistry, chunk_keys

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# NOTE: keeps every Ray node of the tests on the loopback address (Ray otherwise picks the
# machine's outbound interface); must be set before Ray starts.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The tests' Ray clusters are loopback-only: no token auth (a token left in ~/.ray by another
# local Ray would otherwise make heads and clients disagree).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The weights-fingerprint cache of the tests' checkpoints lives with the test run, not in ~/.cache.
if "KVPOOL_CACHE_DIR" not in os.environ:
    import tempfile as _tempfile

    os.environ["KVPOOL_CACHE_DIR"] = _tempfile.mkdtemp(prefix="kvpool-test-cache-")
# Triton kernels run under the interpreter on CPU-only machines; read when a kernel is decorated,
# so it is set before any test imports kvpool.kernels.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1, what: str = "",
             ignore: tuple[type[BaseException], ...] = ()) -> float:
    """Polls ``predicate()`` every ``interval_s`` until it returns something truthy; the seconds
    that took. After ``timeout_s`` it is an AssertionError saying what it waited for and the last
    value seen. An exception of ``ignore`` raised by the predicate counts as "not yet" (an actor
    restarting under it, say) and is the last value seen."""
    what = what or getattr(predicate, "__name__", repr(predicate))
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        try:
            last = predicate()
        except ignore as e:
            last = e
        else:
            if last:
                return time.monotonic() - t0
        if time.monotonic() >= deadline:
            shown = repr(last)
            if len(shown) > 500:
                shown = shown[:500] + f"... ({len(shown)} characters)"
            raise AssertionError(f"waited {timeout_s:g} s for {what}; last value seen: {shown}")
        time.sleep(interval_s)


def vllm_cache_root() -> str:
    """This user's vLLM cache (what vLLM uses under the real home), for a server started in a
    scratch ``HOME``: vLLM keeps there what it learnt of a model's architecture, which it otherwise
    relearns in a subprocess of its own (importing vLLM again) at every server start."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("VLLM_CACHE_ROOT") or os.path.join(cache, "vllm")


def need_engines(*modules: str) -> None:
    """For an engine test module, at its top: imports ``modules`` and sets vLLM to run in-process,
    or fails (in CI) / skips the module (elsewhere) naming the virtualenv that has them."""
    import importlib

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        for m in modules:
            importlib.import_module(m)
    except ImportError as e:  # pragma: no cover - the engines venv has them
        msg = f"{'/'.join(modules)} not importable ({e}); run with .venv-engines/bin/python (make engines)"
        if IN_CI:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)


def pytest_collection_modifyitems(config, items):
    """GPU checks are deselected on machines without CUDA: they are not part of the CPU suite (so
    never a skip in CI); the GPU script runs them with ``-m gpu``."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    gpu = [it for it in items if it.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [it for it in items if not it.get_closest_marker("gpu")]


def make_store(page_bytes=1024, dram_pages=4, disk_pages=0, disk_dir=None, tenants=None, policy="lru",
               policy_params=None, **config):
    reg = TenantRegistry(tenants or [Tenant("a"), Tenant("b")])
    cfg = StoreConfig(page_bytes, dram_pages, disk_pages, disk_dir, policy=policy, policy_params=policy_params or {}, **config)
    return ChunkStore(cfg, reg)


def make_keys(n, tenant_salt=b"t", seed=0, chunk_tokens=4):
    spec = KVSpec("test/model", 1, 1, 4, dtype="float32", block_size=chunk_tokens, chunk_tokens=chunk_tokens)
    tokens = np.random.default_rng(seed).integers(0, 32000, n * chunk_tokens)
    return chunk_keys(tokens, Namespace.for_spec(spec, tenant_salt), chunk_tokens)


def payload(i, nbytes=1000):
    """A payload whose every byte depends on i, so mixing two chunks up is visible."""
    return ((np.arange(nbytes) * 7 + i * 31) % 251).astype(np.uint8)


def snapshot(store):
    """Everything a failed call must leave unchanged."""
    st = store.stats()
    return st["tiers"], st["tenants"], st["chunks"], sorted(bytes(k) for k in store._cache.index)


@pytest.fixture
def tmp_disk(tmp_path):
    return str(tmp_path)


SHARED_DATA = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def shared_data(*parts):
    """A file of ../shared/data, or a skip outside CI when the folder is absent (in CI a missing
    file is a failure: the data is part of the project's test setup)."""
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(path):
        if IN_CI:
            pytest.fail(f"{path} is missing; CI runs with ../shared beside the checkout")
        pytest.skip(f"{path} is absent (outside CI)")
    return path


def redis_reachable(host="127.0.0.1", port=6379) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.fixture
def redis_url():
    """The machine's Redis (127.0.0.1:6379). Missing: a failure in CI, a skip elsewhere."""
    if not redis_reachable():
        if IN_CI:
            pytest.fail("no Redis at 127.0.0.1:6379; this machine kind starts one before CI")
        pytest.skip("no Redis at 127.0.0.1:6379")
    return "redis://127.0.0.1:6379/0"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A redis-server of the test's own on a free port, to kill and restart."""

    def __init__(self, tmp, *extra):
        import shutil

        if shutil.which("redis-server") is None:
            if IN_CI:
                pytest.fail("redis-server is not on PATH; this machine kind has it")
            pytest.skip("redis-server is not on PATH")
        self.port = free_port()
        self.tmp = str(tmp)
        self.extra = list(extra)
        self.proc = None
        self.start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        import subprocess

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.tmp, *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: redis_reachable(port=self.port), 10, interval_s=0.02,
                 what=f"redis-server to accept connections on port {self.port}")

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)

    def restart(self):
        self.kill()
        self.start()


@pytest.fixture
def own_redis(tmp_path):
    r = OwnRedis(tmp_path)
    yield r
    r.kill()


def scrape_metrics(want: list[str], timeout_s: float = 45) -> str:
    """The Prometheus text of every alive Ray node, once it holds every string of ``want`` (an
    AssertionError naming the missing ones after ``timeout_s``): Ray exports metrics every few
    seconds."""
    import urllib.request

    import ray

    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
    text = ""

    def holds_every_metric() -> bool:
        nonlocal text
        text = ""
        for port in ports:
            try:
                text += urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                pass
        missing = [w for w in want if w not in text]
        assert not missing, f"missing {missing} ({len(text)} characters scraped)"
        return True

    wait_for(holds_every_metric, timeout_s, interval_s=1, ignore=(AssertionError,),
             what=f"the metrics {want} on the Prometheus endpoints of ports {ports}")
    return text


class ClusterPool:
    """A pool on a local multi-node Ray cluster (kvpool.cluster.local), its node files in a run dir
    of the test's own; ``shards`` lists its shards' ids, the head's first. Engines' side:
    ``client(i)``, a NodeClient of shard ``i`` (no Ray in it)."""

    def __init__(self, run: str, namespace: str, cluster, workers, shards: list[str]) -> None:
        self.run, self.namespace, self.cluster, self.workers, self.shards = run, namespace, cluster, workers, shards

    @property
    def head(self) -> str:
        return self.shards[0]

    def client(self, which: int | str = 0, **kw):
        from kvpool.node.client import NodeClient

        sid = which if isinstance(which, str) else self.shards[which]
        return NodeClient(shard=sid, directory=self.run, **kw)

    def actor(self, which: int | str = 0):
        import ray

        from kvpool.cluster.shard import shard_name

        sid = which if isinstance(which, str) else self.shards[which]
        return ray.get_actor(shard_name("default", sid), namespace=self.namespace)

    def controller(self):
        import ray

        from kvpool.cluster.controller import CONTROLLER

        return ray.get_actor(CONTROLLER, namespace=self.namespace)


@contextlib.contextmanager
def cluster_pool(run: str, nodes: int, namespace: str, system_config: dict | None = None, **up_kw):
    """``with cluster_pool(str(tmp), 2, "ns", store=..., tenants=...) as cp:``; torn down after."""
    import ray

    from kvpool.cluster.bootstrap import shard_id_of, up
    from kvpool.cluster.local import local_cluster
    from kvpool.node.paths import own_run_dir

    with own_run_dir(run), local_cluster(nodes, namespace=namespace, system_config=system_config) as (c, workers):
        up(namespace=namespace, **up_kw)
        shards = [shard_id_of(ray.get_runtime_context().get_node_id())] + [shard_id_of(w.node_id) for w in workers]
        wait_for(lambda: all(os.path.exists(os.path.join(run, f"kvpool-default-{s}.node")) for s in shards), 30,
                 what="every shard's node file")
        yield ClusterPool(run, namespace, c, workers, shards)
