"""`kvpool up`'s sizing: pages from a model's config (the bytes its connectors store per chunk)
and tiers in bytes or as a share of a node's memory."""

import json
import os

import pytest
import zoo

from kvpool.errors import BadRequest
from kvpool.sizing import MIN_PAGES, parse_tier, resolve_store, tier_pages

# The tiny Qwen2: 5 layers, hidden 768, 12 heads over 3 KV heads (head dim 64), float32.
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 768, "num_hidden_layers": 5,
         "num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 1024, "vocab_size": 1000,
         "torch_dtype": "float32"}


def write(folder, config: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_page_is_the_chunk_the_transformers_connector_stores(family, tmp_path):
    """The layout read from the config alone equals what the connector finds in the model's real
    cache (one probe token): same kinds, heads and widths, so the same chunk bytes."""
    from kvpool.cluster.sizing import kv_layout, model_chunk
    from kvpool.connectors.hf_model import model_layout, model_spec

    zoo.config(family).save_pretrained(tmp_path)
    model = zoo.build(family)
    kinds, heads, k_dim, v_dim, dtype = model_layout(model)
    assert kv_layout(zoo.config(family)) == (kinds, heads, k_dim, 0 if v_dim == k_dim else v_dim)
    chunk = model_chunk(str(tmp_path), zoo.chunk_tokens(family), "float32")
    want = model_spec(model, chunk_tokens=zoo.chunk_tokens(family), weights="given-name")
    assert chunk["chunk_bytes"] == want.chunk_nbytes and chunk["spec"].layer_kinds == want.layer_kinds


def test_small_qwen2_pages_waste_under_10_percent(tmp_path):
    from kvpool.cluster.sizing import model_chunk

    folder = write(tmp_path / "qwen2", QWEN2)
    for tokens, nbytes in ((64, 64 * 5 * 2 * 3 * 64 * 4), (256, 1966080)):  # 1.875 MiB at 256 tokens
        chunk = model_chunk(folder, tokens)  # the config's float32
        assert chunk["chunk_bytes"] == chunk["raw_bytes"] == nbytes and chunk["dtype"] == "float32"
        assert 1 - nbytes / (32 << 20) > 0.94  # the old default page: over 94% of it unused
    int8 = model_chunk(os.path.join(folder, "config.json"), 256, storage_format="int8")
    from kvpool.codec import stored_nbytes

    assert int8["chunk_bytes"] == stored_nbytes(int8["spec"]) < 1966080 / 3
    assert model_chunk(folder, 256, dtype="bfloat16")["chunk_bytes"] == 1966080 // 2


def test_dtype_defaults_to_float16_without_one_in_the_config(tmp_path):
    from kvpool.cluster.sizing import model_chunk

    folder = write(tmp_path / "m", {k: v for k, v in QWEN2.items() if k != "torch_dtype"})
    assert model_chunk(folder, 256)["dtype"] == "float16"


def test_refused_families_and_bad_models_name_the_fix(tmp_path):
    from kvpool.cluster.sizing import model_chunk
    from kvpool.connectors.families import UnsupportedModel, layer_kinds

    linear = {**QWEN2, "layer_types": ["linear_attention"] + ["full_attention"] * 4}
    with pytest.raises(UnsupportedModel) as refused:
        model_chunk(write(tmp_path / "lin", linear))
    with pytest.raises(UnsupportedModel) as connector:
        from kvpool.cluster.sizing import read_config

        layer_kinds(read_config(str(tmp_path / "lin"))[0], engine="kvpool up")
    assert refused.value.message == connector.value.message and "Serve this model without the pool" in refused.value.message
    with pytest.raises(BadRequest, match="no such folder or config.json"):
        model_chunk(str(tmp_path / "missing"))
    with pytest.raises(BadRequest, match="no model_type"):
        model_chunk(write(tmp_path / "nomt", {"hidden_size": 4}))
    with pytest.raises(BadRequest, match="--chunk-tokens"):
        model_chunk(str(tmp_path / "lin"), 0)


@pytest.mark.parametrize("text,want", [("64GiB", 64 << 30), ("500 MB", 500 * 10**6), ("1073741824", 1 << 30),
                                       ("25%", "25%"), ("90%", "90%"), ("12.5 %", "12.5%"), ("0.5%", "0.5%")])
def test_tier_sizes_parse(text, want):
    assert parse_tier(text, "--dram") == want


@pytest.mark.parametrize("text", ["0%", "90.5%", "91%", "-5%", "%", "25%%", "abc", "0", "1.5B", "-1GiB", ""])
def test_bad_tier_sizes_are_refused_naming_the_fix(text):
    with pytest.raises(BadRequest, match=r"--dram.*(64GiB|4GiB|25%)"):
        parse_tier(text, "--dram")


def test_shares_resolve_on_the_node_and_tiers_need_min_pages(tmp_path):
    gib = 1 << 30
    assert tier_pages("25%", 1 << 20, 24 * gib, "--dram") == 6 * 1024
    assert tier_pages("12.5%", 3 << 20, 8 * gib, "--dram") == gib // (3 << 20)
    assert tier_pages(64 * gib, 1966080, 1, "--dram") == 64 * gib // 1966080  # bytes: the node's size plays no part
    with pytest.raises(BadRequest, match=f"at least {MIN_PAGES}: raise --dram"):
        tier_pages(3 << 20, 1 << 20, 24 * gib, "--dram")
    with pytest.raises(BadRequest, match="0.001% of this node's memory"):
        tier_pages("0.001%", 32 << 20, 24 * gib, "--dram")
    cfg = resolve_store({"page_bytes": 1 << 20, "dram": "50%", "policy": "lru"}, memory=64 << 20)
    assert cfg == {"page_bytes": 1 << 20, "dram_pages": 32, "policy": "lru"}
    cfg = resolve_store({"page_bytes": 1 << 20, "dram": 8 << 20, "disk_dir": str(tmp_path), "disk": 5 << 20})
    assert (cfg["dram_pages"], cfg["disk_pages"]) == (8, 5) and "dram" not in cfg and "disk" not in cfg
    import shutil

    total = shutil.disk_usage(tmp_path).total
    cfg = resolve_store({"page_bytes": 1 << 20, "dram_pages": 4, "disk_dir": str(tmp_path), "disk": "1%"})
    assert cfg["disk_pages"] == (total // 100) >> 20
    with pytest.raises(BadRequest, match="not both"):
        resolve_store({"page_bytes": 1 << 20, "dram": "1%", "dram_pages": 4})
    with pytest.raises(BadRequest, match="--disk needs --disk-dir"):
        resolve_store({"page_bytes": 1 << 20, "dram_pages": 4, "disk": 8 << 20})
    assert resolve_store({"page_bytes": 1, "dram_pages": 4}) == {"page_bytes": 1, "dram_pages": 4}  # as before


def _up_args(*argv):
    from kvpool.cli import build_parser

    return build_parser().parse_args(["up", *argv])


def test_up_arguments_size_the_store_before_ray(tmp_path, capsys):
    from kvpool.cli_up import describe, up_store

    folder = write(tmp_path / "qwen2", QWEN2)
    args = _up_args("--model", folder, "--dram", "64MiB")
    store, chunk = up_store(args)
    # a page holds one KV head's slice of a chunk: 5 layers x 2 x 256 tokens x 64 dims x 4 B
    assert chunk["chunk_bytes"] == 1966080 and chunk["slices"] == 3 and chunk["page_bytes"] == 1966080 // 3
    assert store == {"page_bytes": 1966080 // 3, "policy": "default", "dram": 64 << 20}
    assert "0.0% of each page unused" in describe(store, chunk, args)[0]
    assert capsys.readouterr().err == ""
    store, _ = up_store(_up_args("--dram-pages", "16"))  # the explicit alternative, as the chart passes it
    assert store == {"page_bytes": 32 << 20, "policy": "default", "dram_pages": 16}
    assert "pages are 32.00 MiB each (the default); `--model PATH` sizes them" in capsys.readouterr().err
    store, _ = up_store(_up_args())
    assert store["dram"] == 1 << 30  # the default: a fixed size (the slab is committed at start)
    store, _ = up_store(_up_args("--model", folder, "--page-size", "4MiB", "--dram", "25%", "--disk-dir", str(tmp_path),
                                 "--disk", "1GiB"))
    assert store == {"page_bytes": 4 << 20, "policy": "default", "dram": "25%", "disk_dir": str(tmp_path),
                     "disk": 1 << 30}
    for argv, match in [(("--model", folder, "--page-size", "512KiB"), "smaller than one stored slice"),
                        (("--dtype", "float32",), "add --model PATH"),
                        (("--disk", "1GiB",), "add --disk-dir"),
                        (("--disk-dir", str(tmp_path)), "--disk-dir needs the disk tier's size"),
                        (("--model", folder, "--dram", "1MiB"), "holds 1 pages"),
                        (("--dram", "95%",), r"\(0, 90\]%")]:
        with pytest.raises(BadRequest, match=match):
            up_store(_up_args(*argv))
    for argv in (("--dram", "1GiB", "--dram-pages", "4"), ("--disk", "1GiB", "--disk-pages", "4")):
        with pytest.raises(SystemExit):
            _up_args(*argv)
    assert "not allowed with argument" in capsys.readouterr().err
