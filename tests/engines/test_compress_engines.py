"""Paged engines cannot load a compressed prefix (docs/compression.md): a vLLM or SGLang config
that asks for ``compress`` is refused at construction, naming why and the fix."""

from __future__ import annotations

import pytest
from conftest import IN_CI

from kvpool.errors import BadRequest

COMPRESS = {"compress": {"method": "snapkv", "budget": 512}}


def _need(module: str):
    try:
        return pytest.importorskip(module) if not IN_CI else __import__(module)
    except ImportError as e:  # pragma: no cover - CI runs these with .venv-engines
        pytest.fail(f"{module} is not importable ({e}); run with .venv-engines/bin/python", pytrace=False)


def test_vllm_refuses_compress():
    _need("vllm")
    from kvpool.connectors.vllm_config import split_config

    with pytest.raises(BadRequest, match="vLLM is a paged engine.*cannot load a compressed prefix"):
        split_config(COMPRESS)
    assert split_config({"dram_mib": 8})[0] == {"dram_mib": 8, "backend": "node"}  # it refuses compress only


def test_sglang_refuses_compress():
    _need("sglang")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvpool.connectors.sglang import KVPoolStorage

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="tiny-llama", extra_config={"dram_mib": 1, **COMPRESS})
    with pytest.raises(BadRequest, match="SGLang is a paged engine.*cannot load a compressed prefix"):
        KVPoolStorage(config)
