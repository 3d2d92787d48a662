"""``kvpool bench ttft --model smollm2`` (transformers): the real model on real English prompts, one
1K context through the CLI; and the contexts the model's 8192 positions allow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import IN_CI

from kvpool.connectors.bench import ttft_real as bench_ttft_real
from kvpool.connectors.demo import smollm2
from kvpool.errors import BadRequest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if not smollm2.available():  # pragma: no cover - make venv installs it
    if IN_CI:
        pytest.fail("SmolLM2 is not installed: make venv", pytrace=False)
    pytest.skip("SmolLM2 is not installed (make venv)", allow_module_level=True)


def test_contexts_fit_the_models_positions():
    assert bench_ttft_real.max_positions() == 8192
    assert bench_ttft_real.fit([1024, 4096, 8192], answer_tokens=16) == [(1024, 1024), (4096, 4096), (8192, 8176)]
    for bad in (8193, 16384, 256):
        with pytest.raises(BadRequest, match="--context"):
            bench_ttft_real.fit([bad])


def test_prompts_are_real_text_of_exact_lengths_sharing_no_prefix():
    a, b = bench_ttft_real.prompts([300, 300])
    assert len(a) == len(b) == 300
    tok = smollm2.tokenizer()
    head = smollm2.chat_ids(tok, [{"role": "user", "content": ""}])[:10]
    assert a[:10] == b[:10] == head  # the chat template around each
    assert a[40:80] != b[40:80]  # a slice of documentation of its own: no shared prefix past the template
    text = tok.decode(a)
    assert "what is the text above about?" in text and sum(c.isalpha() for c in text) > 600


def test_cli_1k_answers_equal_with_the_pool():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_RUN_DIR", "RAY_ADDRESS"))}
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "ttft", "--model", "smollm2", "--context", "1024",
                        "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    (row,) = json.loads(r.stdout)  # only JSON on stdout
    assert row["engine"] == "hf" and row["model"] == "smollm2" and row["context"] == row["asked_context"] == 1024
    assert row["same_output"] and len(row["answer_tokens"]) == bench_ttft_real.ANSWER_TOKENS
    assert row["loaded_tokens"] == 1023  # four chunks, cut before the last token (computed for its logits)
    assert row["warm_ttft_s"] < row["cold_ttft_s"]
    assert sum(c.isalpha() for c in row["answer"]) > 10  # words, from a real model
