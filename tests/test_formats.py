"""Lossy storage formats wired into the pool: chunks quantized on save and dequantized on load by
the codec, through the transformers connector on the in-process pool; the format in the key (an
int8 chunk is a miss for a raw or fp8 reader); pages and watermarks that follow the format; and
payloads that do not decode as misses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IN_CI

from kvpool.codec import POOL_PARAMS, ChunkCodec, pool_params, stored_nbytes
from kvpool.connectors.demo import smollm2
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import cache_argument, tiny_llama
from kvpool.connectors.pools import check_config, close_local_pools, open_pool, spec_for
from kvpool.errors import BadRequest, LayoutMismatch
from kvpool.kernels.quant import dequantize, quantize
from kvpool.pool import LocalPool
from kvpool.spec import DEFAULT_HIGH_WATERMARK, STORAGE_FORMATS, KVSpec
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry

CHUNK = 32
LOSSY = [f for f in STORAGE_FORMATS if f != "raw"]
SMOL = dict(model_id="smollm2", num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's KV


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.fixture(autouse=True)
def fresh_pools():
    close_local_pools()
    yield
    close_local_pools()


def connector(model, fmt, pool="fmt-test"):
    cfg = {"chunk_tokens": CHUNK, "tenants": ["a"], "dram_mib": 16, "pool": pool}
    if fmt is not None:
        cfg["storage_format"] = fmt
    return HFConnector(model, config=cfg, model_id="test/tiny-llama", tenant="a")


def prompt(n, seed=0):
    return torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(seed))


def kv_like(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.chunk_shape, generator=g)
    x[:, 0] += 3 * torch.randn(spec.head_dim, generator=g)  # per-channel key offsets, as real keys have
    return x


# --------------------------------------------------------------------------- the codec


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_stored_bytes_per_format_on_smollm2s_chunk(dtype):
    raw = KVSpec(**SMOL, dtype=dtype).chunk_nbytes
    ratios = {}
    for fmt in STORAGE_FORMATS:
        spec = KVSpec(**SMOL, dtype=dtype, storage_format=fmt)
        codec = ChunkCodec(spec)
        data = codec.encode(kv_like(spec).to(codec.dtype))
        assert data.dtype == np.uint8 and data.shape == (codec.nbytes,) and codec.nbytes == stored_nbytes(spec)
        ratios[fmt] = codec.nbytes / raw
    assert ratios["raw"] == 1
    assert ratios["int2-kivi"] < ratios["int4-kivi"] < ratios["int8"] == ratios["fp8"] < 1
    # The issue's targets (fp8 <= 0.5, int4 <= 0.27) hold against float32 KV; against 16-bit KV the
    # codes alone are 0.5 and 0.25 of it, so the float32 scales put both just above (docs/formats.md).
    if dtype == "float32":
        assert ratios["fp8"] <= 0.5 and ratios["int4-kivi"] <= 0.27
    else:
        assert 0.5 < ratios["fp8"] < 0.54 and 0.27 < ratios["int4-kivi"] < 0.32


@pytest.mark.parametrize("fmt", STORAGE_FORMATS)
def test_decode_gives_back_the_chunk_within_the_formats_error(fmt):
    spec = KVSpec(**SMOL, chunk_tokens=64, block_size=16, dtype="float32", storage_format=fmt)
    codec = ChunkCodec(spec)
    x = kv_like(spec, seed=1)
    back = codec.decode(codec.encode(x))
    assert back.shape == x.shape and back.dtype == x.dtype
    if fmt == "raw":
        assert torch.equal(back, x)
        return
    # exactly what the kernels' reference gives with the pool's parameters, and lossy
    assert torch.equal(back, dequantize(quantize(x, fmt, impl="torch", **pool_params(spec))))
    rel = ((back - x).norm() / x.norm()).item()
    assert 0 < rel < {"fp8": 0.05, "int8": 0.01, "int4-kivi": 0.15, "int2-kivi": 0.6}[fmt]


def test_a_kivi_group_shrinks_to_fit_small_chunks_and_head_dims():
    assert pool_params(KVSpec(**SMOL, storage_format="int4-kivi")) == POOL_PARAMS["int4-kivi"]
    small = KVSpec(**SMOL, dtype="float32", chunk_tokens=16, block_size=16, storage_format="int4-kivi")
    assert pool_params(small)["group"] == 16 and pool_params(small)["residual"] == 0
    assert ChunkCodec(small).bytes_ratio < 0.5  # every token quantized, none left in full precision
    odd = KVSpec("m", 2, 1, 80, chunk_tokens=64, block_size=16, storage_format="int2-kivi")
    assert 80 % pool_params(odd)["group"] == 0
    with pytest.raises(BadRequest, match="head_dim"):
        ChunkCodec(KVSpec("m", 2, 1, 6, chunk_tokens=64, block_size=16, storage_format="int2-kivi"))


def test_a_payload_that_does_not_decode_is_a_miss_never_an_exception():
    specs = {f: KVSpec(**SMOL, chunk_tokens=64, block_size=16, dtype="float32", storage_format=f)
             for f in ("fp8", "int8", "int4-kivi")}
    fp8, int8 = ChunkCodec(specs["fp8"]), ChunkCodec(specs["int8"])
    data = int8.encode(kv_like(specs["int8"]))
    assert fp8.nbytes == int8.nbytes and fp8.decode(data) is None  # same size, another format: a miss
    assert ChunkCodec(specs["int4-kivi"]).decode(data) is None  # another size
    for corrupt in (data[:-1], np.zeros_like(data), np.concatenate([data[:4], np.full(40, 255, np.uint8), data[44:]])):
        assert int8.decode(corrupt) is None
    scales_inf = data.copy()
    scales_inf[-4:] = np.frombuffer(np.float32(np.inf).tobytes(), np.uint8)  # the last scale
    assert int8.decode(scales_inf) is None
    assert int8.decode(data.tolist()) is None and int8.decode(None) is None


def test_the_format_is_part_of_the_fingerprint():
    prints = {KVSpec(**SMOL, storage_format=f).fingerprint() for f in STORAGE_FORMATS}
    assert len(prints) == len(STORAGE_FORMATS)
    with pytest.raises(BadRequest, match="float8"):
        KVSpec(**SMOL, dtype="float8_e4m3fn", storage_format="int8")


# --------------------------------------------------------------------------- the pool


def test_pages_watermarks_and_capacity_follow_the_format():
    counts = {}
    for fmt in ("raw", "int8", "int4-kivi"):
        spec = spec_for("test/m", 2, 2, 64, torch.float32, chunk_tokens=CHUNK, storage_format=fmt)
        pool = open_pool(spec, {"pool": f"cap-{fmt}", "dram_mib": 4, "chunk_tokens": CHUNK, "storage_format": fmt})
        assert pool.store.page_bytes == stored_nbytes(pool.part.spec) < stored_nbytes(spec)  # a page a head's slice
        assert pool.store.config.watermarks[0] == DEFAULT_HIGH_WATERMARK[fmt]
        counts[fmt] = pool.store.stats()["tiers"]["dram"]["pages_total"]
        created = LocalPool.create(spec, TenantRegistry([Tenant("a")]), 3)
        assert created.store.page_bytes == stored_nbytes(spec)
        created.store.close()
    assert counts["raw"] * 3 < counts["int8"] < counts["int4-kivi"]


def test_a_page_too_small_for_the_stored_chunk_is_refused_with_the_fix():
    spec = spec_for("test/m", 2, 2, 64, torch.float32, chunk_tokens=CHUNK)
    small = ChunkStore(StoreConfig(stored_nbytes(spec.__class__(**{**spec.to_dict(), "storage_format": "int4-kivi"})),
                                   4), TenantRegistry([Tenant("a")]))
    with pytest.raises(LayoutMismatch, match="page_bytes >="):
        LocalPool(spec, small)
    small.close()


def test_the_config_chooses_the_format_and_refuses_unknown_ones(model):
    assert check_config({})["storage_format"] == "raw"
    with pytest.raises(BadRequest, match="int4-kivi"):
        check_config({"storage_format": "int4"})
    conn = connector(model, "int8")
    assert conn.spec.storage_format == "int8" and conn.pool.codec.lossy
    raw_spec = spec_for("test/m", 2, 2, 64, torch.float32, chunk_tokens=CHUNK)
    with pytest.raises(BadRequest, match="spec_for"):
        open_pool(raw_spec, {"chunk_tokens": CHUNK, "storage_format": "fp8"})


def suffix_on_kv(model, ids, chunks):
    """Logits of ``ids`` past the chunks' tokens, run on those chunks' KV."""
    from transformers import DynamicCache

    kv = torch.cat(chunks, dim=2)
    cache = DynamicCache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].permute(1, 0, 2)[None], kv[layer, 1].permute(1, 0, 2)[None], layer)
    with torch.no_grad():
        return model(input_ids=ids[:, kv.shape[2]:], use_cache=True, **{cache_argument(model): cache}).logits


@pytest.mark.parametrize("fmt", LOSSY)
def test_the_connector_stores_quantized_chunks_and_runs_on_their_dequantized_kv(model, fmt):
    conn = connector(model, fmt)
    ids = prompt(3 * CHUNK + 5, seed=2)
    cold = conn.prefill(ids)
    assert cold.saved_chunks == 3
    keys = conn.pool.keys("a", ids[0].tolist())[:3]
    where = [a for chunk in conn.pool.addresses("a", keys) for a in chunk]  # a slice per KV head
    stored = conn.pool.store.get_many(where, "a")
    assert [s.shape[0] for s in stored] == [stored_nbytes(conn.pool.part.spec)] * 3 * conn.spec.num_kv_heads
    raw = conn._chunks_from_cache(cold.cache, 0, 3)
    sl, part = conn.pool.slicing, conn.pool.part.spec  # each head's slice quantized on its own
    expect = [torch.cat([dequantize(quantize(s, fmt, impl="torch", **pool_params(part))) for s in sl.split(c)], dim=-2)
              for c in raw]
    loaded = conn.pool.load("a", keys)
    assert all(torch.equal(a, b) for a, b in zip(loaded, expect))
    views = list(conn.pool.load_views("a", keys))
    assert all(torch.equal(v.kv, b) for v, b in zip(views, expect))
    for v in views:
        v.release()
    warm = conn.prefill(ids)
    assert warm.loaded_tokens == 3 * CHUNK and warm.saved_chunks == 0
    # The model continued from the dequantized KV: the same logits as running on it directly,
    # and not the logits of the exact KV (the format is lossy).
    assert torch.allclose(warm.logits, suffix_on_kv(model, ids, expect), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(warm.logits, cold.logits[:, -5:], atol=1e-4, rtol=1e-4)


def test_an_int8_chunk_is_a_miss_for_a_raw_or_fp8_reader_of_the_same_model(model):
    ids = prompt(2 * CHUNK + 1, seed=4)
    readers = [connector(model, fmt) for fmt in (None, "raw", "fp8")]  # the first sizes the pages: raw chunks
    writer = connector(model, "int8")
    assert writer.prefill(ids).saved_chunks == 2
    for reader in readers:
        assert reader.pool.store is writer.pool.store  # one in-process store (pool "fmt-test")
        keys = reader.pool.keys("a", ids[0].tolist())
        assert reader.pool.lookup("a", keys) == 0 and reader.pool.load("a", keys) == []
        assert reader.prefill(ids, save=False).loaded_tokens == 0
    assert connector(model, "int8").prefill(ids).loaded_tokens == 2 * CHUNK


def test_a_local_pool_sized_for_quantized_chunks_refuses_raw_ones_with_the_fix(model):
    connector(model, "int4-kivi", pool="small-pages")
    with pytest.raises(LayoutMismatch, match="its own pool name"):
        connector(model, "raw", pool="small-pages")


class DictClient:
    """The slice of a NodeClient that NodePool uses, over a dict: the cluster pool's codec path
    without a shard."""

    secured = False

    def __init__(self, page_bytes):
        self.shards = {"s0": {"page_bytes": page_bytes}}
        self.chunks = {}

    def get(self, tenant, keys, hit=None, outs=None, local_only=False):
        out = []
        for k in keys:
            if (tenant, bytes(k)) not in self.chunks:
                break
            out.append(np.frombuffer(self.chunks[tenant, bytes(k)], np.uint8))  # read-only, as Ray's store gives
        return out

    def put(self, tenant, keys, payloads, *, shared=False, first_position=0, request=None):
        big = [p.nbytes for p in payloads if p.nbytes > self.shards["s0"]["page_bytes"]]
        assert not big, f"payloads of {big} B over the page"
        self.chunks.update({(tenant, bytes(k)): np.asarray(p).tobytes() for k, p in zip(keys, payloads)})
        return len(keys)


def test_the_cluster_pool_stores_quantized_chunks_and_checks_its_pages(caplog):
    from kvpool.node.pool import NodePool

    spec = spec_for("test/m", 2, 2, 64, torch.float32, chunk_tokens=CHUNK, storage_format="int4-kivi")
    codec = ChunkCodec(spec)
    with pytest.raises(LayoutMismatch, match=f"at least {codec.nbytes} B \\(`kvpool up --page-size {codec.nbytes}`"):
        NodePool(spec, DictClient(codec.nbytes - 1), [Tenant("a")])
    with caplog.at_level("WARNING", logger="kvpool.node.pool"):
        NodePool(spec, DictClient(spec.chunk_nbytes), [Tenant("a")])  # raw-sized pages: it says so
    assert f"--page-size {codec.nbytes}" in caplog.text
    client = DictClient(codec.nbytes)
    pool = NodePool(spec, client, [Tenant("a")])
    keys = pool.keys("a", list(range(2 * CHUNK)))
    chunks = [kv_like(spec, seed=i) for i in range(2)]
    assert pool.save("a", keys, chunks) == 2
    assert all(len(v) == codec.nbytes for v in client.chunks.values())
    loaded = pool.load("a", keys)
    assert all(torch.equal(a, codec.decode(codec.encode(b))) for a, b in zip(loaded, chunks))
    assert all(torch.equal(v.kv, a) for v, a in zip(pool.load_views("a", keys), loaded))
    client.chunks[("a", bytes(keys[1]))] = bytes(codec.nbytes)  # a payload that does not decode
    assert len(pool.load("a", keys)) == 1


def test_the_cluster_pool_keys_and_stores_a_tenants_own_format():
    from kvpool.node.pool import NodePool

    spec = spec_for("test/m", 2, 2, 64, torch.float32, chunk_tokens=CHUNK)  # raw
    tenants = [Tenant("a"), Tenant("b", storage_format="int8")]
    int8 = ChunkCodec(KVSpec(**{**spec.to_dict(), "storage_format": "int8"}))
    with pytest.raises(LayoutMismatch):
        NodePool(spec, DictClient(int8.nbytes), tenants)  # pages for b's chunks, too small for a's
    client = DictClient(spec.chunk_nbytes)
    pool = NodePool(spec, client, tenants)
    tokens = list(range(CHUNK))
    assert pool.namespace("b").spec_fingerprint == int8.spec.fingerprint()
    assert pool.keys("a", tokens) != pool.keys("b", tokens)
    chunk = kv_like(spec)
    for t in ("a", "b"):
        assert pool.save(t, pool.keys(t, tokens), [chunk]) == 1
    assert sorted(len(v) for v in client.chunks.values()) == [int8.nbytes, spec.chunk_nbytes]
    assert torch.equal(pool.load("a", pool.keys("a", tokens))[0], chunk)
    assert torch.equal(pool.load("b", pool.keys("b", tokens))[0], int8.decode(int8.encode(chunk)))


def test_a_tenant_stores_its_own_format_under_keys_of_that_format(model):
    cfg = {"chunk_tokens": CHUNK, "dram_mib": 16, "pool": "tenant-formats",
           "tenants": ["a", {"id": "b", "storage_format": "int4-kivi"}]}
    conn = HFConnector(model, config=cfg, model_id="test/tiny-llama", tenant="a")  # the connector's format: raw
    pool, ids = conn.pool, prompt(2 * CHUNK + 1, seed=9)
    assert pool.store.page_bytes == stored_nbytes(pool.part.spec)  # the largest format any tenant stores, a slice
    for tenant in ("a", "b"):
        assert conn.prefill(ids, tenant=tenant).saved_chunks == 2
    ka, kb = pool.keys("a", ids[0].tolist()), pool.keys("b", ids[0].tolist())
    int4 = KVSpec(**{**conn.spec.to_dict(), "storage_format": "int4-kivi"})
    assert pool.namespace("b").spec_fingerprint == int4.fingerprint() != pool.namespace("a").spec_fingerprint
    sizes = {t: [g.shape[0] for g in pool.store.get_many([a for c in pool.addresses(t, k) for a in c], t)]
             for t, k in (("a", ka), ("b", kb))}
    n, int4_slice = 2 * conn.spec.num_kv_heads, KVSpec(**{**pool.part.spec.to_dict(), "storage_format": "int4-kivi"})
    assert sizes == {"a": [pool.part.spec.chunk_nbytes] * n, "b": [stored_nbytes(int4_slice)] * n}
    warm_a, warm_b = conn.prefill(ids, tenant="a"), conn.prefill(ids, tenant="b")
    assert warm_a.loaded_tokens == warm_b.loaded_tokens == 2 * CHUNK
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, -1:]
    assert torch.allclose(warm_a.logits, full, atol=1e-4, rtol=1e-4)  # raw: exact KV (fp32 sums in another order)
    assert not torch.allclose(warm_b.logits, full, atol=1e-2)  # int4: lossy
    with pytest.raises(BadRequest, match="storage_format"):
        Tenant("c", storage_format="int3")


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smol():
    if not smollm2.available():
        if IN_CI:
            raise RuntimeError("SmolLM2 is not installed: make venv installs it")
        pytest.skip("SmolLM2 is not installed")
    model, tok = smollm2.load()
    return model, tok


def test_smollm2_answers_from_int4_kv_as_from_its_own(smol):
    """The real model, a 2-chunk shared prefix stored int4 (KIVI): the answer's greedy tokens and
    the first token's distribution stay those of the raw KV."""
    model, tok = smol
    doc = " ".join(f"Item {i}: the {w} costs {i * 7 % 50} dollars." for i, w in
                   enumerate(["apple", "pear", "lamp", "chair", "book", "pen", "cup", "desk"] * 8))
    ids = torch.tensor([smollm2.chat_ids(tok, [{"role": "system", "content": doc},
                                               {"role": "user", "content": "What is the capital of France?"}])])
    assert ids.shape[1] > 2 * 256
    conn = HFConnector(model, config={"storage_format": "int4-kivi", "pool": "smol"}, model_id=smollm2.MODEL_ID)
    raw, _ = conn.generate(ids, max_new_tokens=8, use_pool=False)  # recomputed: the model's own KV
    conn.prefill(ids)
    tokens, first = conn.generate(ids, max_new_tokens=8)
    assert first.loaded_tokens == 256 * (ids.shape[1] // 256) and conn.pool.codec.bytes_ratio < 0.2
    assert tokens == raw, (tok.decode(tokens), tok.decode(raw))


# --------------------------------------------------------------------------- capacity


def test_bench_capacity_fills_a_pool_per_format_and_prints_only_json(capfd):
    import json

    from kvpool.cli import main

    assert main(["bench", "capacity", "--mib", "24", "--formats", "raw,int4-kivi,int2-kivi", "--json"]) == 0
    rows = {r["format"]: r for r in json.loads(capfd.readouterr().out)}
    for fmt, r in rows.items():
        spec = KVSpec(**SMOL, dtype="float32", storage_format=fmt)
        assert r["page_bytes"] == stored_nbytes(spec)
        assert r["chunks_held"] == (24 << 20) // r["page_bytes"]  # every page held a chunk before an eviction
    assert rows["raw"]["chunks_held"] * 6 <= rows["int4-kivi"]["chunks_held"] < rows["int2-kivi"]["chunks_held"]
    assert main(["bench", "capacity", "--formats", "int4"]) != 0
    assert "--formats: choose from raw, fp8" in capfd.readouterr().err


def test_a_sealed_tenant_in_a_lossy_format_seals_the_quantized_payload():
    from kvpool.auth import Authority, new_secret

    auth = Authority(new_secret())
    spec = spec_for("test/m", 2, 2, 64, torch.float32, chunk_tokens=CHUNK)
    pool = LocalPool.create(spec, TenantRegistry([Tenant("c", encrypt=True, storage_format="int4-kivi")]), 4,
                            authority=auth)
    cred = auth.issue("c")
    keys = pool.keys(cred, list(range(CHUNK)))
    chunk = kv_like(spec)
    assert pool.save(cred, keys, [chunk]) == 1
    int4 = ChunkCodec(KVSpec(**{**spec.to_dict(), "storage_format": "int4-kivi"}))
    sealed = pool.store.get_many(pool.addresses(cred, keys), "c")[0]
    assert int4.nbytes < sealed.shape[0] < spec.chunk_nbytes  # quantized, then sealed
    assert int4.decode(sealed) is None  # ciphertext, not a payload
    assert torch.equal(pool.load(cred, keys)[0], int4.decode(int4.encode(chunk)))
    assert [torch.equal(v.kv, pool.load(cred, keys)[0]) for v in pool.load_views(cred, keys)] == [True]
