"""Bad input, generated: every malformed call gets a typed error with its HTTP-style status and a
message that names the fix, and changes nothing (store stats, metrics, leases, index contents).

Property-based (hypothesis) over the public API: keys and tokens, KVSpec, Tenant, StoreConfig,
ChunkStore, LocalPool, and the index contract on both implementations (embedded and Redis),
including garbage where entries are decoded from msgpack. The CLI has its own file
(test_bad_input_cli.py).
"""

from __future__ import annotations

import math
import re
import uuid

import msgpack
import numpy as np
import pytest
import torch
from conftest import make_keys, make_store, payload, snapshot
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvpool import (
    BadRequest,
    ChunkKey,
    ChunkStore,
    ChunkTooLarge,
    KvPoolError,
    KVSpec,
    LayoutMismatch,
    Namespace,
    QuotaExceeded,
    StoreConfig,
    Tenant,
    TenantRegistry,
    UnknownTenant,
    chunk_keys,
)
from kvpool.index import EmbeddedIndex, IndexEntry
from kvpool.index.redis_index import RedisIndex
from kvpool.keys import as_keys, tokens_le_int32
from kvpool.policies import policy_names
from kvpool.pool import LocalPool
from kvpool.spec import DEFAULT_HIGH_WATERMARK, DTYPE_BYTES, STORAGE_FORMATS

# Deterministic for CI: the same examples on every run and machine. The fixtures hold state that
# a bad call must leave as it was, so they are shared by the examples on purpose.
BAD = settings(max_examples=80, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FEW = settings(BAD, max_examples=25)

SPEC = KVSpec("test/tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4, chunk_tokens=4)
NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")

# ------------------------------------------------------------------ strategies

# Anything a confused caller might pass where a specific type belongs.
junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.binary(max_size=24), st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.just(object()),
)
not_int = junk.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
# Malformed chunk keys: bare bytes of any length (16 included: bytes are not keys), text, numbers...
bad_key = st.one_of(st.binary(max_size=40), st.text(max_size=40), st.integers(), st.none(), st.floats(),
                    st.lists(st.integers(0, 255), min_size=16, max_size=16))
bad_name = st.one_of(
    st.text(max_size=20).filter(lambda s: not NAME.fullmatch(s)),
    st.sampled_from(["a\n", "a b", "a/b", "", "é"]),
    st.text(alphabet="abc", min_size=129, max_size=300),  # over-long
    junk.filter(lambda v: not isinstance(v, str)),
)
not_a_class = junk.filter(lambda v: v not in ("low", "normal", "high"))
unknown_tenant = st.from_regex(r"[a-z][a-z0-9_-]{0,20}", fullmatch=True).filter(lambda t: t not in ("a", "b"))


def rejects(fn, exc=BadRequest, status=400, hint=None) -> KvPoolError:
    """Calls ``fn``, which must raise ``exc`` (a kvpool error, never a bare TypeError/ValueError)
    with ``status`` and, when given, a message matching ``hint`` (the fix it names)."""
    with pytest.raises(KvPoolError) as info:
        fn()
    err = info.value
    assert isinstance(err, exc), f"{type(err).__name__} is not {exc.__name__}: {err}"
    assert err.status == status, err
    if hint is not None:
        assert re.search(hint, err.message), f"{err.message!r} does not match {hint!r}"
    return err


def store_state(store):
    """Everything a rejected call must leave unchanged, the 429 counter aside (a 429 is counted)."""
    st_ = store.stats()
    metrics = {k: v for k, v in st_["metrics"].items() if k != "rejected_quota"}
    return (snapshot(store), metrics, st_["policy_stats"], list(store._cache.res.leases),
            sorted(store._holds), sorted(store._active))


def a_pool(dram_chunks=6, **config):
    return LocalPool.create(SPEC, TenantRegistry([Tenant("a"), Tenant("b", quota_bytes=2 * SPEC.chunk_nbytes)]),
                            dram_chunks, policy="lru", **config)


def chunk(seed=0):
    return torch.randn(SPEC.chunk_shape, generator=torch.Generator().manual_seed(seed))


def filled_pool():
    """A pool holding a 2-chunk prompt of tenant a, with its keys and a third key not stored."""
    pool = a_pool()
    keys = pool.keys("a", np.arange(3 * SPEC.chunk_tokens))
    assert pool.save("a", keys[:2], [chunk(0), chunk(1)]) == 2
    return pool, keys


# ------------------------------------------------------------------ keys and tokens


@BAD
@given(raw=bad_key)
def test_malformed_chunk_keys_are_400_and_name_from_hex(raw):
    if isinstance(raw, bytes) and len(raw) == 16:
        ChunkKey(raw)  # 16 bytes make a key...
        rejects(lambda: as_keys([raw]), hint="ChunkKey.from_hex|chunk_keys")  # ...but bare bytes pass for none
        return
    rejects(lambda: ChunkKey(raw), hint="16 bytes|from_hex")
    rejects(lambda: as_keys([raw]), hint="ChunkKey.from_hex|chunk_keys")


@BAD
@given(text=st.one_of(st.text(max_size=40), junk))
def test_from_hex_takes_32_hex_digits_or_says_so(text):
    if isinstance(text, str) and re.fullmatch(r"\s*([0-9a-fA-F]{2}\s*){16}", text):
        assert len(ChunkKey.from_hex(text)) == 16
        return
    rejects(lambda: ChunkKey.from_hex(text), hint="hex digits|16 bytes")


@BAD
@given(keys=st.one_of(junk.filter(lambda v: not isinstance(v, (list, dict))), st.just(make_keys(1)[0])))
def test_a_key_list_that_is_not_a_list_is_400(keys):
    hint = "sequence of ChunkKeys|expected a ChunkKey"
    rejects(lambda: as_keys(keys), hint=hint)


bad_tokens = st.one_of(
    st.lists(st.integers(-(2**40), -1), min_size=1, max_size=8),  # negative ids
    st.lists(st.integers(2**31, 2**63 - 1), min_size=1, max_size=8),  # past int32
    st.lists(st.integers(2**64, 2**80), min_size=1, max_size=4),  # not even int64
    st.lists(st.floats(allow_nan=True), min_size=1, max_size=8),
    st.lists(st.booleans(), min_size=1, max_size=8),
    st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=4),
    st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=2, max_size=4),  # 2-D or ragged
    st.none(), st.integers(), st.text(min_size=1), st.floats(),
    st.builds(lambda n: torch.rand(n), st.integers(1, 8)),  # float tensor
    st.builds(lambda n: np.zeros((n, 2), dtype=np.int32), st.integers(1, 4)),  # 2-D array
)


@BAD
@given(tokens=bad_tokens)
def test_bad_tokens_are_400_and_change_nothing(tokens):
    pool, _ = filled_pool()
    before = store_state(pool.store)
    hint = "token ids must|tokens must be (1-D|integer ids|a flat sequence)"
    rejects(lambda: tokens_le_int32(tokens), hint=hint)
    rejects(lambda: pool.keys("a", tokens), hint=hint)
    assert store_state(pool.store) == before


@BAD
@given(ct=st.one_of(st.integers(-(2**40), 0), st.floats(allow_nan=True), st.booleans(), st.none(), st.text()))
def test_chunk_tokens_must_be_a_positive_int(ct):
    ns = Namespace.for_spec(SPEC, b"salt")
    rejects(lambda: chunk_keys(list(range(16)), ns, ct), hint="chunk_tokens must be a positive int")


@BAD
@given(field=st.sampled_from(["tenant_salt", "spec_fingerprint", "adapter_id", "extra_keys"]), value=junk)
def test_a_namespace_of_the_wrong_types_is_400(field, value):
    ok = {"tenant_salt": b"s", "spec_fingerprint": SPEC.fingerprint(), "adapter_id": "", "extra_keys": ()}
    good = {"tenant_salt": bytes, "spec_fingerprint": bytes, "adapter_id": str, "extra_keys": tuple}[field]
    assume(not isinstance(value, good))
    rejects(lambda: Namespace(**{**ok, field: value}), hint="bytes|adapter_id|extra_keys")


@BAD
@given(adapter=junk.filter(lambda v: not isinstance(v, str)),
       extra=st.one_of(st.text(min_size=1, max_size=6), st.binary(min_size=1, max_size=6),
                       st.lists(st.one_of(st.integers(), st.floats(), st.none()), min_size=1, max_size=3)),
       shared=junk.filter(lambda v: not isinstance(v, bool)))
def test_pool_keys_reject_wrong_adapter_extra_keys_and_shared(adapter, extra, shared):
    pool = a_pool()
    tokens = list(range(8))
    rejects(lambda: pool.keys("a", tokens, adapter_id=adapter), hint="adapter_id must be a string")
    rejects(lambda: pool.keys("a", tokens, extra_keys=extra), hint="extra_keys")
    rejects(lambda: pool.keys("a", tokens, shared=shared), hint="shared must be True or False")


# ------------------------------------------------------------------ KVSpec and Tenant

spec_fields = {
    "model_id": st.one_of(st.just(""), junk.filter(lambda v: not isinstance(v, str))),
    "model_revision": st.one_of(st.just(""), junk.filter(lambda v: not isinstance(v, str))),
    "num_layers": st.one_of(st.integers(-(2**40), 0), not_int),
    "num_kv_heads": st.one_of(st.integers(-(2**40), 0), not_int),
    "head_dim": st.one_of(st.integers(-(2**40), 0), not_int),
    "block_size": st.one_of(st.integers(-(2**40), 0), not_int),
    "chunk_tokens": st.one_of(st.integers(-(2**40), 0), not_int, st.integers(17, 31)),  # or not a block multiple
    "dtype": st.one_of(st.sampled_from(["fp16", "float64", "int8", "bf16", ""]), junk).filter(
        lambda v: not (isinstance(v, str) and v in DTYPE_BYTES)),
    "storage_format": st.one_of(st.sampled_from(["fp4", "RAW", "int4", ""]), junk).filter(
        lambda v: not (isinstance(v, str) and v in STORAGE_FORMATS)),
}


@BAD
@given(data=st.data(), field=st.sampled_from(sorted(spec_fields)))
def test_a_bad_kvspec_field_is_400_naming_the_field(data, field):
    value = data.draw(spec_fields[field])
    kwargs = dict(model_id="m", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=16,
                  chunk_tokens=256)
    kwargs[field] = value
    rejects(lambda: KVSpec(**kwargs), hint=f"{field}|block_size")


@BAD
@given(data=st.one_of(junk.filter(lambda v: not isinstance(v, dict)),
                      st.dictionaries(st.sampled_from(["model_id", "num_layers", "head_dim", "zz"]),
                                      st.just(1), max_size=3),
                      st.just({1: 2})))
def test_kvspec_from_dict_names_missing_or_unknown_fields(data):
    rejects(lambda: KVSpec.from_dict(data), hint="unknown KVSpec fields|missing|dict of its fields")


tenant_fields = {
    "id": bad_name,
    "salt": junk.filter(lambda v: not isinstance(v, bytes)),
    "quota_bytes": st.one_of(st.integers(-(2**70), -1), not_int, st.floats(allow_nan=True)),
    "priority": junk.filter(lambda v: v not in ("low", "normal", "high")),
    "quota_fraction": st.one_of(st.floats(allow_nan=True).filter(lambda v: not 0 <= v <= 1), st.booleans(),
                                st.text(max_size=3)),
    "guaranteed_fraction": st.one_of(st.floats(allow_nan=True).filter(lambda v: not 0 <= v <= 1), st.booleans(),
                                     st.none(), st.text(max_size=3)),
    "scrub": junk.filter(lambda v: not isinstance(v, bool)),
}


@BAD
@given(data=st.data(), field=st.sampled_from(sorted(tenant_fields)))
def test_a_bad_tenant_field_is_400_naming_the_field(data, field):
    value = data.draw(tenant_fields[field])
    kwargs = {"id": "t", field: value}
    rejects(lambda: Tenant(**kwargs), hint={"id": "tenant id"}.get(field, field))


@BAD
@given(tenant=junk.filter(lambda v: v != "a"))
def test_a_registry_takes_tenants_and_string_ids(tenant):
    reg = TenantRegistry([Tenant("a")])
    rejects(lambda: reg.add(tenant), hint="takes a Tenant")
    if isinstance(tenant, str):
        rejects(lambda: reg.index(tenant), UnknownTenant, 404, hint="register it first")
    else:
        rejects(lambda: reg.index(tenant), hint="tenant id is a string")
    assert [t.id for t in reg] == ["a"] and reg.usage("a") == 0


# ------------------------------------------------------------------ StoreConfig

config_fields = {
    "page_bytes": st.one_of(st.integers(-(2**40), 0), st.integers(2**35, 2**70), not_int),
    "dram_pages": st.one_of(st.integers(-(2**40), -1), not_int, st.just(2**40)),
    "policy": junk.filter(lambda v: not (isinstance(v, str) and v in (*policy_names(), "default"))),
    "policy_params": st.one_of(st.dictionaries(st.text(min_size=1, max_size=5), st.integers(), min_size=1,
                                               max_size=2), st.lists(st.integers(), min_size=1, max_size=2)),
    "storage_format": junk.filter(lambda v: not (isinstance(v, str) and v in DEFAULT_HIGH_WATERMARK)),
    "high_watermark": st.one_of(st.floats(allow_nan=True).filter(lambda v: not 0.1 < v <= 1), st.text(max_size=3),
                                st.booleans()),
    "name": st.one_of(st.text(max_size=10).filter(lambda s: not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,200}", s)),
                      st.just("../../escape"), junk.filter(lambda v: not isinstance(v, str))),
}


@BAD
@given(data=st.data(), field=st.sampled_from(sorted(config_fields)))
def test_a_bad_store_config_is_400_before_any_memory_is_taken(data, field):
    value = data.draw(config_fields[field])
    kwargs = {"page_bytes": 1024, "dram_pages": 4, "policy": "lru", field: value}
    rejects(lambda: ChunkStore(StoreConfig(**kwargs), TenantRegistry([Tenant("a")])),
            hint=r"page_bytes|num_pages|policy|storage_format|watermark|store name|exceeds this machine")


# ------------------------------------------------------------------ the chunk store

bad_payload = st.one_of(
    st.builds(lambda n: np.zeros(n, dtype=np.uint8), st.integers(1025, 4096)),  # larger than a page: 413
    st.just(b""), st.just(np.zeros(0, dtype=np.float32)),  # empty
    st.builds(lambda n: np.array([object()] * n), st.integers(1, 8)),  # Python objects
    st.builds(lambda n: np.arange(2 * n, dtype=np.uint8)[::2], st.integers(2, 64)),  # not contiguous
    st.builds(lambda n: torch.zeros(n, 4).t(), st.integers(2, 8)),  # not contiguous
    st.builds(lambda n: memoryview(np.arange(2 * n, dtype=np.uint8))[::2], st.integers(2, 64)),
    st.text(max_size=10), st.none(), st.integers(), st.lists(st.integers(0, 255), max_size=8),
)


@BAD
@given(p=bad_payload)
def test_a_bad_payload_is_rejected_before_anything_is_written(p):
    store = make_store(dram_pages=4)
    k = make_keys(3)
    assert store.put_many(k[:1], [payload(0)], "a") == [True]
    before = store_state(store)
    too_big = isinstance(p, np.ndarray) and p.dtype == np.uint8 and p.size > 1024
    exc, status = (ChunkTooLarge, 413) if too_big else (BadRequest, 400)
    hint = ("page size|larger page_bytes" if too_big else
            "empty|Python objects|contiguous|must be a torch tensor, numpy array or bytes")
    # as the second chunk of a batch: the valid first chunk must not be written either
    rejects(lambda: store.put_many(k[1:3], [payload(1), p], "a", parent=k[0]), exc, status, hint)
    assert store_state(store) == before


@BAD
@given(quota_chunks=st.integers(0, 3), batch=st.integers(1, 4), size=st.integers(1, 1024))
def test_over_quota_is_429_and_writes_nothing(quota_chunks, batch, size):
    store = make_store(dram_pages=8, tenants=[Tenant("a"), Tenant("q", quota_bytes=quota_chunks * 300)])
    k = make_keys(batch, tenant_salt=b"q")
    assume(batch * size > quota_chunks * 300)
    before = store_state(store)
    err = rejects(lambda: store.put_many(k, [payload(i, size) for i in range(batch)], "q"), QuotaExceeded, 429,
                  hint="free some of its chunks or raise its quota")
    assert (err.tenant, err.usage, err.limit, err.requested) == ("q", 0, quota_chunks * 300, batch * size)
    assert store_state(store) == before
    assert store.metrics.rejected_quota.get("q") == 1  # counted, and nothing else


calls_by_tenant = [
    lambda s, t, k: s.put_many([k[2]], [payload(2)], t),
    lambda s, t, k: s.get_many(k[:2], t),
    lambda s, t, k: s.get(k[0], t),
    lambda s, t, k: s.read(k[0], t),
    lambda s, t, k: s.contains_many(k, t),
    lambda s, t, k: s.remove_many(k[:1], t),
    lambda s, t, k: s.lease(k, t),
    lambda s, t, k: s.pin(k, t),
    lambda s, t, k: s.begin(t, k),
    lambda s, t, k: s.reserve([k[2]], [10], t),
    lambda s, t, k: s.lease_reads(k, t),
]


@BAD
@given(tenant=st.one_of(unknown_tenant, junk.filter(lambda v: not isinstance(v, str))),
       call=st.sampled_from(calls_by_tenant))
def test_unknown_or_non_string_tenants_change_nothing(tenant, call):
    store = make_store()
    k = make_keys(3)
    store.put_many(k[:2], [payload(0), payload(1)], "a")
    before = store_state(store)
    if isinstance(tenant, str):
        rejects(lambda: call(store, tenant, k), UnknownTenant, 404, hint="register it first")
    else:
        rejects(lambda: call(store, tenant, k), hint="tenant id is a string")
    assert store_state(store) == before


bad_store_args = [
    ("keys", lambda s, k, v: s.put_many(v, [payload(2)], "a"), r"ChunkKey|keys but"),
    ("payloads", lambda s, k, v: s.put_many([k[2]], v, "a"), r"payloads must be a list|payload must be|keys but"),
    ("shared", lambda s, k, v: s.put_many([k[2]], [payload(2)], "a", shared=v), r"shared must be True or False"),
    ("parent", lambda s, k, v: s.put_many([k[2]], [payload(2)], "a", parent=v), r"ChunkKey"),
    ("first_position", lambda s, k, v: s.put_many([k[2]], [payload(2)], "a", first_position=v),
     r"first_position must be an int >= 0"),
    ("request", lambda s, k, v: s.put_many([k[2]], [payload(2)], "a", request=v), r"request must come from begin"),
    ("outs", lambda s, k, v: s.get_many(k[:1], "a", v), r"outs must be a list|output buffer|payload must be|keys but"),
    ("priority", lambda s, k, v: s.begin("a", k, priority=v), r"priority must be one of"),
    ("end", lambda s, k, v: s.end(v), r"end takes the request begin\(\) returned"),
    ("sizes", lambda s, k, v: s.reserve([k[2]], [v], "a"), r"chunk size is a whole number of bytes"),
    ("ttl_s", lambda s, k, v: s.reserve([k[2]], [10], "a", ttl_s=v), r"ttl_s must be a finite number"),
    ("read ttl_s", lambda s, k, v: s.lease_reads(k, "a", ttl_s=v), r"ttl_s must be a finite number"),
]
bad_store_values = {
    "keys": st.one_of(st.none(), st.integers(), st.lists(bad_key, min_size=1, max_size=2), st.just(make_keys(1)[0])),
    "payloads": st.one_of(st.none(), st.integers(), st.text(min_size=1), st.just([]), st.lists(st.none(), min_size=1)),
    "shared": junk.filter(lambda v: not isinstance(v, bool)),
    "parent": bad_key.filter(lambda v: v is not None),
    "first_position": st.one_of(st.integers(-(2**40), -1), not_int),
    "request": junk.filter(lambda v: v is not None),
    "outs": st.one_of(st.integers(), st.text(min_size=1), st.just([]),
                      st.builds(lambda n: [np.zeros(n, dtype=np.uint8)], st.integers(0, 999)),  # too small
                      st.builds(lambda n: [np.zeros(n, dtype=np.uint8)] * 2, st.integers(1000, 1024)),  # 2 for 1
                      st.just([bytes(1000)])),  # read-only
    "priority": junk.filter(lambda v: v is not None and v not in ("low", "normal", "high")),
    "end": junk,
    "sizes": st.one_of(st.integers(-(2**40), 0), not_int),
    "ttl_s": st.one_of(non_finite, st.floats(max_value=-1e-9), st.text(max_size=3), st.none(), st.booleans()),
    "read ttl_s": st.one_of(non_finite, st.floats(max_value=-1e-9), st.text(max_size=3), st.booleans()),
    "corrupt": st.one_of(st.none(), st.integers(), st.lists(bad_key, min_size=1, max_size=2)),
}


@settings(BAD, max_examples=200)
@given(data=st.data(), case=st.sampled_from(bad_store_args))
def test_bad_store_arguments_are_400_and_change_nothing(data, case):
    name, call, hint = case
    value = data.draw(bad_store_values[name], label=name)
    store = make_store()
    k = make_keys(3)
    store.put_many(k[:2], [payload(0), payload(1)], "a")
    before = store_state(store)
    rejects(lambda: call(store, k, value), hint=hint)
    assert store_state(store) == before


@FEW
@given(bad=st.one_of(st.text(max_size=4), st.integers(-5, 2**70), st.floats(allow_nan=True), st.none()))
def test_commit_checks_every_checksum_before_any_chunk_becomes_findable(bad):
    assume(not (isinstance(bad, int) and 0 <= bad < 2**64))
    store = make_store(dram_pages=4)
    k = make_keys(3)
    hid, places = store.reserve(k, [10, 10, 10], "a")
    assert len(places) == 3
    before = store_state(store)
    rejects(lambda: store.commit(hid, [1, 2, bad]), hint=r"checksum is the xxh3-64")
    assert store_state(store) == before and store.contains_many(k, "a") == [False] * 3
    store.abort(hid)


@FEW
@given(size=st.integers(1025, 2**70))
def test_a_reservation_larger_than_a_page_is_413(size):
    store = make_store()
    before = store_state(store)
    rejects(lambda: store.reserve(make_keys(2), [10, size], "a"), ChunkTooLarge, 413, "larger page_bytes")
    assert store_state(store) == before


# ------------------------------------------------------------------ LocalPool

bad_chunks = st.one_of(
    # wrong dtype, right shape
    st.sampled_from([torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8, torch.bool]).map(
        lambda d: torch.zeros(SPEC.chunk_shape, dtype=d)),
    # right dtype, any other shape (partial chunks among them)
    st.lists(st.integers(1, 5), min_size=1, max_size=6).filter(lambda s: tuple(s) != SPEC.chunk_shape).map(
        lambda s: torch.zeros(s)),
    st.integers(1, SPEC.chunk_tokens - 1).map(
        lambda t: torch.zeros(SPEC.num_layers, 2, t, SPEC.num_kv_heads, SPEC.head_dim)),  # partial chunk
    st.just(np.zeros(SPEC.chunk_shape, dtype=np.float32)),  # numpy, not torch
    st.none(), st.integers(), st.text(max_size=3),
)


@BAD
@given(bad=bad_chunks, position=st.integers(0, 1))
def test_save_rejects_chunks_off_the_spec_and_writes_nothing(bad, position):
    pool, keys = filled_pool()
    before = store_state(pool.store)
    chunks = [chunk(5), bad] if position else [bad, chunk(5)]
    want = SPEC.chunk_shape
    partial = isinstance(bad, torch.Tensor) and bad.dim() == 5 and bad.dtype == torch.float32 and \
        bad.shape[2] < SPEC.chunk_tokens and tuple(bad.shape[:2]) + tuple(bad.shape[3:]) == want[:2] + want[3:]
    hint = "partial chunk of .* only whole chunks" if partial else "must be a torch.Tensor|does not match the spec"
    rejects(lambda: pool.save("a", keys, chunks, start=1), LayoutMismatch, 400, hint)
    assert store_state(pool.store) == before


@BAD
@given(start=st.one_of(st.integers(-(2**40), -1), st.integers(3, 2**40), not_int),
       chunks=st.one_of(st.just("list"), st.just("tensor"), st.none()))
def test_save_start_and_chunk_list_are_checked(start, chunks):
    pool, keys = filled_pool()
    before = store_state(pool.store)
    if chunks == "list":
        rejects(lambda: pool.save("a", keys, [chunk(3)], start=start), BadRequest, 400,
                "start must be the int index|only whole chunks are keyed")
    else:
        bare = chunk(3) if chunks == "tensor" else None
        rejects(lambda: pool.save("a", keys, bare, start=2), LayoutMismatch, 400, "must be a list of KV tensors")
    assert store_state(pool.store) == before


@BAD
@given(tenant=st.one_of(unknown_tenant, junk.filter(lambda v: not isinstance(v, str))),
       op=st.sampled_from(["keys", "lookup", "load", "load-empty", "save", "begin", "pin", "lease"]))
def test_pool_calls_of_unknown_tenants_change_nothing(tenant, op):
    pool, keys = filled_pool()
    before = store_state(pool.store)
    call = {
        "keys": lambda: pool.keys(tenant, list(range(8))),
        "lookup": lambda: pool.lookup(tenant, keys),
        "load": lambda: pool.load(tenant, keys),
        "load-empty": lambda: pool.load(tenant, []),
        "save": lambda: pool.save(tenant, keys, [chunk(9)], start=2),
        "begin": lambda: pool.begin(tenant, keys),
        "pin": lambda: pool.pin(tenant, keys),
        "lease": lambda: pool.lease(tenant, keys),
    }[op]
    if isinstance(tenant, str):
        rejects(call, UnknownTenant, 404, "register it first")
    else:
        rejects(call, BadRequest, 400, "tenant id is a string")
    assert store_state(pool.store) == before


@BAD
@given(bad=st.one_of(bad_key, st.none()), where=st.integers(0, 2), op=st.sampled_from(["lookup", "load", "save"]))
def test_a_malformed_key_anywhere_in_a_prompt_fails_before_anything_is_read_or_written(bad, where, op):
    pool, keys = filled_pool()
    before = store_state(pool.store)
    mixed = list(keys)
    mixed[where] = bad
    call = {
        "lookup": lambda: pool.lookup("a", mixed),
        "load": lambda: pool.load("a", mixed),
        "save": lambda: pool.save("a", mixed, [chunk(9)], start=2),
    }[op]
    rejects(call, BadRequest, 400, "ChunkKey")
    assert store_state(pool.store) == before


@BAD
@given(size=st.integers(1, SPEC.chunk_nbytes - 1))
def test_a_truncated_payload_under_a_pool_key_loads_as_a_miss_never_half_a_tensor(size):
    """Bytes put through the bare store under a pool's key, shorter than a chunk of the spec."""
    pool, keys = filled_pool()
    where = pool.addresses("a", keys)
    assert pool.store.put(where[2], payload(3, size), "a", parent=where[1])
    loaded = pool.load("a", keys)
    assert len(loaded) == 2 and torch.equal(loaded[0], chunk(0)) and torch.equal(loaded[1], chunk(1))
    assert pool.load("a", keys[2:]) == []


# ------------------------------------------------------------------ the index contract


@pytest.fixture(params=["embedded", "redis"])
def index(request):
    if request.param == "embedded":
        idx = EmbeddedIndex()
        yield idx
        return
    url = request.getfixturevalue("redis_url")
    idx = RedisIndex(url, prefix=f"kvpbad{uuid.uuid4().hex[:12]}")
    yield idx
    idx.flush()
    idx.close()


KEYS = make_keys(8, tenant_salt=b"idx")


def seeded(index):
    """Two tenants (a with a 3000 B quota), two shards and two published chunks of a."""
    if index.tenants():
        return index
    index.add_tenant("a", 3000)
    index.add_tenant("b")
    index.register_shard("s1", "node-1", ttl_s=600)
    index.register_shard("s2", "node-2", ttl_s=600)
    index.publish([IndexEntry(KEYS[0], "s1", "dram", 1000, "a", 7), IndexEntry(KEYS[1], "s2", "disk", 1000, "a", 8)])
    return index


def index_state(index):
    """What the contract shows, plus, for Redis, every key under the pool's prefix byte for byte."""
    shards = index.shards()
    out = (index.tenants(), shards, {s: index.shard_keys(s) for s in shards}, index.lookup(KEYS),
           [index.get(k) for k in KEYS], index.events(count=10_000))
    if isinstance(index, RedisIndex):
        r = index._w
        out += (sorted((k, r.type(k), r.dump(k)) for k in r.scan_iter(match=f"{index._prefix}:*")),)
    return out


def entry_kwargs(**over):
    return {"key": KEYS[2], "shard": "s1", "tier": "dram", "nbytes": 10, "tenant": "a", "checksum": 1,
            "created": 0.0, **over}


bad_entry_fields = {
    "key": bad_key,
    "shard": bad_name,
    "tier": bad_name,
    "tenant": bad_name,
    "nbytes": st.one_of(st.integers(-(2**70), 0), st.integers(2**40, 2**70), not_int),
    "checksum": st.one_of(st.integers(-(2**70), -1), st.integers(2**64, 2**70), not_int),
    "created": st.one_of(non_finite, st.floats(max_value=-1e-9), st.text(max_size=3), st.none(), st.booleans(),
                         st.binary(max_size=3)),
}


@BAD
@given(data=st.data(), field=st.sampled_from(sorted(bad_entry_fields)))
def test_a_malformed_entry_is_400_naming_the_field(data, field):
    value = data.draw(bad_entry_fields[field], label=field)
    hint = {"key": "ChunkKey", "shard": "shard id", "tier": "tier", "tenant": "tenant", "nbytes": "nbytes",
            "checksum": "checksum", "created": "created"}[field]
    rejects(lambda: IndexEntry(**entry_kwargs(**{field: value})), hint=hint)


@BAD
@given(entries=st.one_of(st.none(), st.integers(), st.text(min_size=1), st.lists(junk, min_size=1, max_size=3)),
       good_first=st.booleans())
def test_publish_of_non_entries_is_400_and_writes_nothing(index, entries, good_first):
    seeded(index)
    before = index_state(index)
    if good_first and isinstance(entries, list):
        entries = [IndexEntry(**entry_kwargs()), *entries]
    rejects(lambda: index.publish(entries), hint="publish takes")
    assert index_state(index) == before


@BAD
@given(case=st.sampled_from(["unknown tenant", "unknown shard", "over quota"]), n=st.integers(1, 3))
def test_publish_refusals_are_typed_and_all_or_nothing(index, case, n):
    seeded(index)
    before = index_state(index)
    batch = [IndexEntry(**entry_kwargs(key=k, nbytes=300)) for k in KEYS[4 : 4 + n]]
    if case == "unknown tenant":
        batch.append(IndexEntry(**entry_kwargs(key=KEYS[7], tenant="ghost")))
        rejects(lambda: index.publish(batch), UnknownTenant, 404, "register it first")
    elif case == "unknown shard":
        batch.append(IndexEntry(**entry_kwargs(key=KEYS[7], shard="s9")))
        rejects(lambda: index.publish(batch), BadRequest, 400, "register it before publishing")
    else:
        batch.append(IndexEntry(**entry_kwargs(key=KEYS[7], nbytes=1000)))
        rejects(lambda: index.publish(batch), QuotaExceeded, 429, "free some of its chunks or raise its quota")
    assert index_state(index) == before


@BAD
@given(keys=st.one_of(st.none(), st.integers(), st.text(), st.binary(), st.lists(bad_key, min_size=1, max_size=3),
                      st.just(KEYS[0])))
def test_lookup_never_raises_and_names_the_bad_key(index, keys):
    seeded(index)
    before = index_state(index)
    hit = index.lookup(keys)
    assert hit.count == 0 and hit.error is not None and re.search("ChunkKey", hit.error)
    assert index_state(index) == before


index_calls = [
    ("get", lambda i, v: i.get(v), bad_key, "ChunkKey"),
    ("remove keys", lambda i, v: i.remove(v), st.one_of(st.none(), st.integers(), st.lists(bad_key, min_size=1)),
     "ChunkKey"),
    ("remove shard", lambda i, v: i.remove([KEYS[0]], shard=v), bad_name.filter(lambda v: v is not None),
     "shard id"),
    ("invalidate", lambda i, v: i.invalidate(KEYS[0], v), bad_name.filter(lambda v: v is not None), "shard id"),
    ("add_tenant name", lambda i, v: i.add_tenant(v), bad_name, "tenant"),
    ("add_tenant quota", lambda i, v: i.add_tenant("c", v),
     st.one_of(st.integers(-(2**70), -1), not_int, st.floats(allow_nan=True)), "whole number of bytes"),
    ("add_tenant priority", lambda i, v: i.add_tenant("c", 10, v), not_a_class, "priority"),
    ("set_quota tenant", lambda i, v: i.set_quota(v, 10), bad_name, "tenant"),
    ("set_quota quota", lambda i, v: i.set_quota("a", v),
     st.one_of(st.integers(-(2**70), -1), not_int, st.floats(allow_nan=True)), "whole number of bytes"),
    ("set_priority", lambda i, v: i.set_priority("a", v), not_a_class, "priority must be one of"),
    ("register name", lambda i, v: i.register_shard(v), bad_name, "shard id"),
    ("register address", lambda i, v: i.register_shard("s3", address=v), junk.filter(lambda v: not isinstance(v, str)),
     "address is a string"),
    ("register ttl", lambda i, v: i.register_shard("s3", ttl_s=v),
     st.one_of(non_finite, st.floats(max_value=-1e-9), st.text(max_size=3), st.none(), st.booleans()),
     "ttl_s must be a finite number"),
    ("heartbeat name", lambda i, v: i.heartbeat(v), bad_name, "shard id"),
    ("heartbeat ttl", lambda i, v: i.heartbeat("s1", ttl_s=v),
     st.one_of(non_finite, st.floats(max_value=-1e-9), st.text(max_size=3), st.none(), st.booleans()),
     "ttl_s must be a finite number"),
    ("shard_keys", lambda i, v: i.shard_keys(v), bad_name, "shard id"),
    ("events after", lambda i, v: i.events(after=v),
     st.one_of(st.text(max_size=12).filter(lambda s: not re.fullmatch(r"[0-9]{1,19}(-[0-9]{1,19})?", s)),
               st.just("1-2-3"), st.just("5\n"), st.just("9" * 25 + "-0"), st.just("18446744073709551616-0"), not_int),
     "event id .* is malformed"),
    ("events count", lambda i, v: i.events(count=v), st.one_of(st.integers(-(2**40), 0), not_int), "count must be"),
    ("reconcile entries", lambda i, v: i.reconcile("s1", v), st.one_of(st.none(), st.lists(junk, min_size=1)),
     "publish takes"),
    ("reconcile shard", lambda i, v: i.reconcile(v, []), bad_name, "shard id"),
]


@settings(BAD, max_examples=200)
@given(data=st.data(), case=st.sampled_from(index_calls))
def test_bad_index_arguments_are_400_and_change_nothing(index, data, case):
    name, call, values, hint = case
    value = data.draw(values, label=name)
    seeded(index)
    before = index_state(index)
    rejects(lambda: call(index, value), BadRequest, 400, hint)
    assert index_state(index) == before


@BAD
@given(tenant=unknown_tenant, op=st.sampled_from(["set_quota", "set_priority", "usage"]))
def test_unknown_tenants_of_the_index_are_404(index, tenant, op):
    seeded(index)
    before = index_state(index)
    call = {"set_quota": lambda: index.set_quota(tenant, 5), "set_priority": lambda: index.set_priority(tenant, "low"),
            "usage": lambda: index.usage(tenant)}[op]
    rejects(call, UnknownTenant, 404, "register it first")
    assert index_state(index) == before


# ------------------------------------------------------------------ garbage where msgpack is decoded

msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
              st.text(max_size=6), st.binary(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8,
)
garbage_entry = st.one_of(
    st.binary(max_size=64),  # anything at all
    st.builds(lambda s, t, rest: s + b"\0" + t + b"\0" + rest,  # the right frame, a wrong payload
              st.binary(max_size=6), st.binary(max_size=6),
              st.one_of(st.binary(max_size=40), msgpack_values.map(msgpack.packb))),
    st.builds(lambda v: b"s1\0dram\0" + msgpack.packb(v), st.lists(msgpack_values, min_size=4, max_size=4)),
    st.builds(lambda b: b"s1\0dram\0" + msgpack.packb([10, "a", 1, 1.0]) + b, st.binary(min_size=1, max_size=4)),
    # well-formed after all (any field may be at its edge): decodes and round-trips
    st.builds(lambda *f: b"s1\0dram\0" + msgpack.packb(list(f)), st.integers(1, 2**40 - 1), st.sampled_from(["a", "b"]),
              st.integers(0, 2**64 - 1), st.one_of(st.just(0), st.floats(0, 2e9))),
)


@settings(BAD, max_examples=200)
@given(raw=garbage_entry)
def test_decoding_garbage_is_a_400_or_a_valid_entry_never_a_crash(raw):
    try:
        e = IndexEntry.decode(KEYS[0], raw)
    except BadRequest as err:
        assert "malformed index entry" in err.message and KEYS[0].hex() in err.message
        return
    except KvPoolError as err:  # pragma: no cover - the assertion says what went wrong
        raise AssertionError(f"decode raised {type(err).__name__}, not BadRequest: {err}") from err
    # it happened to be a well-formed entry: then it must survive a round trip (created 0 means now)
    d = IndexEntry.decode(KEYS[0], e.encode())
    assert (d.shard, d.tier, d.nbytes, d.tenant, d.checksum) == (e.shard, e.tier, e.nbytes, e.tenant, e.checksum)
    assert d.created == e.created or e.created == 0


@pytest.fixture
def redis_index(redis_url):
    idx = RedisIndex(redis_url, prefix=f"kvpbad{uuid.uuid4().hex[:12]}")
    yield idx
    idx.flush()
    idx.close()


@BAD
@given(raw=garbage_entry)
def test_garbage_stored_in_redis_is_a_miss_for_readers(redis_index, raw):
    idx = seeded(redis_index)
    idx._w.set(idx.keys.chunk(KEYS[1]), raw)  # the second chunk of the prompt is now garbage
    try:
        valid = IndexEntry.decode(KEYS[1], raw)
    except BadRequest:
        valid = None
    before = index_state(idx)
    hit = idx.lookup(KEYS)  # never raises; the run stops at the garbage unless its frame reads
    assert hit.error is None and hit.count in (1, 2) and hit.shards[0] == "s1"
    assert idx.get(KEYS[1]) == valid  # a garbage entry is a miss, not an exception
    assert idx.get(KEYS[0]).checksum == 7
    assert index_state(idx) == before


# Values that are malformed for the Lua scripts as much as for Python: no frame, or a frame whose
# payload is not msgpack of [integer nbytes, string tenant, ...].
surely_malformed = st.one_of(
    st.binary(max_size=40).filter(lambda b: b.count(b"\0") < 2),
    st.builds(lambda s, rest: s + b"\0dram\0" + rest, st.sampled_from([b"s1", b"s2", b"s7"]),
              st.one_of(st.just(b""), st.just(b"\xc1"), st.just(b"\x94\x0a\xa1a"),  # nothing, 0xc1, truncated
                        st.one_of(st.none(), st.text(max_size=3), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                                  max_size=2)).map(msgpack.packb),
                        st.lists(st.one_of(st.none(), st.text(max_size=2), st.booleans()), min_size=1,
                                 max_size=4).map(msgpack.packb))),
)


def frame_shard(raw):
    return raw.split(b"\0", 1)[0].decode("latin-1") if b"\0" in raw else None


@BAD
@given(raw=surely_malformed, shard=st.sampled_from([None, "s1", "s2"]))
def test_removing_a_malformed_entry_never_fails_halfway_and_refunds_nothing(redis_index, raw, shard):
    """A Lua script that fails keeps what it already wrote: a remove must not fail on garbage."""
    idx = redis_index
    idx.flush()
    seeded(idx)
    idx._w.set(idx.keys.chunk(KEYS[2]), raw)
    idx._w.sadd(idx.keys.shard_set("s2"), bytes(KEYS[2]))
    n = idx.remove([KEYS[0], KEYS[2]], shard=shard)  # a good entry first, then the garbage
    first = shard in (None, "s1")
    garbage = frame_shard(raw) is None or shard in (None, frame_shard(raw))  # unreadable shard: removed anyway
    assert n == first + garbage
    assert (idx.get(KEYS[0]) is None) == first and (idx._w.get(idx.keys.chunk(KEYS[2])) is None) == garbage
    assert idx.usage("a") == 2000 - 1000 * first and idx.usage("b") == 0  # garbage charged nothing we know of
    assert idx.lookup(KEYS[1:2]).count == 1  # the other entry is untouched
    if garbage and frame_shard(raw) == "s2":
        assert KEYS[2] not in idx.shard_keys("s2")
    kinds = [(e.kind, e.key) for e in idx.events()][-n:] if n else []
    assert kinds == [("removed", k) for k, gone in ((KEYS[0], first), (KEYS[2], garbage)) if gone]


@BAD
@given(raw=garbage_entry, shard=st.sampled_from([None, "s1", "s2"]))
def test_removing_any_garbage_completes(redis_index, raw, shard):
    idx = redis_index
    idx.flush()
    seeded(idx)
    idx._w.set(idx.keys.chunk(KEYS[2]), raw)
    second = idx._w.get(idx.keys.chunk(KEYS[1]))
    n = idx.remove([KEYS[0], KEYS[2]], shard=shard)  # never a script error
    first = shard in (None, "s1")
    assert (idx.get(KEYS[0]) is None) == first
    if shard is None:  # with no filter the garbage goes whatever it says
        assert idx._w.get(idx.keys.chunk(KEYS[2])) is None and n == 2
    assert idx._w.get(idx.keys.chunk(KEYS[1])) == second
