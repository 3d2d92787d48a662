"""Wrong settings fail loudly at start, and a connector's reporter heartbeats and says goodbye.

- A connector whose "node" pool does not answer (no node file in ``run_dir``, a stale node file,
  a socket that never answers) does not start: ``Unavailable`` names what did not answer and the
  fix. With ``"degraded": true`` it starts, recomputes, and says DEGRADED in its figures.
- A connector's figures go to the controller as a heartbeat, and a goodbye when it closes
  (what `kvpool stats` then shows of them: tests/test_engine_stats.py).
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import time

import pytest
import torch

from kvpool.cluster.reports import Reports
from kvpool.cluster.stats_view import format_stats
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import tiny_llama
from kvpool.connectors.pools import PoolHealth, Reporter, check_config, open_pool, spec_for
from kvpool.errors import BadRequest, Unavailable

SPEC = spec_for("startup-model", 2, 2, 32, "float32", chunk_tokens=16)


def node_config(run_dir, **extra) -> dict:
    return {"backend": "node", "pool": "startup", "chunk_tokens": 16, "run_dir": str(run_dir), "timeout_s": 0.3,
            **extra}


def test_config_takes_degraded_and_start_timeout():
    cfg = check_config({"backend": "node", "degraded": True, "start_timeout_s": 0})
    assert cfg["degraded"] is True and cfg["start_timeout_s"] == 0
    for bad in ({"backend": "node", "degraded": "yes"}, {"backend": "ray"},
                {"degraded": True}, {"backend": "node", "start_timeout_s": -1},
                {"backend": "node", "start_timeout_s": "soon"}):
        with pytest.raises(BadRequest):
            check_config(bad)
    assert check_config({"backend": "local", "degraded": False})["degraded"] is False


def test_an_empty_run_dir_is_a_start_up_error_after_waiting(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as e:
        open_pool(SPEC, node_config(tmp_path, start_timeout_s=0.6))
    took = time.monotonic() - t0
    msg = str(e.value)
    assert e.value.status == 503
    assert str(tmp_path) in msg and "kvpool-startup-*.node" in msg  # what was not there
    assert "kvpool up" in msg and '"degraded": true' in msg and "run_dir" in msg  # the fixes
    assert 0.6 <= took < 5, took  # it waited start_timeout_s for a pool that may be starting, no longer


def test_a_stale_node_file_names_its_socket(tmp_path):
    sock = tmp_path / "gone.sock"
    (tmp_path / "kvpool-startup-n1.node").write_text(json.dumps({"socket": str(sock), "shard": "n1"}))
    with pytest.raises(Unavailable, match="gone.sock") as e:
        open_pool(SPEC, node_config(tmp_path, start_timeout_s=0))
    assert "kvpool-startup-n1.node" in str(e.value) and "did not answer a ping" in str(e.value)


def test_a_socket_that_never_answers_is_an_error_within_the_timeout(tmp_path):
    path = str(tmp_path / "mute.sock")
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(8)  # accepts connections (the kernel does), never answers
    (tmp_path / "kvpool-startup-n1.node").write_text(json.dumps({"socket": path, "shard": "n1"}))
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="mute.sock"):
            open_pool(SPEC, node_config(tmp_path, start_timeout_s=0))
        assert time.monotonic() - t0 < 3
    finally:
        mute.close()


def test_degraded_starts_recomputes_and_says_so(tmp_path, caplog):
    model = tiny_llama(0, layers=1, hidden=64, heads=2, kv_heads=1)
    cfg = node_config(tmp_path, degraded=True)
    with pytest.raises(Unavailable, match="did not answer at start"):  # the same settings without degraded
        HFConnector(model, config={**cfg, "degraded": False, "start_timeout_s": 0})
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="kvpool"):
        conn = HFConnector(model, config=cfg)
    assert time.monotonic() - t0 < 2  # degraded: start_timeout_s defaults to 0
    assert any("DEGRADED" in r.getMessage() for r in caplog.records)
    ids = torch.randint(0, 1024, (1, 3 * 16 + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    got = conn.prefill(ids)
    assert got.loaded_tokens == 0 and got.saved_chunks == 0  # the pool does not answer: recomputed
    assert torch.allclose(got.logits, ref, atol=1e-5)  # the answer is right all the same
    fig = conn.figures()
    assert fig["degraded"] is True and fig["outages"] == 1 and fig["loads"] == 0
    conn.pool.client.close()


def test_a_pool_without_a_node_client_is_never_degraded():
    assert PoolHealth(object()).figures() == {"degraded": False, "degraded_s": 0.0, "outages": 0}


class FakeController:
    """What the pool's report path reaches: the controller's Reports, on a clock we move."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reports = Reports(clock=lambda: self.now)
        self.calls: list[tuple[str, dict]] = []

    def report(self, name: str, figures: dict) -> None:
        self.calls.append((name, figures))
        self.reports.add(name, figures)


def test_reporter_heartbeats_says_goodbye_and_ends_with_its_connector():
    c = FakeController()

    class Conn:
        n = 0

        def figures(self) -> dict:
            self.n += 1
            return {"loads": self.n, "recomputes": 0}

    conn = Conn()
    r = Reporter(c, "hf x pid 1", conn.figures, every_s=0.05)
    deadline = time.monotonic() + 5
    while len(c.calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(c.calls) >= 3 and all(f["every_s"] == 0.05 for _, f in c.calls)  # a heartbeat with its interval
    assert "hf x pid 1" in c.reports.live()
    r.close()
    assert c.calls[-1] == ("hf x pid 1", {"goodbye": True}) and c.reports.live() == {}
    n = len(c.calls)
    time.sleep(0.2)
    assert len(c.calls) == n  # stopped
    # a reporter whose connector is gone stops on its own (it holds the connector weakly)
    conn2 = Conn()
    Reporter(c, "hf y pid 1", conn2.figures, every_s=0.05)
    time.sleep(0.1)
    del conn2
    gc.collect()
    time.sleep(0.2)
    seen = len(c.calls)
    time.sleep(0.3)
    assert len(c.calls) == seen
    assert Reporter(object(), "local", conn.figures)._send is None  # a local pool takes no reports


def test_a_break_even_that_always_loads_still_reports_its_figures():
    """``breakeven_margin`` 0 (load every hit): its figures are the measured ones (a division by the
    margin made every report after the first load fail, so `kvpool stats` froze at that moment)."""
    from kvpool.connectors.breakeven import BreakEven

    be = BreakEven(margin=0.0)
    be.observe_load(1 << 20, 0.001)  # 1 MiB a ms
    be.observe_prefill(100, 0.1)  # 1 ms a token
    st = be.stats(1024)  # 1/1024 ms to load a token
    assert abs(st["load_advantage"] - 1024) < 1e-6 and be.min_tokens(1024) == 0


def test_health_says_what_was_not_measured():
    """A figure with nothing to judge says what it lacked, not a bare n/a; a shard that served no
    read says so, where its node's engines read from shared memory."""
    from kvpool.cluster.pool_stats import summarize

    shard = {"uptime_s": 10.0, "active_requests": 0, "chunks": 2, "tenants": {}, "policy_stats": {},
             "tiers": {"dram": {"chunks": 2, "bytes": 2 << 20, "pages_used": 2, "pages_total": 8}},
             "metrics": {"hits_chunks": {}, "misses_chunks": {}, "evictions": {}, "cancelled_requests": {}}}
    text = format_stats(summarize(1, {"s": shard}, {}, "single-node"))
    (rate,) = [ln for ln in text.splitlines() if ln.strip().startswith("hit_rate")]
    assert "not judged: no chunk read through a shard yet" in rate and "see their hit rates" in rate, text
    assert re.search(r"^s\s+dram\s+2\s+2\.0\s+2/8\s+none yet\s+0$", text, re.M), text  # the quickstart's row parse holds


def test_the_probe_never_imports_ray(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom kvpool.connectors.pools import open_pool, spec_for\n"
            f"spec = spec_for('m', 2, 2, 32, 'float32', chunk_tokens=16)\n"
            f"open_pool(spec, {node_config(tmp_path, degraded=True)!r})\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_RUN_DIR"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_a_pool_that_starts_while_the_connector_waits_is_found(tmp_path, monkeypatch, caplog):
    """``start_timeout_s``: the node file appears (and the shard answers) after the connector began
    waiting; it logs that it waits, then starts without an error."""
    import threading

    from kvpool.node import probe

    monkeypatch.setattr(probe, "WAIT_LOG_S", 0.1)
    path = tmp_path / "kvpool-startup-n1.node"

    class Client:  # what the probe asks of a NodeClient; the shard "answers" once its file is there
        pool, shard, directory, timeout_s = "startup", None, str(tmp_path), 0.3
        calls = 0

        def node_files(self):
            return [str(path)] if path.exists() else []

        def call(self, msg):
            assert msg.OP == "hello" and path.exists()
            self.calls += 1
            return {"shard": "n1"}, []

    client = Client()
    threading.Timer(0.6, lambda: path.write_text("{}")).start()
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="kvpool"):
        assert probe.wait_until_up(client, 5.0) is None
    assert 0.6 <= time.monotonic() - t0 < 3 and client.calls == 1
    assert any("waiting for pool 'startup'" in r.getMessage() for r in caplog.records)  # progress while it waited
