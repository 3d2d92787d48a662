"""``kvpool demo`` on the real model (SmolLM2-135M-Instruct), end to end through the CLI on its
default backend (local Ray, the node path, the embedded index): real answers about documents
that ship with Python, the same greedy tokens with and without the pool, prefixes loaded from
the pool on repeated turns and conversations; and a changed answer fails the demo.
(The random-weight demo, ``--model tiny``, is tested in test_cli.py.)"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys

import pytest
from conftest import IN_CI

from kvpool import cli
from kvpool.connectors.demo import chat as demo_chat
from kvpool.connectors.demo import run as demo
from kvpool.connectors.demo import smollm2
from kvpool.connectors.demo.workload import plan
from kvpool.errors import BadRequest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NEW = 16


@pytest.fixture(scope="module")
def out():
    if not smollm2.available():  # pragma: no cover - make venv installs it
        if IN_CI:
            pytest.fail("SmolLM2 is not installed: make venv", pytrace=False)
        pytest.skip("SmolLM2 is not installed (make venv)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_RUN_DIR", "RAY_ADDRESS"))}
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "demo", "--json", "--tenants", "2", "--conversations", "2",
                        "--turns", "2", "--max-new-tokens", str(MAX_NEW)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)  # only JSON on stdout


def test_real_answers_are_the_same_with_and_without_the_pool(out):
    assert out["model"] == "smollm2" and out["where"] == "local Ray pool, embedded index"
    assert out["spec"]["num_layers"] == 30 and out["spec"]["num_kv_heads"] == 3
    reqs = out["requests"]
    assert len(reqs) == 8 and out["ok"] and out["verified"] == 8 and out["mismatches"] == []
    for r in reqs:
        assert r["same_tokens"] and r["answer"] == r["answer_with_pool"]
        assert 1 <= r["new_tokens"] <= MAX_NEW
        assert sum(c.isalpha() for c in r["answer"]) > 10  # words, from a real model
    assert out["max_first_logit_diff"] < 1e-3
    assert out["store"]["metrics"]["checksum_failures"] == {}


def test_repeated_turns_and_conversations_load_their_prefix(out):
    chunk = out["spec"]["chunk_tokens"]
    for r in out["requests"]:
        if r["turn"] == 1 and r["conversation"] == 1:  # a tenant's first request: nothing cached yet
            assert r["loaded_tokens"] == 0
        else:  # the system prompt and the document at least (> 300 tokens), in whole chunks
            assert r["loaded_tokens"] >= 256 and r["loaded_tokens"] % chunk == 0
            assert r["loaded_tokens"] < r["prompt_tokens"]
    assert set(out["tenants"]) == {"helpdesk", "tutor"}
    for s in out["tenants"].values():
        assert s["requests"] == 4 and 0.3 < s["hit_rate"] < 1
    assert out["ttft"]["requests"] == 6 and out["ttft"]["speedup_min"] > 0


def test_the_report_prints_answers_hit_rates_and_the_verdict(out):
    text = demo.format_report(out)
    flat = " ".join(text.split())
    for r in out["requests"]:
        assert " ".join(demo_chat.shown(r["answer"], r["finished"]).split()) in flat
    for d in out["documents"]:
        assert d["title"] in text and 150 < d["tokens"] < 1500
    assert "verified: 8 of 8 answers are the same greedy tokens" in text and "FAILED" not in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[10:19].strip().isdigit()}
    for name, s in out["tenants"].items():  # the table: tenant, requests, prompt tokens, from pool, hit rate
        assert rows[name][1:5] == [str(s["requests"]), str(s["prompt_tokens"]), str(s["loaded_tokens"]),
                                   f"{s['hit_rate']:.1%}"]


def test_a_changed_answer_fails_the_demo(monkeypatch, capsys):
    bad = {"model": "smollm2", "ok": False, "requests": []}
    monkeypatch.setattr(demo, "run", lambda *a, **k: bad)
    args = argparse.Namespace(model="smollm2", tenants=None, conversations=None, turns=None, max_new_tokens=8,
                              json=True, backend="local", ray_address=None, redis=None)
    assert cli._demo(args) == 1 and json.loads(capsys.readouterr().out) == bad


def test_documents_are_text_that_ships_with_python():
    convs = plan(3, 2, 3)
    assert [c.work.tenant for c in convs] == ["helpdesk", "tutor", "reviewer"] * 2
    assert [len(c.questions) for c in convs] == [3] * 6
    assert convs[0].questions != convs[3].questions  # the second conversation asks on
    docs = {c.work.tenant: c.work.document.text for c in convs}
    assert docs["tutor"] in heapq.__about__ and docs["reviewer"].startswith("The Zen of Python, by Tim Peters")
    assert "Exceptions are a means of breaking out of the normal flow" in docs["helpdesk"]
    for bad in ((4, 2, 3), (0, 2, 3), (3, 0, 3)):
        with pytest.raises(BadRequest, match="--"):
            plan(*bad)
