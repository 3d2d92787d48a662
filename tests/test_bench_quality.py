"""``kvpool bench quality`` on the real model with tiny settings: the rows' fields, the exact
format through the pool equal to the model's own KV, fp8 close to it and small, int2 further."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import IN_CI

from kvpool.cli import main
from kvpool.connectors import compress
from kvpool.connectors.bench import quality as bq
from kvpool.connectors.bench import quality_text
from kvpool.connectors.demo import smollm2

FIELDS = {"kind", "method", "budget", "bytes_ratio", "bytes_ratio_16bit", "greedy_match", "greedy_prefix",
          "ppl_ratio", "kl"}


@pytest.fixture(scope="module")
def smol():
    if not smollm2.available():
        if IN_CI:
            raise RuntimeError("SmolLM2 is not installed: make venv installs it")
        pytest.skip("SmolLM2 is not installed")
    return smollm2.load()


@pytest.fixture(scope="module")
def quick(smol):
    model, tok = smol
    return bq.run(dataclasses.replace(bq.QUICK, formats=("fp8", "int2-kivi")), model=model, tok=tok, progress=False)


def test_rows_have_the_fields_and_every_kind(quick):
    rows = quick["rows"]
    assert all(FIELDS <= set(r) for r in rows), rows
    assert [r["method"] for r in rows if r["kind"] != "eviction"] == ["raw", "fp8", "int2-kivi"]
    assert quick["passages"] == ["execmodel"] and quick["path"] == "pool"
    evicted = [r for r in rows if r["kind"] == "eviction"]
    assert {r["method"] for r in evicted} == set(compress.METHODS)
    assert {r["budget"] for r in evicted} == {80}  # half the 159 compressed tokens (the last one is computed)
    for r in evicted:  # kept tokens over context tokens (adakv and pyramidkv: on average)
        assert 0.4 <= r["bytes_ratio"] <= 0.6 and r["bytes_ratio_16bit"] == r["bytes_ratio"], r


def test_raw_through_the_pool_is_the_models_own_kv(quick):
    raw = quick["rows"][0]
    assert raw["kind"] == "raw" and raw["bytes_ratio"] == 1.0
    assert raw["greedy_match"] == 1.0 and raw["kl"] < 1e-6 and abs(raw["ppl_ratio"] - 1) < 1e-4, raw


def test_fp8_is_close_and_small_and_int2_is_further(quick):
    fp8, int2 = (next(r for r in quick["rows"] if r["method"] == m) for m in ("fp8", "int2-kivi"))
    assert fp8["bytes_ratio"] < 0.5 < fp8["bytes_ratio_16bit"] < 0.55  # float32 chunks; scales cost 1/16
    assert abs(fp8["ppl_ratio"] - 1) < 0.05 and fp8["kl"] < 0.01, fp8
    assert int2["bytes_ratio"] < fp8["bytes_ratio"] and int2["kl"] > 5 * fp8["kl"], (fp8, int2)
    assert [t["format"] for t in quick["targets"]] == ["fp8"] and quick["targets"][0]["met_vs_16bit"] is False


def test_figures_compare_against_the_reference():
    ref = bq.Outcome(torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]], dtype=torch.float64), -1),
                     [1, 2, 0, 0])
    same = bq.compare(ref, ref, [0, 1])
    assert same["kl"] == 0 and same["match"] == same["prefix"] == 1.0
    flat = bq.Outcome(torch.full((2, 3), -torch.log(torch.tensor(3.0, dtype=torch.float64))), [1, 0, 0, 0])
    got = bq.compare(ref, flat, [0, 1])
    assert got["match"] == 0.75 and got["prefix"] == 0.25 and got["kl"] > 0 and got["nll"] > got["nll_ref"]
    row = bq.summarize([got])
    assert row["greedy_match"] == 0.75 and row["ppl_ratio"] == pytest.approx(
        torch.tensor((got["nll"] - got["nll_ref"]) / 2).exp().item(), abs=1e-5)


def test_passages_are_the_reference_manuals_own_text(smol):
    _, tok = smol
    (name, ids), = quality_text.passages(tok, 1, 300)
    assert name == "execmodel" and len(ids) == 300
    assert tok.decode(ids[:40]) in quality_text.topics()["execmodel"]


def test_cli_prints_only_json_and_writes_the_plot(smol, tmp_path, capfd):
    png = tmp_path / "q.png"
    assert main(["bench", "quality", "--quick", "--formats", "int8", "--methods", "none", "--json",
                 "--plot", str(png)]) == 0
    out = json.loads(capfd.readouterr().out)
    assert [r["method"] for r in out["rows"]] == ["raw", "int8"] and out["settings"]["methods"] == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, says", [(["--budgets", "1.5"], "--budgets"), (["--formats", "int3"], "--formats"),
                                        (["--context", "64"], "--context"), (["--budgets", "half"], "--budgets"),
                                        (["--methods", "h3o"], "--methods")])
def test_bad_settings_are_refused_naming_the_fix(argv, says, capsys):
    assert main(["bench", "quality", "--quick", *argv]) == 2
    assert says in capsys.readouterr().err
