"""The SGLang checks that need its host pool; collected only in the child pytest process that
``tests/engines/test_sglang.py::test_with_sglang_host_pool`` starts (the module docstring there
says why a child). By hand, from ``tests/engines``::

    ../../.venv-engines/bin/python -m pytest -p sglang_child.placeholders sglang_child/host_pool_checks.py

A real ``MHATokenToKVPool`` on CPU and a real ``MHATokenToKVPoolHost`` on top of it, in each
supported layout (``layer_first`` fp32, ``page_first`` bf16, ``page_first_direct`` fp16), page keys
from SGLang's own ``get_storage_hash_str`` (salted with ``RadixKey(cache_salt=...)``), and SGLang's
own ``HiCacheController`` storage methods (``_page_backup``, ``_storage_hit_query``,
``_page_transfer``) driving the backend.
"""

from __future__ import annotations

# first, before anything imports SGLang (already loaded when run with -p sglang_child.placeholders)
from sglang_child import placeholders  # noqa: F401

# isort: split
import logging
import queue

import pytest
import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from test_sglang import LAYOUTS, PAGE, extra_config, storage_config

from kvpool.connectors.pools import close_local_pools
from kvpool.connectors.sglang import KVPoolStorage
from kvpool.errors import BadRequest, UnknownTenant
from kvpool.kernels.layouts import sglang_layout
from kvpool.kernels.paged import gather

logging.disable(logging.WARNING)  # SGLang warns about CPU kernels; the backend about misses

L, H, D = 3, 2, 8
GEN = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def _close_pools():
    yield
    close_local_pools()


def make_host(layout, dtype=None, heads=H):
    dtype = getattr(torch, dtype or LAYOUTS[layout])
    device_pool = MHATokenToKVPool(size=64, page_size=PAGE, dtype=dtype, head_num=heads, head_dim=D, layer_num=L,
                                   device="cpu", enable_memory_saver=False)
    host = MHATokenToKVPoolHost(device_pool._mha_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=L)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=GEN).to(dtype))
    return host


def make_backend(host, pool, tp=(0, 1), **extra):
    """As SGLang's cache controller does it: the factory, then register_mem_pool_host."""
    cfg = storage_config(extra_config(pool=pool, **extra), layout=host.layout, tp=tp)
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


def before_page(before, page):
    return before[:, page * PAGE:(page + 1) * PAGE].flatten()  # page_first: (2, size, L, H, D)


# ---------------------------------------------------------------------------------------------
# In each layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_factory_and_register(layout):
    host = make_host(layout)
    cfg = storage_config(extra_config(pool="f"), layout=layout)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert type(backend) is KVPoolStorage and cfg.extra_config["interface_v1"] == 1
    backend.register_mem_pool_host(host)
    assert backend.page_size == PAGE and backend.spec.chunk_tokens == PAGE
    assert backend.spec.chunk_shape == (L, 2, PAGE, H, D) and backend.spec.dtype == LAYOUTS[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_roundtrip(layout):
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_exists_leading_run(layout):
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_roundtrip(layout):
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_any_slots(layout):
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_misses(layout):
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_input(layout):
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
        (lambda: backend.batch_exists(keys, HiCacheStorageExtraInfo(extra_info=["kvpool_secret"])),
         "must be a dict"),
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


# ---------------------------------------------------------------------------------------------
# Across layouts, tenants and salts; SGLang's controller; failures


def test_layouts_share_pages():
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


def test_concurrent_requests_keep_their_own_pages():
    """Two requests that share their first page, backed up and prefetched at once from two threads
    (SGLang's backup and prefetch threads call the backend concurrently), then one batch mixing
    both requests' pages: every key reads back its own request's bytes, wherever it sits in a
    batch (a page key names its whole prefix; nothing is read by position across requests)."""
    import threading

    host = make_host("page_first", "float32")
    backend = make_backend(host, "concurrent")
    first = list(range(1000, 1000 + PAGE))
    keys = {r: get_storage_hash_str(RadixKey(first + list(range(5000 + 1000 * i, 5000 + 1000 * i + 3 * PAGE))),
                                    None, page_size=PAGE) for i, r in enumerate("ab")}
    assert keys["a"][0] == keys["b"][0] and not set(keys["a"][1:]) & set(keys["b"][1:])
    src = {"a": [1, 2, 3, 4], "b": [1, 5, 6, 7]}  # the shared first page is one host page
    dst = {"a": [10, 11, 12, 13], "b": [20, 21, 22, 23]}
    want = {k: page_bytes(host, p) for r in "ab" for k, p in zip(keys[r], src[r])}
    errors = []

    def serve(r):
        try:
            for _ in range(20):
                assert backend.batch_set_v1(keys[r], slots(src[r])) == [True] * 4
                assert backend.batch_get_v1(keys[r], slots(dst[r])) == [True] * 4
                for k, p in zip(keys[r], dst[r]):
                    assert same(page_bytes(host, p), want[k]), (r, p)
        except AssertionError as e:  # reported below: an assert in a thread fails nothing by itself
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(r,)) for r in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    mixed = [keys["b"][2], keys["a"][1], keys["b"][3], keys["a"][3]]
    assert backend.batch_get_v1(mixed, slots([24, 25, 26, 27])) == [True] * 4
    assert all(same(page_bytes(host, p), want[k]) for k, p in zip(mixed, [24, 25, 26, 27]))
    assert backend.batch_exists(keys["a"] + keys["b"]) == 8


def test_tenant_isolation_salt_in_extra_info():
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


BOB_SECRET = "bob-request-secret-0123"


def test_tenant_isolation_tenants():
    host = make_host("page_first")
    tenants = ["alice", {"id": "bob", "request_secret": BOB_SECRET}]
    alice = make_backend(host, "t", tenants=tenants, tenant="alice")
    bob = make_backend(host, "t", tenants=tenants, tenant="bob")
    keys = page_keys(2)
    assert alice.batch_set_v1(keys, slots([1, 2])) == [True, True]
    assert alice.batch_exists(keys) == 2
    assert bob.batch_exists(keys) == 0 and bob.batch_get_v1(keys, slots([3, 4])) == [False, False]
    as_bob = HiCacheStorageExtraInfo(extra_info={"kvpool_secret": BOB_SECRET})
    assert alice.batch_exists(keys, as_bob) == 0  # bob's secret: bob's namespace, through alice's backend too
    # the same key under another tenant is another chunk; the pool keeps both
    assert alice.batch_set_v1(keys, slots([5, 6]), as_bob) == [True, True]
    assert bob.batch_exists(keys) == 2 and alice.batch_get_v1(keys, slots([7, 8])) == [True, True]
    assert same(page_bytes(host, 7), page_bytes(host, 1)) and not same(page_bytes(host, 7), page_bytes(host, 5))


def test_requests_name_no_tenant_and_unknown_secrets_are_not_cached():
    host = make_host("page_first")
    tenants = ["alice", {"id": "bob", "request_secret": BOB_SECRET}]
    backend = make_backend(host, "n", tenants=tenants, tenant="alice")
    keys, other = page_keys(2), page_keys(2, start=10)
    as_bob = HiCacheStorageExtraInfo(extra_info={"kvpool_secret": BOB_SECRET})
    assert backend.batch_set_v1(keys, slots([1, 2]), as_bob) == [True, True]
    # naming bob is ignored: the call is alice's (the default), which holds nothing of bob's
    named = HiCacheStorageExtraInfo(extra_info={"tenant": "bob"})
    assert backend.batch_exists(keys, named) == 0 and backend.batch_get_v1(keys, slots([3, 4]), named) == [False] * 2
    assert backend.batch_set_v1(other, slots([5, 6]), named) == [True, True]  # written as alice
    assert backend.batch_exists(other) == 2 and backend.batch_exists(other, as_bob) == 0
    # a secret that is nobody's (a guess, bob's name): not cached at all, neither read nor written
    for guess in ("bob", BOB_SECRET[:-1] + "x"):
        wrong = HiCacheStorageExtraInfo(extra_info={"kvpool_secret": guess})
        assert backend.batch_exists(keys, wrong) == 0 and backend.get(keys[0], extra_info=wrong) is None
        assert backend.batch_get_v1(keys, slots([3, 4]), wrong) == [False, False]
        fresh = page_keys(2, start=20)
        assert backend.batch_set_v1(fresh, slots([7, 8]), wrong) == [False, False]
        assert backend.batch_set(fresh, [host.get_data_page(7 * PAGE), host.get_data_page(8 * PAGE)],
                                 extra_info=wrong) is False
        assert backend.batch_exists(fresh) == 0 and backend.batch_exists(fresh, as_bob) == 0
    st = backend.stats()
    assert st["ignored_tenant_name"] == 3 and st["rejected_credential"] == 2 * 5  # five calls per guess
    assert BOB_SECRET not in str(st)


def test_a_secured_pool_serves_the_request_secrets_of_credentials(tmp_path):
    from kvpool.auth import Authority, new_secret, request_secret

    secret = new_secret()
    (tmp_path / "secret").write_text(secret)
    (tmp_path / "secret").chmod(0o600)
    auth = Authority(secret)
    host = make_host("page_first")
    backend = make_backend(host, "sec", tenants=["alice", "bob"], tenant="alice", secret_file=str(tmp_path / "secret"))
    assert backend.pool.auth.secured and backend.tenancy.default.pool_as == auth.issue("alice")
    keys = page_keys(2)
    as_bob = HiCacheStorageExtraInfo(extra_info={"kvpool_secret": request_secret(auth.issue("bob"))})
    assert backend.batch_set_v1(keys, slots([1, 2]), as_bob) == [True, True]
    assert backend.batch_exists(keys, as_bob) == 2 and backend.batch_exists(keys) == 0
    forged = HiCacheStorageExtraInfo(extra_info={"kvpool_secret": request_secret(Authority(new_secret()).issue("bob"))})
    assert backend.batch_exists(keys, forged) == 0 and backend.stats()["rejected_credential"] == 1


def test_tenant_isolation_sglang_salted_hashes():
    # SGLang 0.5.23 seeds a salted request's page chain with its salt: salted requests reach
    # the backend with other keys, and never meet in the pool
    host = make_host("page_first")
    backend = make_backend(host, "h")
    plain, a, b = page_keys(3), page_keys(3, salt="A"), page_keys(3, salt="B")
    assert len({*plain, *a, *b}) == 9
    assert backend.batch_set_v1(a, slots([1, 2, 3])) == [True] * 3
    assert backend.batch_exists(a) == 3 and backend.batch_exists(b) == 0 and backend.batch_exists(plain) == 0


def test_controller_backup_and_prefetch():
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


def test_failures_are_misses_or_false():
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
    tier, page = store.locate(backend.pool.addresses(backend.tenant, backend.chunk_keys(keys))[1][-1])  # a slice
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


def test_unsupported_host_pools():
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


# ---------------------------------------------------------------------------------------------
# Tensor parallel: pages any TP size reads


@pytest.mark.parametrize("writer,reader", [(1, 2), (2, 1)])
def test_pages_saved_at_one_tp_size_load_at_another(writer, reader):
    """Each rank stores its heads' slices of a page, keyed without its TP rank or size: a reader at
    another TP size finds every page and reads back exactly its heads; a page one rank of the
    writer did not store is a miss for every reader."""
    layout, kvl = "page_first", sglang_layout("page_first")
    hosts = {tp: [make_host(layout, heads=H // tp) for _ in range(tp)] for tp in (1, 2)}
    backends = {tp: [make_backend(h, "tp", tp=(r, tp)) for r, h in enumerate(hosts[tp])] for tp in (1, 2)}
    assert backends[1][0].spec.fingerprint() == backends[2][1].spec.fingerprint()  # no TP in the keys
    keys = page_keys(3, start=40 + writer)
    whole = gather(hosts[1][0].kv_buffer, slots([1, 2, 3]), kvl) if writer == 1 else torch.cat(
        [gather(h.kv_buffer, slots([1, 2, 3]), kvl) for h in hosts[2]], dim=-2)  # [L, 2, T, H, D]
    for i, b in enumerate(backends[writer]):
        if i == len(backends[writer]) - 1:  # before the writer's last rank saves: no page is whole
            assert all(r.batch_exists(keys) == 0 for r in backends[reader])
        assert b.batch_set_v1(keys, slots([1, 2, 3])) == [True] * 3  # this rank's part of each page is stored
    for r, (host, b) in enumerate(zip(hosts[reader], backends[reader])):
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, slots([10, 11, 12])) == [True] * 3
        per = H // reader
        assert torch.equal(gather(host.kv_buffer, slots([10, 11, 12]), kvl), whole[..., r * per:(r + 1) * per, :])
