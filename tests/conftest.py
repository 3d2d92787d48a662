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
