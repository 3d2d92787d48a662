"""Shared test helpers: small stores and pools built by plain functions."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvpool import ChunkStore, KVSpec, Namespace, StoreConfig, Tenant, TenantRegistry, chunk_keys

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
