"""``kvpool bench route``: prefix-aware routing through real engines, beside round-robin in one run.

Set-up, as a user runs it: a pool of two nodes (two Ray nodes on this machine, a shard each:
:class:`~kvpool.connectors.bench.node_pool_proc.NodePool`), two vLLM OpenAI servers, one on each
node (each on a core of its own, each publishing its KV events on a local socket), and two
``kvpool route`` processes in front of both: one ``tier-aware``, one ``round-robin``.

Each run: a fresh workload (:mod:`~kvpool.connectors.bench.route_load`; vLLM's caches emptied
first) in two arms of different tenants with the same conversations, token for token, one arm per
router. Requests go one at a time, the arms alternating step by step (which one goes first
alternates too), so both see the same engines in the same state of load. Per arm and run: the
median time to first token (of every request, and of the follow-up turns, the requests a
conversation's history could serve), and where the prompts' tokens came from (the instance's own GPU cache,
its node's shard, another node's shard, prefill). Over the runs: the median and range of each, and
of round-robin's median TTFT over tier-aware's. The answers of the two arms must be equal, token
for token, in every run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvpool.connectors.bench.node_pool_proc import CHUNK_TOKENS, TENANT, NodePool, free_port, terminated_as_interrupt
from kvpool.connectors.bench.node_pool_proc import log as _log
from kvpool.connectors.bench.route_load import Client, workload
from kvpool.connectors.bench.vllm_server_proc import Server
from kvpool.errors import BadRequest

ARMS = ("tier-aware", "round-robin")


def _log_(msg: str, progress: bool) -> None:
    _log(msg, progress, "route")


class Router:
    """``kvpool route`` in a process of its own, in front of ``servers``."""

    def __init__(self, policy: str, servers: list[Server], shards: list[str], config_file: str, model: str,
                 workdir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [os.path.join(os.path.dirname(sys.executable), "kvpool"), "route", "--policy", policy,
               "--port", str(self.port), "--config", "@" + config_file, "--model", model, "--dtype", "float32",
               *(a for s, sid in zip(servers, shards) for a in ("--instance", f"http://127.0.0.1:{s.port},shard={sid}"))]
        self.log_path = os.path.join(workdir, f"router-{policy}.log")
        self._log = open(self.log_path, "a")  # a restarted router's log follows the one before
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Until every instance is up and followed through its KV events."""
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpool route exited with {self.proc.returncode}:\n{open(self.log_path).read()[-4000:]}")
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(urllib.request.urlopen(self.url + "/kvpool/route", timeout=2).read())
                if all(i["up"] and i["events"] for i in state["instances"]):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvpool route did not see its instances up in {timeout_s} s:\n"
                                   f"{open(self.log_path).read()[-4000:]}")
            time.sleep(0.3)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def run(runs: int = 5, tenants: int = 3, conversations: int = 2, turns: int = 4, system_tokens: int = 1024,
        user_tokens: int = 64, answer_tokens: int = 32, model: str = "random", progress: bool = True) -> dict:
    if min(runs, tenants, conversations, turns, answer_tokens) < 1 or system_tokens < CHUNK_TOKENS:
        raise BadRequest(f"runs, tenants, conversations, turns and answer tokens at least 1, and a system prompt of "
                         f"at least one chunk ({CHUNK_TOKENS} tokens)")
    if model not in ("random", "tiny"):
        raise BadRequest(f"--model {model!r}: random (the benchmark Llama) or tiny (the tests' 2-layer Llama)")
    shape = dict(runs=runs, tenants=tenants, conversations=conversations, turns=turns, system_tokens=system_tokens,
                 user_tokens=user_tokens, answer_tokens=answer_tokens, model=model)
    with terminated_as_interrupt():
        return _run(shape, progress)


class Bed:
    """The set-up (see the module docstring), started by :meth:`start`, torn down by :meth:`close`:
    ``servers`` (one a node), ``routers`` (one an arm, by policy), ``ids`` (each arm's tenants),
    ``secrets`` (each tenant's request secret), ``cfg`` (the model's config), ``shards``.
    ``server_args``, ``server_env``: more of ``vllm serve``'s arguments and environment for each server."""

    def __init__(self, model: str, tenants: int, context: int, progress: bool = True,
                 policies: tuple[str, ...] = ARMS, server_args: tuple[str, ...] = (),
                 server_env: dict[str, str] | None = None) -> None:
        self.workdir = tempfile.mkdtemp(prefix="kvpool-bench-route-")
        self.progress, self.context, self.policies = progress, context, policies
        self.server_args, self.server_env = server_args, server_env or {}
        self.to_close: list = []
        self.model_dir, self.cfg = _model(model, self.workdir)
        self.ids = {arm: [f"{arm[:2]}{i}" for i in range(tenants)] for arm in policies}
        self.servers: list[Server] = []
        self.routers: dict[str, Router] = {}

    def start(self, chunks: int) -> "Bed":
        """``chunks``: whole chunks each shard holds."""
        cfg, heads = self.cfg, self.cfg.num_key_value_heads
        chunk_bytes = cfg.num_hidden_layers * 2 * CHUNK_TOKENS * heads * cfg.head_dim * 4
        self.pool = NodePool(1 << max(chunk_bytes // heads - 1, 1).bit_length(), chunks * heads, self.progress,
                             nodes=2, tenants=(TENANT, *(t for ids in self.ids.values() for t in ids)))
        self.to_close.append(self.pool)
        self.pool.start()
        self.shards = self.pool.shards()
        _log_(f"pool up: shards {self.shards}", self.progress)
        for i, sid in enumerate(self.shards):
            # NOTE: local sockets (events carry the requests' salts); the replay lets a router that
            # (re)starts learn what the instance holds already
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{self.workdir}/events-{i}",
                      "replay_endpoint": f"ipc://{self.workdir}/replay-{i}"}
            s = Server(self.model_dir, self.pool.connector_config(shard=sid), self.context, self.workdir,
                       multiprocess=True, max_model_len=self.context + 64,
                       extra_args=("--kv-events-config", json.dumps(events), *self.server_args),
                       extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(i % max(1, os.cpu_count() or 1)), **self.server_env})
            self.to_close.append(s)
            self.servers.append(s)
        for s in self.servers:
            _log_(f"vLLM server on :{s.port} up in {s.wait_healthy():.0f} s", self.progress)
        from kvpool.auth_cli import write_private

        # NOTE: it holds the tenants' credentials: 0600, as `kvpool connect` writes them
        self.config_file = write_private(os.path.join(self.workdir, "router-config.json"), json.dumps(
            {"kv_connector": "KVPoolConnector",
             "kv_connector_extra_config": self.pool.connector_config(shard=self.shards[0])}),
            "the router's config", "--config")
        for arm in self.policies:
            self.start_router(arm)
        for r in self.routers.values():
            r.wait_ready()
        from kvpool.auth import request_secret

        # each tenant's request secret (its requests' cache_salt), derived from its credential as the connector does
        self.secrets = {t: request_secret(c) for t, c in self.pool.credentials.items()}
        return self

    def start_router(self, arm: str) -> "Router":
        """(Re)starts the router of ``arm`` (not yet ready: ``wait_ready``)."""
        old = self.routers.pop(arm, None)
        if old is not None:
            old.close()
            self.to_close.remove(old)
        self.routers[arm] = Router(arm, self.servers, self.shards, self.config_file, self.model_dir, self.workdir)
        self.to_close.append(self.routers[arm])
        return self.routers[arm]

    def reset_caches(self, timeout_s: float = 30.0) -> None:
        """Empties vLLM's own caches, and waits until every router has seen it: vLLM publishes the
        event in its next engine step, so each server is sent a prompt shorter than a block."""
        import urllib.request

        for s in self.servers:
            s.reset_prefix_cache()
            status, raw = s._request("POST", "/v1/completions", {"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1})
            if status != 200:
                raise RuntimeError(f"a server answered {status}: {raw[:300]!r}")
        deadline = time.monotonic() + timeout_s
        for r in self.routers.values():
            while any(i["gpu_blocks"] for i in json.loads(urllib.request.urlopen(
                    r.url + "/kvpool/route", timeout=10).read())["instances"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("a router still shows blocks in vLLM's emptied caches")
                time.sleep(0.05)

    def close(self) -> None:
        for x in reversed(self.to_close):
            with contextlib.suppress(Exception):
                x.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _run(shape: dict, progress: bool) -> dict[str, Any]:
    from kvpool.connectors.bench.route_measure import Meter, summarize

    context = shape["system_tokens"] + shape["turns"] * (shape["user_tokens"] + shape["answer_tokens"])
    bed = Bed(shape["model"], shape["tenants"], context, progress)
    try:
        chunks = 2 * 2 * shape["tenants"] * shape["conversations"] * (-(-context // CHUNK_TOKENS)) + 16  # two runs'
        bed.start(chunks)
        meter = Meter(bed.servers, bed.pool, bed.cfg.num_key_value_heads)
        bed.to_close.append(meter)
        rows = []
        for run_i in range(shape["runs"]):
            bed.reset_caches()
            arms = {arm: workload({t: bed.secrets[t] for t in bed.ids[arm]}, shape["conversations"], shape["turns"],
                                  shape["system_tokens"], shape["user_tokens"], bed.cfg.vocab_size, seed=run_i)
                    for arm in ARMS}
            clients = {arm: Client(bed.routers[arm].url, "bench") for arm in ARMS}
            try:
                rows.append(meter.run(arms, clients, shape["turns"], shape["answer_tokens"]))
            finally:
                for c in clients.values():
                    c.close()
            r = rows[-1]
            _log_(f"run {run_i + 1}/{shape['runs']}: median TTFT tier-aware {r['tier-aware']['ttft_median_s']:.3f} s, "
                  f"round-robin {r['round-robin']['ttft_median_s']:.3f} s; same-node tokens "
                  f"{r['tier-aware']['same_node_share']:.0%} vs {r['round-robin']['same_node_share']:.0%}; "
                  f"answers {'equal' if r['same_answers'] else 'DIFFER'}", progress)
        import urllib.request

        out = summarize(shape, rows, bed.shards)
        out["router_costs"] = {arm: json.loads(urllib.request.urlopen(r.url + "/kvpool/route", timeout=10).read())["cost"]
                               for arm, r in bed.routers.items()}  # what each router measured (kvpool route's costs.py)
        return out
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # NOTE: a second signal must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        bed.close()


def _model(name: str, workdir: str):
    import torch

    from kvpool.connectors.hf_model import tiny_llama

    model = tiny_llama(0, layers=8, hidden=512, heads=8, kv_heads=4, vocab=4096) if name == "random" else \
        tiny_llama(0, layers=2, hidden=256, heads=4, kv_heads=2, vocab=1024)
    path = os.path.join(workdir, "model")
    model.save_pretrained(path)
    cfg = model.config
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    torch.set_flush_denormal(True)
    return path, cfg
