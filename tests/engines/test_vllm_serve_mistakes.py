"""The ordinary mistakes of a vLLM user's first hour, each through `vllm serve` with the static
connector config the README has users write once: every one either works or stops the server at
start with the fix in its log -- never a server that serves without the pool.

The pool is a single-node pool (`kvpool up`, one process, from the pool's own virtualenv) serving
tenants default and acme, its pages sized to the tiny model's float32 chunks; a second one sized
for float16 stands for "the checkpoint's dtype, served as float32". The servers start side by side
(each loads the model; the ones that fail stop at their connector's start-up check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import need_engines

need_engines("vllm")

from tinymodel import random_prompt, save_tiny_llama  # noqa: E402

from kvpool.auth import Authority  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVPOOL = os.path.join(REPO, ".venv", "bin", "kvpool")
VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")
CHUNK = 64
START_TIMEOUT_S = 420  # several servers loading at once on two cores
STATIC = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def base_env(home, run_dir) -> dict:
    drop = ("VLLM_", "RAY_ADDRESS", "KVPOOL_SECRET", "KVPOOL_RUN_DIR", "KVPOOL_POOL_RECORD", "KVPOOL_CREDENTIAL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"HOME": str(home), "KVPOOL_RUN_DIR": str(run_dir), "HF_HUB_OFFLINE": "1"})
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`vllm serve MODEL ... --kv-transfer-config CONFIG` in ``env``, its log in ``workdir``."""

    def __init__(self, name: str, model: str, workdir, env: dict, extra: dict) -> None:
        self.name, self.port = name, free_port()
        config = {**STATIC, "kv_connector_extra_config": {"backend": "node", "chunk_tokens": CHUNK, **extra}}
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [VLLM, "serve", model, "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                 "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "32", "--enforce-eager",
                 "--max-model-len", "1024", "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
                 "--kv-transfer-config", json.dumps(config)],
                stdout=log, stderr=subprocess.STDOUT, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"},
                start_new_session=True)

    def state(self) -> str | None:
        """"exited", "up", or None while it starts."""
        if self.proc.poll() is not None:
            return "exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return "up" if r.status == 200 else None
        except OSError:
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, tokens: list[int]) -> dict:
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 2, "temperature": 0.0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def pool_up(home, run_dir, model: str, *extra: str) -> dict:
    home.mkdir()
    run_dir.mkdir()
    env = base_env(home, run_dir)
    r = subprocess.run([KVPOOL, "up", "--model", model, "--chunk-tokens", str(CHUNK), "--dram", "64MiB",
                        "--tenant", "default", "--tenant", "acme", *extra], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return env


def write_credentials(home, creds: dict) -> None:
    folder = home / ".kvpool"
    folder.mkdir(exist_ok=True)
    path = folder / "credentials.json"
    path.write_text(json.dumps(creds))
    path.chmod(0o600)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("mistakes")
    model = save_tiny_llama(work / "model", seed=0)
    pool = pool_up(work / "pool", work / "run", model)
    half = pool_up(work / "pool16", work / "run16", model, "--dtype", "float16")  # pages for float16 KV
    r = subprocess.run([KVPOOL, "connect", "vllm", "--tenant", "default", "--tenant", "acme", "--chunk-tokens",
                        str(CHUNK)], env=pool, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([KVPOOL, "connect", "vllm", "--chunk-tokens", str(CHUNK)], env=half, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pool_secret = (work / "pool" / ".kvpool" / "secret").read_text().strip()
    empty = work / "empty-run"
    empty.mkdir()
    homes = {name: work / f"home-{name}" for name in ("other_secret", "unknown_tenant", "down")}
    for h in homes.values():
        h.mkdir()
    write_credentials(homes["other_secret"], {"default": Authority("another-pool-secret-" + "3" * 32).issue("default")})
    write_credentials(homes["unknown_tenant"], {"globex": Authority(pool_secret).issue("globex")})
    cases = {
        "works": (pool, {}),
        "pool_down": (base_env(homes["down"], empty), {"start_timeout_s": 2}),
        "other_secret": ({**pool, "HOME": str(homes["other_secret"])}, {}),
        "unknown_tenant": ({**pool, "HOME": str(homes["unknown_tenant"])}, {"tenants": ["globex"]}),
        "typo": (pool, {"chunk_token": CHUNK}),
        "dtype": (half, {}),
        "degraded": (base_env(homes["down"], empty), {"degraded": True}),
    }
    servers = {name: Served(name, model, work, env, extra) for name, (env, extra) in cases.items()}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(s.state() is None for s in servers.values()) and time.monotonic() < deadline:
            time.sleep(1.0)
        yield servers, {name: s.state() for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
        for env in (pool, half):
            subprocess.run([KVPOOL, "down"], env=env, capture_output=True, timeout=120)


@pytest.mark.parametrize("case, fix", [
    ("pool_down", ["did not answer at start", "kvpool up", '"degraded": true']),
    ("other_secret", ["does not take tenant 'default'", "kvpool connect vllm --tenant default"]),
    ("unknown_tenant", ["tenant 'globex' is not one of the pool's tenants", "kvpool up --tenant globex"]),
    ("typo", ["'chunk_token' (did you mean 'chunk_tokens'?)"]),
    ("dtype", ["--dtype float32"]),
])
def test_a_mistake_stops_the_server_at_start_with_the_fix(served, case, fix):
    servers, states = served
    log = servers[case].log()
    assert states[case] == "exited", f"{case}: {states[case]}\n{log[-4000:]}"
    for words in fix:
        assert words in log, f"{case}: {words!r} not in the log:\n{log[-4000:]}"


def test_the_static_config_works_and_degraded_serves_without_the_pool(served):
    servers, states = served
    for case in ("works", "degraded"):
        assert states[case] == "up", f"{case}: {states[case]}\n{servers[case].log()[-4000:]}"
        out = servers[case].complete(random_prompt(200, seed=1))
        assert out["usage"]["prompt_tokens"] == 200 and out["usage"]["completion_tokens"] == 2
    assert "DEGRADED" in servers["degraded"].log()
