import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from kvpool import BadRequest, ChunkKey, KVSpec, Namespace, chunk_keys
from kvpool.keys import tokens_le_int32

SPEC = KVSpec("meta-llama/Llama-3-8B", 32, 8, 128)


def ns(salt=b"tenant/a", spec=SPEC, adapter="", extra=()):
    return Namespace.for_spec(spec, salt, adapter, extra)


def toks(n, seed=0):
    return np.random.default_rng(seed).integers(0, 128000, n)


def test_chain_is_the_documented_formula():
    n = ns()
    t = toks(8)
    keys = chunk_keys(t, n, 4)
    k1 = xxhash.xxh3_128_digest(bytes(n.root()) + t[:4].astype("<i4").tobytes())
    k2 = xxhash.xxh3_128_digest(k1 + t[4:8].astype("<i4").tobytes())
    assert [bytes(k) for k in keys] == [k1, k2]


def test_only_full_chunks_are_keyed():
    assert len(chunk_keys(toks(1023), ns(), 256)) == 3
    assert chunk_keys(toks(255), ns(), 256) == []
    assert len(chunk_keys(toks(1024), ns(), 256)) == 4


def test_namespace_changes_every_key():
    t = toks(1024)
    base = chunk_keys(t, ns(), 256)
    others = [
        ns(salt=b"tenant/b"),
        ns(spec=KVSpec("meta-llama/Llama-3-8B", 32, 8, 128, dtype="float16")),
        ns(spec=KVSpec("meta-llama/Llama-3-8B", 32, 8, 128, storage_format="fp8")),
        ns(spec=KVSpec("meta-llama/Llama-3-8B", 32, 8, 128, model_revision="v2")),
        ns(adapter="lora-7"),
        ns(extra=("image:abc",)),
    ]
    for other in others:
        keys = chunk_keys(t, other, 256)
        assert not set(keys) & set(base), other


def test_one_token_change_changes_that_chunk_and_after():
    t = toks(256 * 6)
    base = chunk_keys(t, ns(), 256)
    for i in range(6):
        t2 = t.copy()
        t2[i * 256 + 17] += 1
        keys = chunk_keys(t2, ns(), 256)
        assert keys[:i] == base[:i]
        assert all(a != b for a, b in zip(keys[i:], base[i:]))


def test_start_continues_the_chain():
    t = toks(256 * 4)
    whole = chunk_keys(t, ns(), 256)
    head = chunk_keys(t[:512], ns(), 256)
    tail = chunk_keys(t[512:], ns(), 256, start=head[-1])
    assert head + tail == whole


def test_inputs_of_every_kind_give_the_same_keys():
    t = toks(512)
    want = chunk_keys(t, ns(), 256)
    assert chunk_keys(list(map(int, t)), ns(), 256) == want
    assert chunk_keys(torch.tensor(t), ns(), 256) == want
    assert chunk_keys(t.astype(np.uint32), ns(), 256) == want


def test_keys_are_the_same_in_another_process():
    code = (
        "import numpy as np; from kvpool import *;"
        "n=Namespace.for_spec(KVSpec('m',2,2,64),b's');"
        "print(chunk_keys(np.arange(1024),n,256)[-1].hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    here = chunk_keys(np.arange(1024), Namespace.for_spec(KVSpec("m", 2, 2, 64), b"s"), 256)[-1].hex()
    assert outs == {here}


def test_chunk_key_type():
    k = chunk_keys(toks(256), ns(), 256)[0]
    assert isinstance(k, ChunkKey) and isinstance(k, bytes) and len(k) == 16
    assert ChunkKey.from_hex(k.hex()) == k
    with pytest.raises(BadRequest, match="16 bytes"):
        ChunkKey(b"short")
    with pytest.raises(BadRequest, match="hex digits"):
        ChunkKey.from_hex("zz" * 16)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.array([1, -2, 3]), "non-negative|range"),
        (np.array([1, 2**40]), "range"),
        (np.array([[1, 2]]), "1-D"),
        (np.array([1.5, 2.0]), "integer"),
    ],
)
def test_bad_tokens_are_rejected(bad, match):
    with pytest.raises(BadRequest, match=match):
        tokens_le_int32(bad)


def test_hashing_128k_tokens_is_well_under_a_millisecond_per_chunk_chain():
    # The benchmark in docs/benchmarks.md measures this properly; here a loose guard against a
    # regression by orders of magnitude (e.g. a Python loop over tokens).

    t = toks(128 * 1024).astype(np.int32)
    chunk_keys(t, ns(), 256)
    best = min(_timed(lambda: chunk_keys(t, ns(), 256)) for _ in range(5))
    assert best < 0.005, best


def _timed(f):
    import time

    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0
