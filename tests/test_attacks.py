"""Every attack of docs/security.md, tried as an attacker would, on a secured pool: in process
(``LocalPool`` with a pool secret) and on a real 2-node pool started with one (engines' side:
``NodePool``, through each node's socket). Each test
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
def cluster(tmp_path_factory):
    from conftest import cluster_pool

    with cluster_pool(str(tmp_path_factory.mktemp("run")), 2, "kvpool-attacks",
                      store={"page_bytes": SPEC.chunk_nbytes + SEAL_OVERHEAD, "dram_pages": PAGES},
                      tenants=[{"id": t.id} for t in TENANTS], ttl_s=2.0, secret=SECRET) as cp:
        yield cp


@pytest.fixture(scope="module")
def node_pool(cluster):
    from kvpool.node.pool import NodePool

    client = cluster.client(timeout_s=5.0)
    yield NodePool(SPEC, client, TENANTS)
    client.close()


@pytest.fixture(params=["local", "cluster"])
def pool(request):
    if request.param == "local":
        return LocalPool.create(SPEC, TenantRegistry(list(TENANTS)), PAGES, authority=AUTH)
    return request.getfixturevalue("node_pool")


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


# ---------------------------------------------------------------------- 2: the shards' own operations
def engine_ops(who: str, raw: list[bytes]) -> list:
    from kvpool.node import messages as m

    return [m.Lookup(who, raw), m.Get(who, raw), m.Begin(who, raw), m.Pin(who, raw), m.Verify(who, raw),
            m.Reserve(who, raw[:1], sizes=[SPEC.chunk_nbytes]), m.End(who, {"x": 1}), m.Commit(who, 1, raw[:1], [0]),
            m.Abort(who, 1)]


def test_every_operation_on_a_nodes_socket_needs_the_callers_credential(cluster, node_pool):
    """Straight to each node's socket, as any process of the node could: every operation under a
    bare name or a forged credential is refused; with mallory's own credential it reads, leases,
    pins and drops nothing of alice's."""
    from kvpool.node import messages as m

    keys = node_pool.keys(ALICE, prompt(4))
    assert node_pool.save(ALICE, keys, kv(4, seed=8)) == 4
    raw = [bytes(k) for k in keys]
    for which in range(2):
        c = cluster.client(which, timeout_s=5.0)
        try:
            for who in ("alice", Authority(new_secret()).issue("alice")):
                for msg in engine_ops(who, raw):
                    with pytest.raises(Unauthorized):
                        c.call(msg)
                with pytest.raises(Unauthorized):
                    c.call(m.Put(who, raw[:1]), [np.zeros(SPEC.chunk_nbytes, np.uint8)])
            assert c.call(m.Lookup(MALLORY, raw))[0]["count"] == 0
            assert c.call(m.Get(MALLORY, raw))[0]["count"] == 0
            assert c.call(m.Verify(MALLORY, raw))[0] == 0
            assert c.call(m.Begin(MALLORY, raw))[0]["count"] == 0
        finally:
            c.close()
    assert node_pool.lookup(ALICE, keys) == 4 * SPEC.chunk_tokens
    assert equal(node_pool.load(ALICE, keys), kv(4, seed=8))


def test_another_tenants_holds_and_requests_cannot_be_committed_aborted_or_ended(cluster, node_pool):
    import ray

    from kvpool.node import messages as m

    keys = node_pool.keys(ALICE, prompt(2))
    assert node_pool.save(ALICE, keys, kv(2, seed=9)) == 2
    raw = [bytes(k) for k in keys]
    c = node_pool.client
    fresh = [bytes(k) for k in node_pool.keys(ALICE, prompt(1))]
    hold = c.call(m.Reserve(ALICE, fresh, sizes=[SPEC.chunk_nbytes]))[0]["hold"]
    req = c.call(m.Begin(ALICE, raw))[0]["requests"]
    active = lambda: ray.get(cluster.actor(0).stats.remote(), timeout=10)["active_requests"]  # noqa: E731
    assert active() >= 1
    c.call(m.End(MALLORY, req))  # mallory ends alice's request: nothing ends
    assert active() >= 1
    with pytest.raises(KvPoolError, match="no reservation"):
        c.call(m.Commit(MALLORY, hold, fresh, [0]))
    c.call(m.Abort(MALLORY, hold))  # silently nothing
    assert c.call(m.Verify(MALLORY, raw))[0] == 0  # her "corrupt" report reaches her own scope only
    c.call(m.End(ALICE, req))
    c.call(m.Abort(ALICE, hold))
    assert equal(node_pool.load(ALICE, keys), kv(2, seed=9))  # nothing dropped


def test_listing_events_quotas_and_drills_need_an_operator(cluster, node_pool):
    import ray

    from kvpool.cluster.index_actor import ActorIndex

    keys = node_pool.keys(ALICE, prompt(2))
    assert node_pool.save(ALICE, keys, kv(2, seed=10)) == 2
    for who, err in (("", Unauthorized), ("alice", Unauthorized), (MALLORY, Forbidden)):
        idx = ActorIndex(credential=who, namespace=cluster.namespace)
        for call in (idx.events, idx.tenants, lambda i=idx: i.set_quota("alice", 0),
                     lambda i=idx: i.shard_keys(cluster.head),
                     lambda i=idx: i.register_shard("fake", "", 60.0)):
            with pytest.raises(err):
                call()
        for sid in cluster.shards:
            shard = cluster.actor(sid)
            for call in (shard.held.remote(who), shard.inject.remote(5.0, who), shard.drain.remote(who)):
                with pytest.raises(err):
                    ray.get(call, timeout=10)
    op = ActorIndex(credential=AUTH.pool_credential(), namespace=cluster.namespace)
    assert {t.id for t in op.tenants()} >= {"alice", "mallory"}  # the operator's control
    assert "fake" not in op.shards()
    assert equal(node_pool.load(ALICE, keys), kv(2, seed=10))  # quota untouched, shard not drained


def test_a_shard_is_registered_only_by_the_pools_own_processes(cluster, node_pool):
    import ray

    controller = cluster.controller()
    before = ray.get(controller.state.remote(), timeout=10)
    fake = {"node_id": "f" * 56, "slab": None, "page_bytes": 1, "dram_pages": 1, "peer": "127.0.0.1:1"}
    for who, err in (("", Unauthorized), (MALLORY, Forbidden), (OPERATOR, Forbidden)):
        with pytest.raises(err):
            ray.get(controller.register.remote("fake", fake, who), timeout=10)
        if who != OPERATOR:  # an operator may take a shard out; a tenant or nobody may not
            with pytest.raises(err):
                ray.get(controller.deregister.remote(cluster.head, who), timeout=10)
    after = ray.get(controller.state.remote(), timeout=10)
    assert after["shards"] == before["shards"] and after["version"] == before["version"]
    keys = node_pool.keys(ALICE, prompt(1))
    assert node_pool.save(ALICE, keys, kv(1, seed=16)) == 1  # the pool still serves
    assert equal(node_pool.load(ALICE, keys), kv(1, seed=16))


def test_a_lookup_needs_the_callers_credential_even_with_leaked_keys(pool):
    """No hit/miss oracle: a bare name or a forged credential with alice's real keys is a 401, and
    mallory's own credential with them looks in her own scope (a miss, as on a prompt nobody sent)."""
    keys = pool.keys(ALICE, prompt(2))
    assert pool.save(ALICE, keys, kv(2, seed=30)) == 2
    for who in ("alice", Authority(new_secret()).issue("alice"), ALICE[:-4] + "0000"):
        with pytest.raises(Unauthorized):
            pool.lookup(who, keys)
    assert pool.lookup(MALLORY, keys) == 0
    assert pool.lookup(ALICE, keys) > 0


def test_shared_chunks_a_tenant_calls_corrupt_are_checked_again_not_dropped(cluster, node_pool):
    """A tenant's report of a bad chunk (the socket's verify) drops only what fails the shard's own
    check: shared chunks others read stay."""
    from kvpool.node import messages as m

    tokens = prompt(2)
    published = kv(2, seed=31)
    assert node_pool.save(OPERATOR, node_pool.keys(OPERATOR, tokens, shared=True), published, shared=True) == 2
    for k in node_pool.keys(MALLORY, tokens, shared=True):
        assert node_pool.client.call(m.Verify(MALLORY, [bytes(k)], True))[0] == 0
    assert equal(node_pool.load(ALICE, node_pool.keys(ALICE, tokens, shared=True)), published)


def test_an_actor_under_a_shards_name_is_not_adopted(cluster, node_pool):
    """A fake shard: an entry in the index (as an attacker with write access to Redis makes) and a
    named Ray actor that answers. The controller adopts only an actor that proves it holds the
    pool secret, so no write is ever sent to it; after a few passes its listing is purged."""
    import time

    import ray

    from kvpool.cluster.index_actor import ActorIndex
    from kvpool.cluster.shard import shard_name

    @ray.remote(num_cpus=0)
    class Impostor:
        def info(self, challenge=""):
            return {"node_id": "f" * 56, "slab": None, "page_bytes": 1 << 20, "dram_pages": 64,
                    "incarnation": "x", "peer": "127.0.0.1:9", "proof": "0" * 64}

    fake = "node-impostor"
    h = Impostor.options(name=shard_name("default", fake), namespace=cluster.namespace).remote()
    try:
        ray.get(h.info.remote(), timeout=30)
        index = ActorIndex(credential=AUTH.pool_credential(), namespace=cluster.namespace)
        index.register_shard(fake, "f" * 56, 60.0)
        controller = cluster.controller()
        time.sleep(4.0)  # several controller passes
        assert fake not in ray.get(controller.state.remote(), timeout=10)["shards"]
        keys = node_pool.keys(ALICE, prompt(3))
        assert node_pool.save(ALICE, keys, kv(3, seed=32)) == 3
        assert equal(node_pool.load(ALICE, keys), kv(3, seed=32))
    finally:
        ray.kill(h)


def test_the_scopes_are_what_the_index_lists(cluster, node_pool):
    """The index lists addresses in the writer's scope, not the keys a prompt derives: a listing
    leaked to another tenant gives nothing its own keys could read."""
    from conftest import wait_for

    from kvpool.cluster.index_actor import ActorIndex

    keys = node_pool.keys(ALICE, prompt(2))
    assert node_pool.save(ALICE, keys, kv(2, seed=11)) == 2
    index = ActorIndex(credential=AUTH.pool_credential(), namespace=cluster.namespace)
    wait_for(lambda: index.lookup(scoped(keys, scope_tag("alice"))).count == 2, 10, what="alice's chunks listed")
    assert index.lookup(keys).count == 0
    assert node_pool.client.lookup(MALLORY, keys).count == 0


# ---------------------------------------------------------------------- 7: the slab, sealed
def slab_bytes(pool) -> bytes:
    """Everything an attacker on the node reads from the pool's memory: the in-process store's
    slab, or every shard's shared-memory slab file in /dev/shm."""
    if isinstance(pool, LocalPool):
        slab = pool.store.slab("dram")
        return b"".join(slab.page(i).tobytes() for i in range(slab.num_pages))
    import glob
    import json

    out = b""
    for path in glob.glob(f"{pool.client.directory}/kvpool-default-*.node"):  # every shard's
        with open(path) as f, open(json.load(f)["slab"], "rb") as slab:
            out += slab.read()
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
