import pytest

from kvpool import BadRequest, KVSpec


def test_llama3_8b_chunk_is_32_mib():
    spec = KVSpec("meta-llama/Llama-3-8B", 32, 8, 128, dtype="bfloat16", chunk_tokens=256)
    assert spec.chunk_shape == (32, 2, 256, 8, 128)
    assert spec.chunk_nbytes == 32 << 20


def test_fingerprint_is_stable_and_distinguishes_every_field():
    base = KVSpec("m", 2, 2, 64)
    assert base.fingerprint() == KVSpec("m", 2, 2, 64).fingerprint()
    variants = [
        KVSpec("m2", 2, 2, 64), KVSpec("m", 3, 2, 64), KVSpec("m", 2, 4, 64), KVSpec("m", 2, 2, 128),
        KVSpec("m", 2, 2, 64, dtype="float16"),
        KVSpec("m", 2, 2, 64, chunk_tokens=512), KVSpec("m", 2, 2, 64, storage_format="int8"),
        KVSpec("m", 2, 2, 64, model_revision="abc"), KVSpec("m", 2, 2, 64, weights="files:ab"),
        KVSpec("m", 2, 2, 64, layer_kinds=("sliding:4096", "full")), KVSpec("m", 2, 2, 64, layer_kinds=("full", "sliding:4096")),
        KVSpec("m", 2, 2, 64, layer_kinds=("sliding:4095", "full")), KVSpec("m", 2, 2, 64, layer_kinds=("chunked:4096", "full")),
        KVSpec("m", 2, 2, 64, layer_kinds=("latent", "latent")), KVSpec("m", 2, 2, 64, v_head_dim=32),
        KVSpec("m", 2, 2, 64, engine="vllm"),
    ]
    fps = {v.fingerprint() for v in variants} | {base.fingerprint()}
    assert len(fps) == len(variants) + 1


def test_engines_with_different_block_sizes_share_chunks():
    # The chunk layout is canonical: how an engine pages its cache does not change the bytes.
    assert KVSpec("m", 2, 2, 64, block_size=32).fingerprint() == KVSpec("m", 2, 2, 64, block_size=16).fingerprint()


def test_round_trip_through_dict():
    spec = KVSpec("m", 2, 2, 64, dtype="float16")
    assert KVSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(BadRequest, match="unknown KVSpec fields"):
        KVSpec.from_dict({**spec.to_dict(), "heads": 3})


def test_layouts_described_in_more_or_fewer_words_are_one_layout():
    assert KVSpec("m", 2, 2, 64, layer_kinds=["full", "full"], v_head_dim=64) == KVSpec("m", 2, 2, 64)
    assert KVSpec("m", 2, 2, 64, layer_kinds=("full", "full")).fingerprint() == KVSpec("m", 2, 2, 64).fingerprint()
    spec = KVSpec("m", 2, 1, 512, layer_kinds=("latent", "latent"), v_head_dim=64, dtype="float32")
    assert KVSpec.from_dict(spec.to_dict()) == spec and spec.kind(1) == "latent" and KVSpec("m", 1, 1, 8).kind(0) == "full"
    assert spec.chunk_shape == (2, 256, 1, 576) and spec.chunk_nbytes == 2 * 256 * 576 * 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(layer_kinds=("full",)), "names 1 layers"),
        (dict(layer_kinds=("sliding", "full")), "layer kind"),
        (dict(layer_kinds=("sliding:0", "full")), "layer kind"),
        (dict(layer_kinds=("window:8", "full")), "layer kind"),
        (dict(layer_kinds="full"), "one kind per layer"),
        (dict(v_head_dim=-1), "v_head_dim"),
        (dict(v_head_dim=32, storage_format="fp8"), "one width"),
        (dict(weights=b"x"), "weights"),
        (dict(engine=None), "engine"),
        (dict(num_layers=0), "num_layers"),
        (dict(head_dim=-1), "head_dim"),
        (dict(dtype="int3"), "dtype"),
        (dict(storage_format="zip"), "storage_format"),
        (dict(block_size=16, chunk_tokens=100), "multiple"),
        (dict(model_id=""), "model_id"),
    ],
)
def test_bad_specs_name_the_fix(kwargs, match):
    args = dict(model_id="m", num_layers=2, num_kv_heads=2, head_dim=64) | kwargs
    with pytest.raises(BadRequest, match=match):
        KVSpec(**args)
