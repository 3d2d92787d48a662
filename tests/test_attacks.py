"""Every attack of docs/security.md, tried as an attacker would, on a secured pool: in process
(``LocalPool`` with a pool secret) and on a real 2-node Ray cluster started with one. Each test
asserts the attacker gets nothing (0 chunks read, evicted, poisoned or re-quota'd) and, as the
control, that the victim still gets everything.

The attacker ``mallory`` is a tenant of the pool with her own valid credential; ``alice`` is the
victim. Where the attack needs it, mallory also knows alice's tenant id, her prompts and even her
chunk keys (as if they had leaked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import KVSpec, Tenant, TenantRegistry
from kvpool.auth import Authority, new_secret, scope_tag, scoped
from kvpool.errors import BadRequest, Forbidden, KvPoolError, Unauthorized
from kvpool.keys import Namespace, chunk_keys
from kvpool.pool import LocalPool
from kvpool.seal import SEAL_OVERHEAD

SPEC = KVSpec("attacks/model", 2, 2, 8, dtype="float32", block_size=8, chunk_tokens=8)
TENANTS = [Tenant("alice"), Tenant("mallory"), Tenant("carol", encrypt=True)]
PAGES = 64
SECRET = new_secret()
AUTH = Authority(SECRET)
ALICE, MALLORY, CAROL = AUTH.issue("alice"), AUTH.issue("mallory"), AUTH.issue("carol")
OPERATOR = AUTH.issue("mallory", "operator")  # an operator acting in mallory's account
_prompts = iter(range(10**6))


def prompt(chunks: int = 4) -> np.ndarray:
    base = next(_prompts) * 10_000
    return np.arange(base, base + chunks * SPEC.chunk_tokens + 3)


def kv(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.chunk_shape, generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster_pool():
    from kvpool.cluster.bootstrap import down, up
    from kvpool.cluster.client import PoolClient
    from kvpool.cluster.local import local_cluster
    from kvpool.cluster.pool import ClusterPool

    with local_cluster(2, namespace="kvpool-attacks"):
        up(store={"page_bytes": SPEC.chunk_nbytes + SEAL_OVERHEAD, "dram_pages": PAGES},
           tenants=[{"id": t.id} for t in TENANTS], ttl_s=2.0, secret=SECRET)
        client = PoolClient(timeout_s=5.0)
        yield ClusterPool(SPEC, client, TENANTS)
        client.close()
        down(secret=SECRET)


@pytest.fixture(params=["local", "cluster"])
def pool(request):
    if request.param == "local":
        return LocalPool.create(SPEC, TenantRegistry(list(TENANTS)), PAGES, authority=AUTH)
    return request.getfixturevalue("cluster_pool")


def shards(pool):
    import ray

    from kvpool.cluster.shard import shard_name

    c = pool.client
    return [ray.get_actor(shard_name(c.pool, sid), namespace=c.namespace) for sid in c.shards]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- 1: poisoning
def test_a_tenant_cannot_poison_another_tenants_prompt_even_with_its_keys(pool):
    """Mallory writes poison under alice's keys before alice does: as shared chunks (refused: only
    an operator writes the shared namespace, and alice's own keys never resolve there) and as her
    own (stored in her own scope). Alice's save then stores every chunk, and she loads her bytes."""
    tokens = prompt(4)
    alice_keys = pool.keys(ALICE, tokens)
    poison = kv(4, seed=666)
    with pytest.raises(BadRequest):  # alice's keys are not shared keys
        pool.save(MALLORY, alice_keys, poison, shared=True)
    with pytest.raises(Forbidden, match="only an operator"):
        pool.save(MALLORY, pool.keys(MALLORY, tokens, shared=True), poison, shared=True)
    assert pool.save(MALLORY, alice_keys, poison) == 4  # into mallory's own scope
    truth = kv(4, seed=1)
    assert pool.lookup(ALICE, alice_keys) == 0  # nothing of alice's yet: no squatter resolves
    assert pool.save(ALICE, alice_keys, truth) == 4  # no key skipped because mallory holds it
    assert equal(pool.load(ALICE, alice_keys), truth)
    assert equal(pool.load(MALLORY, alice_keys), poison)  # mallory only ever sees her own


def test_the_shared_namespace_is_written_by_operators_and_never_shadows_a_tenants_own(pool):
    tokens = prompt(2)
    published = kv(2, seed=2)
    assert pool.save(OPERATOR, pool.keys(OPERATOR, tokens, shared=True), published, shared=True) == 2
    assert equal(pool.load(ALICE, pool.keys(ALICE, tokens, shared=True)), published)  # everyone reads it
    assert pool.lookup(ALICE, pool.keys(ALICE, tokens)) == 0  # alice's own namespace: her own chunks only


# ---------------------------------------------------------------------- 2: identity
def test_a_bare_name_or_a_forged_credential_is_refused_by_every_call(pool):
    tokens = prompt(2)
    keys = pool.keys(ALICE, tokens)
    assert pool.save(ALICE, keys, kv(2, seed=3)) == 2
    other = Authority(new_secret())
    forged = [other.issue("alice"), other.issue("alice", "operator"),
              ALICE.replace(".tenant.", ".operator."), ALICE[:-4] + "0000"]
    for who in ["alice", *forged]:
        calls = [lambda w=who: pool.load(w, keys), lambda w=who: pool.begin(w, keys),
                 lambda w=who: pool.save(w, keys, kv(2, seed=4))]
        if who == "alice" or isinstance(pool, LocalPool):  # a client derives keys without the secret
            calls.append(lambda w=who: pool.keys(w, tokens))
        for call in calls:
            with pytest.raises(Unauthorized):
                call()
    if isinstance(pool, LocalPool):  # the cluster client has no secret: the shards refuse these
        for who in forged:
            with pytest.raises(Unauthorized):
                pool.lookup(who, keys)
    assert equal(pool.load(ALICE, keys), kv(2, seed=3))


def test_knowing_a_tenants_id_and_prompt_is_not_enough_to_compute_its_keys(pool):
    tokens = prompt(3)
    real = pool.keys(ALICE, tokens)
    guesses = [chunk_keys(tokens, Namespace.for_spec(SPEC, salt), SPEC.chunk_tokens)
               for salt in (b"alice", b"tenant/alice", Tenant("alice").salt)]
    assert pool.save(ALICE, real, kv(3, seed=5)) == 3
    for g in guesses:
        assert not set(g) & set(real)
        assert pool.lookup(MALLORY, g) == 0 and pool.load(MALLORY, g) == []


def test_leaked_keys_read_nothing_of_another_tenant(pool):
    keys = pool.keys(ALICE, prompt(3))
    assert pool.save(ALICE, keys, kv(3, seed=6)) == 3
    assert pool.lookup(MALLORY, keys) == 0 and pool.load(MALLORY, keys) == []
    assert list(pool.load_views(MALLORY, keys)) == []
    req = pool.begin(MALLORY, keys)  # leases nothing of alice's
    pool.end(req)
    assert pool.lookup(ALICE, keys) == 3 * SPEC.chunk_tokens


def test_a_tenant_cannot_pin_or_evict_another_tenants_chunks_in_process():
    pool = LocalPool.create(SPEC, TenantRegistry(list(TENANTS)), PAGES, authority=AUTH)
    keys = pool.keys(ALICE, prompt(3))
    assert pool.save(ALICE, keys, kv(3, seed=7)) == 3
    with pytest.raises(Forbidden, match="operator"):
        pool.pin(MALLORY, keys)  # pinning is warm-up, an operator's
    assert pool.pin(OPERATOR, keys) == 0  # and the operator's pins in mallory's account reach none of alice's
    assert pool.store.remove_many(pool.addresses(MALLORY, keys), "mallory") == 0
    assert pool.lookup(ALICE, keys) == 3 * SPEC.chunk_tokens


# ---------------------------------------------------------------------- 2: the cluster's own methods
def test_shard_methods_called_directly_need_the_callers_credential(cluster_pool):
    """From another process on the Ray cluster, straight to the shard actors: reads, removes and
    leases under a bare name are refused; with mallory's credential they touch only her scope."""
    import ray

    from kvpool.cluster.messages import Get, LeaseReads, Put, Write

    keys = cluster_pool.keys(ALICE, prompt(4))
    assert cluster_pool.save(ALICE, keys, kv(4, seed=8)) == 4
    raw = [bytes(k) for k in keys]
    read = 0
    for shard in shards(cluster_pool):
        for who in ("alice", Authority(new_secret()).issue("alice")):
            for call in (shard.get.remote(Get(raw, who)), shard.lease_reads.remote(LeaseReads(raw, who, False)),
                         shard.remove.remote(raw, who), shard.begin.remote(raw, who),
                         shard.put.remote(Put(Write(raw[:1], who), [np.zeros(SPEC.chunk_nbytes, np.uint8)]))):
                with pytest.raises(Unauthorized):
                    ray.get(call, timeout=10)
        read += len(ray.get(shard.get.remote(Get(raw, MALLORY)), timeout=10).arrays)
        leased = ray.get(shard.lease_reads.remote(LeaseReads(raw, MALLORY, False)), timeout=10)
        read += sum(p is not None for p in leased.places)
        ray.get(shard.release.remote(leased.hold_id, [], MALLORY), timeout=10)
        assert ray.get(shard.remove.remote(raw, MALLORY), timeout=10) == 0
    assert read == 0
    assert cluster_pool.lookup(ALICE, keys) == 4 * SPEC.chunk_tokens
    assert equal(cluster_pool.load(ALICE, keys), kv(4, seed=8))


def test_another_tenants_holds_and_requests_cannot_be_committed_released_or_ended(cluster_pool):
    import ray

    from kvpool.cluster.messages import Commit, LeaseReads

    keys = cluster_pool.keys(ALICE, prompt(2))
    assert cluster_pool.save(ALICE, keys, kv(2, seed=9)) == 2
    raw = [bytes(k) for k in keys]
    for shard in shards(cluster_pool):
        leased = ray.get(shard.lease_reads.remote(LeaseReads(raw, ALICE, False)), timeout=10)
        rid = ray.get(shard.begin.remote(raw, ALICE), timeout=10)
        # mallory names alice's lease as corrupt, and tries to end alice's request
        ray.get(shard.release.remote(leased.hold_id, raw, MALLORY), timeout=10)
        assert ray.get(shard.end.remote(rid, MALLORY), timeout=10) is False
        with pytest.raises(TypeError):  # no credential, no call
            ray.get(shard.end.remote(rid), timeout=10)
        with pytest.raises(KvPoolError, match="no reservation"):
            ray.get(shard.commit.remote(Commit(leased.hold_id, raw, [0, 0], MALLORY)), timeout=10)
        assert ray.get(shard.end.remote(rid, ALICE), timeout=10) is True
        ray.get(shard.release.remote(leased.hold_id, [], ALICE), timeout=10)
    assert equal(cluster_pool.load(ALICE, keys), kv(2, seed=9))  # nothing dropped


def test_listing_events_quotas_and_drills_need_an_operator(cluster_pool):
    import ray

    from kvpool.cluster.index_actor import ActorIndex

    keys = cluster_pool.keys(ALICE, prompt(2))
    assert cluster_pool.save(ALICE, keys, kv(2, seed=10)) == 2
    for who, err in (("", Unauthorized), ("alice", Unauthorized), (MALLORY, Forbidden)):
        idx = ActorIndex(credential=who, namespace=cluster_pool.client.namespace)
        for call in (idx.events, idx.tenants, lambda i=idx: i.set_quota("alice", 0),
                     lambda i=idx: i.shard_keys(next(iter(cluster_pool.client.shards))),
                     lambda i=idx: i.register_shard("fake", "", 60.0)):
            with pytest.raises(err):
                call()
        for shard in shards(cluster_pool):
            for call in (shard.held.remote(who), shard.inject.remote(5.0, who), shard.drain.remote(who)):
                with pytest.raises(err):
                    ray.get(call, timeout=10)
    op = ActorIndex(credential=AUTH.pool_credential(), namespace=cluster_pool.client.namespace)
    assert {t.id for t in op.tenants()} >= {"alice", "mallory"}  # the operator's control
    assert "fake" not in op.shards()
    assert equal(cluster_pool.load(ALICE, keys), kv(2, seed=10))  # quota untouched, shard not drained


def test_a_shard_is_registered_only_by_the_pools_own_processes(cluster_pool):
    import ray

    from kvpool.cluster.client import PoolClient
    from kvpool.cluster.controller import CONTROLLER

    controller = ray.get_actor(CONTROLLER, namespace=cluster_pool.client.namespace)
    before = ray.get(controller.state.remote(), timeout=10)
    fake = {"node_id": "f" * 56, "slab": None, "page_bytes": 1, "dram_pages": 1}
    for who, err in (("", Unauthorized), (MALLORY, Forbidden), (OPERATOR, Forbidden)):
        with pytest.raises(err):
            ray.get(controller.register.remote("fake", fake, 1.0, who), timeout=10)
        if who != OPERATOR:  # an operator may take a shard out; a tenant or nobody may not
            with pytest.raises(err):
                ray.get(controller.deregister.remote(next(iter(before["shards"])), who), timeout=10)
    after = ray.get(controller.state.remote(), timeout=10)
    assert after["shards"] == before["shards"] and after["version"] == before["version"]
    client = PoolClient(timeout_s=5.0, refresh=False)  # a new client still starts
    assert set(client.shards) == set(before["shards"])
    client.close()


def test_the_scopes_are_what_the_index_lists(cluster_pool):
    """The index lists addresses in the writer's scope, not the keys a prompt derives: a listing
    leaked to another tenant gives nothing its own keys could read."""
    keys = cluster_pool.keys(ALICE, prompt(2))
    assert cluster_pool.save(ALICE, keys, kv(2, seed=11)) == 2
    index = cluster_pool.client.index
    assert index.lookup(keys).count == 0
    assert index.lookup(scoped(keys, scope_tag("alice"))).count == 2
    assert cluster_pool.client.lookup(MALLORY, keys).count == 0


# ---------------------------------------------------------------------- 7: the slab, sealed
def slab_bytes(pool) -> bytes:
    """Everything an attacker on the node reads from the pool's memory: the in-process store's
    slab, or every shard's shared-memory slab file in /dev/shm."""
    if isinstance(pool, LocalPool):
        slab = pool.store.slab("dram")
        return b"".join(slab.page(i).tobytes() for i in range(slab.num_pages))
    out = b""
    for info in pool.client.shards.values():
        with open(info["slab"], "rb") as f:
            out += f.read()
    return out


def test_a_tenant_that_encrypts_leaves_no_plaintext_in_the_pool(pool):
    """Carol seals her payloads (AES-GCM, a key from her credential): her chunks load back bit for
    bit, and the slab an attacker reads holds none of their bytes. Alice does not encrypt: her
    bytes are there in plain text (the control)."""
    tokens = prompt(3)
    mine, theirs = kv(3, seed=12), kv(3, seed=13)
    assert pool.save(CAROL, pool.keys(CAROL, tokens), mine) == 3
    assert pool.save(ALICE, pool.keys(ALICE, tokens), theirs) == 3
    assert equal(pool.load(CAROL, pool.keys(CAROL, tokens)), mine)
    assert equal([v.kv.clone() for v in pool.load_views(CAROL, pool.keys(CAROL, tokens))], mine)
    memory = slab_bytes(pool)
    probe = lambda t: t.reshape(-1)[:16].numpy().tobytes()  # 64 bytes of each chunk  # noqa: E731
    assert sum(probe(c) in memory for c in mine) == 0
    assert sum(probe(c) in memory for c in theirs) == 3


def test_a_sealed_chunk_moved_to_another_key_or_read_by_another_tenant_is_a_miss():
    pool = LocalPool.create(SPEC, TenantRegistry(list(TENANTS)), PAGES, authority=AUTH)
    keys = pool.keys(CAROL, prompt(2))
    assert pool.save(CAROL, keys, kv(2, seed=14)) == 2
    where = pool.addresses(CAROL, keys)
    sealed = pool.store.get_many(where[:1], "carol")[0].copy()
    assert pool.store.remove_many(where[1:], "carol") == 1
    assert pool.store.put(where[1], sealed, "carol", parent=where[0])  # chunk 0's seal under key 1
    assert len(pool.load(CAROL, keys)) == 1  # it fails to open: a miss, never chunk 0's bytes
    assert pool.load(MALLORY, keys) == []


def test_encryption_needs_a_secured_pool():
    pool = LocalPool.create(SPEC, TenantRegistry([Tenant("carol", encrypt=True)]), 4)
    with pytest.raises(BadRequest, match="secured pool"):
        pool.save("carol", pool.keys("carol", prompt(1)), kv(1, seed=15))
