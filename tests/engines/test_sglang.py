"""kvpool as SGLang's HiCache storage backend, through SGLang 0.5.23's own classes.

Two halves:

- In this process: SGLang's ``StorageBackendFactory`` builds the backend from a real
  ``HiCacheStorageConfig`` (``dynamic`` backend, extra config as ``--hicache-storage-backend-extra-
  config`` would give it), and the config and lifecycle errors.
- In a child process (:func:`_child_main`, this file run as a script): everything that needs
  SGLang's host pool. A real ``MHATokenToKVPool`` on CPU and a real ``MHATokenToKVPoolHost`` on top
  of it, in each supported layout (``layer_first`` fp32, ``page_first`` bf16,
  ``page_first_direct`` fp16), page keys from SGLang's own ``get_storage_hash_str`` (salted with
  ``RadixKey(cache_salt=...)``), and SGLang's own ``HiCacheController`` storage methods
  (``_page_backup``, ``_storage_hit_query``, ``_page_transfer``) driving the backend. Each check
  reports back and becomes one test here.

NOTE: why a child process. ``sglang.srt.mem_cache.memory_pool`` imports SGLang's whole model-
config registry, whose image processors import ``torchvision`` and whose GGUF loader imports
``gguf``. The engines virtualenv has neither (PyPI's torchvision builds break against CPU torch,
see shared/notes/engines.md), and neither is on the KV path. The child puts a placeholder module
in front of just those two names, and only when they are missing; a placeholder ``torchvision``
would mislead transformers in a shared process (it checks for it), so it never enters the pytest
process. Everything the checks exercise -- the host pool, its layouts, the hashing, the
controller's storage methods, the factory -- is SGLang's real code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

try:
    from conftest import IN_CI
except ImportError:  # run as the child script, outside pytest
    IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LAYOUTS = {"layer_first": "float32", "page_first": "bfloat16", "page_first_direct": "float16"}
PAGE = 4  # tokens a page (small: more pages per test)

try:
    import sglang  # noqa: F401
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    HAVE_SGLANG = True
except ImportError as e:  # pragma: no cover - only without the engines virtualenv
    HAVE_SGLANG = False
    _IMPORT_ERROR = e

if not HAVE_SGLANG:  # pragma: no cover
    if IN_CI:
        raise RuntimeError(f"SGLang is not importable here ({_IMPORT_ERROR}): run these tests with "
                           ".venv-engines/bin/python (make engines)")
    pytest.skip(f"SGLang is not installed: {_IMPORT_ERROR}", allow_module_level=True)


def storage_config(extra: dict | None, *, layout: str = "page_first", model: str = "tiny-llama", tp=(0, 1),
                   is_mla: bool = False) -> "HiCacheStorageConfig":
    """SGLang's storage config as its cache controller builds it (one rank, no PP/CP)."""
    return HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=is_mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model, extra_config=extra)


def extra_config(**pool) -> dict:
    """The extra config a user passes with ``--hicache-storage-backend dynamic``."""
    return {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang", "class_name": "KVPoolStorage",
            "dram_mib": 1, "model_weights": "kvpool-tests/tiny-llama@seed0", **pool}


# ---------------------------------------------------------------------------------------------
# In this process: the factory, the config, the lifecycle


def test_factory_builds_the_backend_and_it_declares_zero_copy():
    from kvpool.connectors.sglang import KVPoolStorage

    cfg = storage_config(extra_config(pool="sgl-factory", tenants=["alice", "bob"], tenant="bob"))
    backend = StorageBackendFactory.create_backend("dynamic", cfg, mem_pool_host=None)
    assert type(backend) is KVPoolStorage
    assert backend.tenant == "bob"
    # SGLang reads interface_v1 from this dict after constructing the backend: zero-copy is on
    assert cfg.extra_config["interface_v1"] == 1
    # an operator's explicit 0 is kept (the generic path)
    cfg0 = storage_config(extra_config(pool="sgl-factory", interface_v1=0))
    assert StorageBackendFactory.create_backend("dynamic", cfg0, None).storage_config.extra_config["interface_v1"] == 0


def test_sglang_keys_are_stripped_and_unknown_keys_are_refused():
    from kvpool.errors import BadRequest

    ok = extra_config(pool="sgl-keys", prefetch_threshold=128, hicache_storage_pass_prefix_keys=True)
    StorageBackendFactory.create_backend("dynamic", storage_config(ok), None)
    with pytest.raises(BadRequest, match="unknown kvpool connector settings.*dram_gib"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(dram_gib=1)), None)
    with pytest.raises(BadRequest, match="not among the pool's tenants"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(tenant="mallory")), None)
    with pytest.raises(BadRequest, match="MLA"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(), is_mla=True), None)


def test_the_backend_names_the_weights_and_refuses_what_it_cannot_serve(tmp_path):
    """Keys carry the checkpoint's content: the folder SGLang serves is fingerprinted like the
    transformers connector does it; a checkpoint rewritten in place gets another fingerprint; a
    model that is no folder needs ``model_weights``; sliding-window models are refused."""
    from tinymodel import save_tiny_llama

    from kvpool.connectors.families import UnsupportedModel
    from kvpool.connectors.sglang import model_identity
    from kvpool.connectors.weights import files_fingerprint
    from kvpool.errors import BadRequest

    folder = save_tiny_llama(tmp_path / "m", seed=0)
    first, kinds, scope = model_identity(folder, None)
    assert first == files_fingerprint(folder) and kinds == ("full", "full") and scope == ""  # Llama: shared
    save_tiny_llama(tmp_path / "m", seed=1)  # another checkpoint, same name and shape, same folder
    assert model_identity(folder, None)[0] != first
    assert model_identity(folder, "mine@v1")[0] == "given:mine@v1"
    with pytest.raises(BadRequest, match="model_weights"):
        StorageBackendFactory.create_backend("dynamic", storage_config({**extra_config(), "model_weights": None}), None)
    windowed = save_tiny_llama(tmp_path / "w", seed=0, sliding_window=64)
    with pytest.raises(UnsupportedModel, match="sliding:64"):
        model_identity(windowed, None)


def test_calls_before_the_host_pool_is_registered_say_what_to_do():
    from kvpool.errors import BadRequest

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(pool="sgl-early")), None)
    with pytest.raises(BadRequest, match="register_mem_pool_host"):
        backend.batch_exists(["ab" * 32])
    with pytest.raises(BadRequest, match="register_mem_pool_host"):
        backend.get("ab" * 32)
    with pytest.raises(BadRequest, match="not an SGLang MHA host pool"):
        backend.register_mem_pool_host(object())


# ---------------------------------------------------------------------------------------------
# In a child process: SGLang's host pool, hashing and controller


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang") / "results.json"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"the SGLang child process failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


CHECKS = [f"{name}[{layout}]" for name in ("factory_and_register", "generic_roundtrip", "batch_exists_leading_run",
                                          "v1_roundtrip", "v1_any_slots", "misses", "bad_input")
          for layout in LAYOUTS] + [
    "layouts_share_pages", "tenant_isolation_salt_in_extra_info", "tenant_isolation_tenants",
    "tenant_isolation_sglang_salted_hashes", "controller_backup_and_prefetch", "failures_are_misses_or_false",
    "unsupported_host_pools",
]


@pytest.mark.parametrize("check", CHECKS)
def test_with_sglang_host_pool(child_results, check):
    result = child_results.get(check)
    assert result is not None, f"the child did not run {check}; it ran {sorted(child_results)}"
    assert result["ok"], result["error"]


# =============================================================================================
# The child: run as `python tests/engines/test_sglang.py OUT.json`


def _shim_missing(names):
    """Placeholder modules for ``names`` that are not installed (see the module docstring)."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import types

    missing = {n for n in names if importlib.util.find_spec(n) is None}
    if not missing:
        return set()

    class _Anything(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(name, (), {})

        def __call__(cls, *args, **kwargs):
            return cls

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] in missing:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            mod = types.ModuleType(spec.name)
            mod.__path__ = []
            mod.__version__ = "0.0.0"

            def attr(name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return _Anything(name, (), {})

            mod.__getattr__ = attr
            return mod

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _Finder())
    return missing


def _child_main(out_path: str) -> None:
    sys.path.insert(0, REPO)
    shimmed = _shim_missing(("torchvision", "gguf"))
    import logging

    logging.disable(logging.WARNING)  # SGLang warns about CPU kernels; the backend about misses
    import queue

    import torch
    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvpool.connectors.pools import close_local_pools
    from kvpool.connectors.sglang import KVPoolStorage
    from kvpool.errors import BadRequest, UnknownTenant
    from kvpool.kernels.layouts import sglang_layout
    from kvpool.kernels.paged import gather

    results: dict = {"_shimmed": sorted(shimmed)}
    L, H, D = 3, 2, 8
    gen = torch.Generator().manual_seed(0)

    def make_host(layout, dtype=None):
        dtype = getattr(torch, dtype or LAYOUTS[layout])
        device_pool = MHATokenToKVPool(size=64, page_size=PAGE, dtype=dtype, head_num=H, head_dim=D, layer_num=L,
                                       device="cpu", enable_memory_saver=False)
        host = MHATokenToKVPoolHost(device_pool._mha_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False,
                                    device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=L)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(dtype))
        return host

    def make_backend(host, pool, **extra):
        """As SGLang's cache controller does it: the factory, then register_mem_pool_host."""
        cfg = storage_config(extra_config(pool=pool, **extra), layout=host.layout)
        backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
        backend.register_mem_pool_host(host)
        return backend

    def page_keys(n, start=0, salt=None):
        tokens = list(range(1000 + start * PAGE, 1000 + (start + n) * PAGE))
        return get_storage_hash_str(RadixKey(tokens, cache_salt=salt), None, page_size=PAGE)

    def page_bytes(host, page):
        """A host page's bytes in SGLang's flat order (its own get_data_page)."""
        return host.get_data_page(page * PAGE, flat=True).clone()

    def slots(pages):
        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])

    def same(a, b):
        return torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b)

    def check(name):
        def run(fn):
            try:
                fn()
                results[name] = {"ok": True, "error": None}
            except Exception:
                results[name] = {"ok": False, "error": traceback.format_exc()}
            finally:
                close_local_pools()
            return fn
        return run

    for layout in LAYOUTS:
        @check(f"factory_and_register[{layout}]")
        def _(layout=layout):
            host = make_host(layout)
            cfg = storage_config(extra_config(pool="f"), layout=layout)
            backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
            assert type(backend) is KVPoolStorage and cfg.extra_config["interface_v1"] == 1
            backend.register_mem_pool_host(host)
            assert backend.page_size == PAGE and backend.spec.chunk_tokens == PAGE
            assert backend.spec.chunk_shape == (L, 2, PAGE, H, D) and backend.spec.dtype == LAYOUTS[layout]

        @check(f"generic_roundtrip[{layout}]")
        def _(layout=layout):
            # SGLang's generic path: flat pages from host.get_data_page, read into
            # host.get_dummy_flat_data_page(), written back with host.set_from_flat_data_page
            host = make_host(layout)
            backend = make_backend(host, "g")
            keys = page_keys(3)
            pages = [4, 9, 2]
            want = [page_bytes(host, p) for p in pages]
            assert backend.batch_set(keys, [host.get_data_page(p * PAGE) for p in pages]) is True
            got = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
            assert all(g is not None and same(g, w) for g, w in zip(got, want))
            one = backend.get(keys[1], host.get_dummy_flat_data_page())
            assert one is not None and same(one, want[1])
            for i, p in enumerate([20, 21, 22]):
                host.set_from_flat_data_page(p * PAGE, got[i])
                assert same(page_bytes(host, p), want[i])
            assert backend.set(keys[0], host.get_data_page(4 * PAGE)) is True  # already there: still True
            # the two paths store the same chunk: flat pages in, zero-copy out, and back
            assert backend.batch_get_v1(keys, slots([25, 26, 27])) == [True] * 3
            assert all(same(page_bytes(host, p), w) for p, w in zip([25, 26, 27], want))
            more = page_keys(1, start=40)
            assert backend.batch_set_v1(more, slots([6])) == [True]
            assert same(backend.get(more[0], host.get_dummy_flat_data_page()), page_bytes(host, 6))

        @check(f"batch_exists_leading_run[{layout}]")
        def _(layout=layout):
            host = make_host(layout)
            backend = make_backend(host, "e")
            keys = page_keys(5)
            for i in (0, 1, 3):
                assert backend.set(keys[i], host.get_data_page(i * PAGE))
            assert backend.batch_exists(keys) == 2
            assert backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 2
            assert [backend.exists(k) for k in keys] == [True, True, False, True, False]
            assert backend.batch_exists(keys[3:]) == 1 and backend.batch_exists([]) == 0
            assert backend.batch_set_v1(keys[2:3], slots([2])) == [True]
            assert backend.batch_exists(keys) == 4

        @check(f"v1_roundtrip[{layout}]")
        def _(layout=layout):
            host = make_host(layout)
            backend = make_backend(host, "v")
            keys = page_keys(3)
            src = [7, 2, 11]
            want = [page_bytes(host, p) for p in src]
            assert backend.batch_set_v1(keys, slots(src)) == [True, True, True]
            host.kv_buffer.zero_()
            dst = [30, 5, 17]
            assert backend.batch_get_v1(keys, slots(dst)) == [True, True, True]
            assert all(same(page_bytes(host, p), w) for p, w in zip(dst, want))
            # a miss ends the run and leaves its page alone; host indices from SGLang's allocator
            idx = host.alloc(4 * PAGE)
            first = [int(idx[i * PAGE]) // PAGE for i in range(4)]
            before = host.kv_buffer.clone()
            extra = page_keys(1, start=50)
            assert backend.batch_get_v1(extra + keys, idx) == [False] * 4
            assert same(host.kv_buffer, before)
            untouched = page_bytes(host, first[3])
            assert backend.batch_get_v1(keys + extra, idx) == [True, True, True, False]
            assert all(same(page_bytes(host, p), w) for p, w in zip(first[:3], want))
            assert same(page_bytes(host, first[3]), untouched)
            st = backend.stats()
            assert st["get_hits"] == 6 and st["set_stored"] == 3 and st["load_gbps"] is not None
            m = backend.get_stats()  # SGLang's own StorageMetrics, drained on read
            assert sum(m.prefetch_pgs) == 6 and m.backup_pgs == [3] and len(m.prefetch_bandwidth) == 2
            assert backend.get_stats().prefetch_pgs == []

        @check(f"v1_any_slots[{layout}]")
        def _(layout=layout):
            # pages on slots that are not an aligned run (SGLang's allocator never hands those out)
            # go through kvpool.kernels.paged; the result is the same KV, token for token
            host = make_host(layout)
            backend = make_backend(host, "a")
            kvl = sglang_layout(layout)
            keys = page_keys(2)
            odd = torch.cat([slots([7]).flip(0), slots([3, 4])[2:2 + PAGE]])  # reversed; straddling two
            want = gather(host.kv_buffer, odd, kvl)
            assert backend.batch_set_v1(keys, odd) == [True, True]
            assert backend.batch_get_v1(keys, slots([20, 21])) == [True, True]
            assert torch.equal(gather(host.kv_buffer, slots([20, 21]), kvl), want)
            back = slots([22, 23]).flip(0)
            assert backend.batch_get_v1(keys, back) == [True, True]
            assert torch.equal(gather(host.kv_buffer, back, kvl), want)

        @check(f"misses[{layout}]")
        def _(layout=layout):
            host = make_host(layout)
            backend = make_backend(host, "m")
            keys = page_keys(2)
            assert backend.get(keys[0]) is None
            assert backend.get(keys[0], host.get_dummy_flat_data_page()) is None
            assert backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None, None]
            assert backend.exists(keys[0]) is False and backend.batch_exists(keys) == 0
            before = host.kv_buffer.clone()
            assert backend.batch_get_v1(keys, slots([1, 2])) == [False, False]
            assert same(host.kv_buffer, before)

        @check(f"bad_input[{layout}]")
        def _(layout=layout):
            host = make_host(layout)
            backend = make_backend(host, "b")
            keys = page_keys(2)
            expect = [
                (lambda: backend.get(123), "page key"),
                (lambda: backend.batch_exists("ab" * 32), "list of page-key strings"),
                (lambda: backend.set(keys[0], torch.zeros(5)), "a page of this host pool"),
                (lambda: backend.set(keys[0], host.get_dummy_flat_data_page().to(torch.int8)),
                 "a page of this host pool"),
                (lambda: backend.batch_set(keys, [host.get_data_page(0)]), "2 keys but 1 values"),
                (lambda: backend.batch_set_v1(keys, slots([1])), "need 8 host indices, got 4"),
                (lambda: backend.batch_get_v1(keys, slots([1, 2]).float()), "1-D integer tensor"),
                (lambda: backend.batch_set_v1(keys, slots([1, 500])), "out of range"),
                (lambda: backend.batch_exists(keys, HiCacheStorageExtraInfo(extra_info={"tenant": "mallory"})),
                 "unknown tenant"),
            ]
            for call, match in expect:
                try:
                    call()
                except (BadRequest, UnknownTenant) as e:
                    assert match in str(e), f"{match!r} not in {e}"
                else:
                    raise AssertionError(f"no error for the case expecting {match!r}")
            # chunk_tokens other than the page size is refused at registration
            cfg = storage_config(extra_config(pool="b2", chunk_tokens=256), layout=layout)
            b2 = StorageBackendFactory.create_backend("dynamic", cfg, host)
            try:
                b2.register_mem_pool_host(host)
            except BadRequest as e:
                assert "one page per chunk" in str(e)
            else:
                raise AssertionError("chunk_tokens=256 with 4-token pages was accepted")

    @check("layouts_share_pages")
    def _():
        # one pool, three host layouts: a page written through any layout reads back in any
        # other as the same KV (the canonical chunk), compared through kvpool's own gather
        hosts = {layout: make_host(layout, "float32") for layout in LAYOUTS}
        backends = {layout: make_backend(h, "shared") for layout, h in hosts.items()}
        for i, (w_layout, writer) in enumerate(backends.items()):
            keys = page_keys(2, start=10 * i)
            assert writer.batch_set_v1(keys, slots([3, 6])) == [True, True]
            want = gather(hosts[w_layout].kv_buffer, slots([3, 6]), sglang_layout(w_layout))
            for r_layout, reader in backends.items():
                assert reader.batch_get_v1(keys, slots([12, 13])) == [True, True]
                got = gather(hosts[r_layout].kv_buffer, slots([12, 13]), sglang_layout(r_layout))
                assert torch.equal(got, want), f"{w_layout} -> {r_layout}"

    @check("tenant_isolation_salt_in_extra_info")
    def _():
        host = make_host("page_first")
        backend = make_backend(host, "s")
        keys = page_keys(3)  # the same page keys for every salt
        salted = {s: HiCacheStorageExtraInfo(extra_info={"cache_salt": s}) for s in ("A", "B")}
        keyed = HiCacheStorageExtraInfo(extra_info={"extra_key": "A"})  # extra_key "A" is not salt "A"
        assert backend.batch_set_v1(keys, slots([1, 2, 3]), salted["A"]) == [True] * 3
        assert backend.batch_exists(keys, salted["A"]) == 3
        for other in (salted["B"], keyed, None):
            assert backend.batch_exists(keys, other) == 0
            assert backend.batch_get_v1(keys, slots([4, 5, 6]), other) == [False] * 3
        assert backend.get(keys[0]) is None and backend.get(keys[0], extra_info=salted["A"]) is not None

    @check("tenant_isolation_tenants")
    def _():
        host = make_host("page_first")
        tenants = ["alice", "bob"]
        alice = make_backend(host, "t", tenants=tenants, tenant="alice")
        bob = make_backend(host, "t", tenants=tenants, tenant="bob")
        keys = page_keys(2)
        assert alice.batch_set_v1(keys, slots([1, 2])) == [True, True]
        assert alice.batch_exists(keys) == 2
        assert bob.batch_exists(keys) == 0 and bob.batch_get_v1(keys, slots([3, 4])) == [False, False]
        as_bob = HiCacheStorageExtraInfo(extra_info={"tenant": "bob"})
        assert alice.batch_exists(keys, as_bob) == 0
        # the same key under another tenant is another chunk; the pool keeps both
        assert bob.batch_set_v1(keys, slots([5, 6])) == [True, True]
        assert alice.batch_get_v1(keys, slots([7, 8])) == [True, True]
        assert same(page_bytes(host, 7), page_bytes(host, 1)) and not same(page_bytes(host, 7), page_bytes(host, 5))

    @check("tenant_isolation_sglang_salted_hashes")
    def _():
        # SGLang 0.5.23 seeds a salted request's page chain with its salt: salted requests reach
        # the backend with other keys, and never meet in the pool
        host = make_host("page_first")
        backend = make_backend(host, "h")
        plain, a, b = page_keys(3), page_keys(3, salt="A"), page_keys(3, salt="B")
        assert len({*plain, *a, *b}) == 9
        assert backend.batch_set_v1(a, slots([1, 2, 3])) == [True] * 3
        assert backend.batch_exists(a) == 3 and backend.batch_exists(b) == 0 and backend.batch_exists(plain) == 0

    @check("controller_backup_and_prefetch")
    def _():
        # SGLang's HiCacheController storage methods, on a controller holding only what they read
        # (its constructor wants a device allocator, CUDA streams and process groups)
        host = make_host("page_first")
        backend = make_backend(host, "c")
        ctl = HiCacheController.__new__(HiCacheController)
        ctl.storage_backend, ctl.storage_host_pool, ctl.mem_pool_host = backend, host, host
        ctl.page_size = PAGE
        ctl.prefetch_sync_queue = queue.Queue()
        ctl.page_get_func, ctl.page_set_func = ctl._page_get_zero_copy, ctl._page_set_zero_copy
        tokens = list(range(2000, 2000 + 5 * PAGE + 2))  # 5 whole pages and a partial one
        key = RadixKey(tokens, cache_salt="tenant-A")
        hashes = get_storage_hash_str(RadixKey(tokens[: 5 * PAGE], cache_salt="tenant-A"), None, page_size=PAGE)
        src = host.alloc(5 * PAGE)
        want = [page_bytes(host, int(src[i * PAGE]) // PAGE) for i in range(5)]
        # the backup thread: two batches, the second naming the first as its prefix
        op1 = StorageOperation(src[: 2 * PAGE], tokens[: 2 * PAGE], hash_value=hashes[:2], prefix_keys=[])
        ctl._page_backup(op1)
        op2 = StorageOperation(src[2 * PAGE:], tokens[2 * PAGE: 5 * PAGE], hash_value=hashes[2:],
                               prefix_keys=hashes[:2])
        ctl._page_backup(op2)
        assert op1.completed_tokens == 2 * PAGE and op2.completed_tokens == 3 * PAGE
        # the prefetch thread: hit query over the salted key, then the transfer into host memory
        op = PrefetchOperation("req-1", key, None, prefix_keys=[])
        hit_hashes, hit_tokens = ctl._storage_hit_query(op)
        assert hit_tokens == 5 * PAGE and hit_hashes == hashes
        op.hash_value, op.host_indices = hit_hashes, host.alloc(5 * PAGE)
        assert ctl._page_transfer(op) == 5
        got = [page_bytes(host, int(op.host_indices[i * PAGE]) // PAGE) for i in range(5)]
        assert all(same(g, w) for g, w in zip(got, want))
        # another tenant's salt, same tokens: nothing
        other = PrefetchOperation("req-2", RadixKey(tokens, cache_salt="tenant-B"), None, prefix_keys=[])
        assert ctl._storage_hit_query(other) == ([], 0)

    def before_page(before, page):
        return before[:, page * PAGE:(page + 1) * PAGE].flatten()  # page_first: (2, size, L, H, D)

    @check("failures_are_misses_or_false")
    def _():
        host = make_host("page_first", "float32")
        page_nbytes = L * 2 * PAGE * H * D * 4
        # an exhausted quota refuses the write whole: False for every page, nothing raised
        small = make_backend(host, "q", tenants=[{"id": "small", "quota_bytes": 3 * page_nbytes}], tenant="small")
        keys = page_keys(5)
        assert small.batch_set_v1(keys, slots([1, 2, 3, 4, 5])) == [False] * 5
        assert small.batch_exists(keys) == 0
        assert small.batch_set_v1(keys[:3], slots([1, 2, 3])) == [True] * 3
        assert small.batch_set(keys[3:], [host.get_data_page(4 * PAGE), host.get_data_page(5 * PAGE)]) is False
        assert small.batch_exists(keys) == 3 and small.stats()["write_errors"] == 2
        # a corrupted chunk (a flipped byte in the pool's slab) is a miss, and stays one
        backend = make_backend(host, "x")
        keys = page_keys(2, start=20)
        assert backend.batch_set_v1(keys, slots([1, 2])) == [True, True]
        store = backend.pool.store
        tier, page = store.locate(backend.chunk_keys(keys)[1])
        store.slab(tier).page(page)[7] ^= 0x10
        before = host.kv_buffer.clone()
        assert backend.batch_get_v1(keys, slots([8, 9])) == [True, False]
        assert same(page_bytes(host, 8), page_bytes(host, 1)) and same(page_bytes(host, 9), before_page(before, 9))
        assert backend.batch_exists(keys) == 1
        # a pool that fails (a timeout, a dead shard) reads as a miss
        real = backend.pool

        class Failing:
            def __getattr__(self, name):
                return getattr(real, name)

            def load(self, tenant, keys):
                raise TimeoutError("shard did not answer in 5 s")

        backend.pool = Failing()
        assert backend.batch_get_v1(keys, slots([10, 11])) == [False, False]
        assert backend.get(keys[0]) is None and backend.stats()["read_errors"] == 2

    @check("unsupported_host_pools")
    def _():
        host = make_host("page_first", "float32")
        head = MHATokenToKVPoolHost(MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.float32, head_num=H,
                                                     head_dim=D, layer_num=L, device="cpu",
                                                     enable_memory_saver=False)._mha_buffer_info(),
                                    2.0, 0, PAGE, "page_head", pin_memory=False, device="cpu",
                                    device_capacity_tokens=64, start_layer=0, end_layer=L)
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(pool="u")), host)
        try:
            backend.register_mem_pool_host(head)
        except BadRequest as e:
            assert "--hicache-mem-layout" in str(e)
        else:
            raise AssertionError("a page_head host pool was accepted")

    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    _child_main(sys.argv[1])
