"""The transformers connector on a secured pool: requests act with a tenant's credential, a
tenant's prefix never loads for another, and a tenant's shared prefill reads what an operator
published but cannot publish itself (the save is refused and counted, the request still served)."""

from __future__ import annotations

import torch

from kvpool import Tenant, TenantRegistry
from kvpool.auth import Authority, new_secret
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import model_spec, tiny_llama
from kvpool.pool import LocalPool

CHUNK = 32
AUTH = Authority(new_secret())


def test_a_secured_pool_serves_each_credential_its_own_prefixes_and_operators_the_shared_ones():
    model = tiny_llama(0)
    spec = model_spec(model, model_id="test/tiny-llama-auth", chunk_tokens=CHUNK)
    pool = LocalPool.create(spec, TenantRegistry([Tenant("alice"), Tenant("mallory")]), 64, authority=AUTH)
    alice, mallory, operator = AUTH.issue("alice"), AUTH.issue("mallory"), AUTH.issue("alice", "operator")
    conn = HFConnector(model, pool, tenant=alice)
    ids = torch.randint(0, 1024, (1, 3 * CHUNK + 5), generator=torch.Generator().manual_seed(1))
    full = model(input_ids=ids).logits
    assert conn.prefill(ids).saved_chunks == 3
    warm = conn.prefill(ids)
    assert warm.loaded_tokens == 3 * CHUNK
    assert (warm.logits[0, -1] - full[0, -1]).abs().max() < 1e-4 * full.abs().max()
    assert conn.prefill(ids, tenant=mallory).loaded_tokens == 0  # mallory's own namespace

    system = torch.randint(0, 1024, (1, 2 * CHUNK + 1), generator=torch.Generator().manual_seed(2))
    refused = conn.save_refused
    assert conn.prefill(system, tenant=mallory, shared=True).saved_chunks == 0  # a tenant cannot publish
    assert conn.save_refused == refused + 1
    assert conn.prefill(system, tenant=operator, shared=True).saved_chunks == 2  # the operator can
    assert conn.prefill(system, tenant=mallory, shared=True).loaded_tokens == 2 * CHUNK  # everyone reads it
    pool.store.close()
