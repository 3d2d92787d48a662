"""kvpool as SGLang's HiCache storage backend, through SGLang 0.5.23's own classes.

Two halves:

- In this process: SGLang's ``StorageBackendFactory`` builds the backend from a real
  ``HiCacheStorageConfig`` (``dynamic`` backend, extra config as ``--hicache-storage-backend-extra-
  config`` would give it), and the config and lifecycle errors.
- In a child pytest process (:func:`test_with_sglang_host_pool`): everything that needs SGLang's
  host pool, in ``sglang_child/host_pool_checks.py`` (named so that a plain ``pytest tests/engines``
  never collects it here). A real ``MHATokenToKVPool`` on CPU and a real ``MHATokenToKVPoolHost``
  on top of it, in each supported layout (``layer_first`` fp32, ``page_first`` bf16,
  ``page_first_direct`` fp16), page keys from SGLang's own ``get_storage_hash_str`` (salted with
  ``RadixKey(cache_salt=...)``), and SGLang's own ``HiCacheController`` storage methods
  (``_page_backup``, ``_storage_hit_query``, ``_page_transfer``) driving the backend. The child
  runs ``python -m pytest`` on that module; one test here passes when all of its tests pass, and
  fails with the child's report otherwise.

NOTE: why a child process. ``sglang.srt.mem_cache.memory_pool`` imports SGLang's whole model-
config registry, whose image processors import ``torchvision`` and whose GGUF loader imports
``gguf``. The engines virtualenv has neither (PyPI's torchvision builds break against CPU torch,
see shared/notes/engines.md), and neither is on the KV path. The child loads
``sglang_child/placeholders.py`` as a pytest plugin (``-p``): before collection, it puts a
placeholder module in front of just those two names, and only when they are missing; a
placeholder ``torchvision`` would mislead transformers in a shared process (it checks for it), so
it never enters this pytest process. Everything the checks exercise -- the host pool, its
layouts, the hashing, the controller's storage methods, the factory -- is SGLang's real code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from conftest import IN_CI

HERE = os.path.dirname(os.path.abspath(__file__))
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
    with pytest.raises(BadRequest, match=r"unknown kvpool connector settings 'dram_gib' \(did you mean 'dram_mib'\?\)"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(dram_gib=1)), None)
    with pytest.raises(BadRequest, match=r"'prefetch_treshold' \(did you mean 'prefetch_threshold'\?\)"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(prefetch_treshold=1)), None)
    with pytest.raises(BadRequest, match="not among the pool's tenants"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(tenant="mallory")), None)
    with pytest.raises(BadRequest, match="MLA"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(), is_mla=True), None)


def test_the_backend_names_the_weights_and_refuses_what_it_cannot_serve(tmp_path):
    """Keys carry the checkpoint's content: the folder SGLang serves is fingerprinted like the
    transformers connector does it, once SGLang has loaded it (here: noted as SGLang's scheduler
    process would be, by its start); a checkpoint rewritten in place after loading is refused, and
    gets another fingerprint once loaded again; a model that is no folder needs ``model_weights``;
    sliding-window models are refused."""
    from tinymodel import save_tiny_llama

    from kvpool.connectors.families import UnsupportedModel
    from kvpool.connectors.sglang import model_identity
    from kvpool.connectors.weights import files_fingerprint, note_loading
    from kvpool.errors import BadRequest

    folder = save_tiny_llama(tmp_path / "m", seed=0)
    with pytest.raises(BadRequest, match="changed after this engine process started"):
        model_identity(folder, None)  # written after this process started, never noted as loaded
    note_loading(folder)
    first, kinds, scope = model_identity(folder, None)
    assert first == files_fingerprint(folder) and kinds == ("full", "full") and scope == ""  # Llama: shared
    save_tiny_llama(tmp_path / "m", seed=1)  # another checkpoint, same name and shape, same folder
    with pytest.raises(BadRequest, match="changed after this engine began loading it"):
        model_identity(folder, None)
    note_loading(folder)
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


CHILD = os.path.join(HERE, "sglang_child", "host_pool_checks.py")


def test_with_sglang_host_pool(tmp_path):
    """Runs pytest on ``sglang_child/host_pool_checks.py`` in a child process of this interpreter,
    from this folder (so ``-p sglang_child.placeholders`` and ``test_sglang`` import there)."""
    report = tmp_path / "child.xml"
    cmd = [sys.executable, "-m", "pytest", CHILD, "-q", "-p", "sglang_child.placeholders",
           "-p", "no:cacheprovider", f"--junitxml={report}"]
    proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600)
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    if report.exists():
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    summary = (f"{passed} of {counts['tests']} passed, {counts['failures']} failed, {counts['errors']} errors, "
               f"{counts['skipped']} skipped")
    # a skip would hide a check (an empty parametrization, a missing import): the child skips nothing
    if proc.returncode != 0 or passed == 0 or passed != counts["tests"]:
        pytest.fail(f"the SGLang child pytest failed (rc {proc.returncode}; {summary}):\n"
                    f"$ {' '.join(cmd)}\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}", pytrace=False)
    print(f"SGLang child: {summary}")
