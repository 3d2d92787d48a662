"""The ordinary mistakes of a vLLM user's first hour, each through `vllm serve` with the static
connector config a user writes once, literally (what `kvpool connect vllm` prints): every one
either works or stops the server at start with the fix in its log -- never a server that serves
without the pool.

The pool is a single-node pool (`kvpool up`, one process, from the pool's own virtualenv) serving
tenants default and acme, its pages sized to the tiny model's float32 chunks; a second one sized
for float16 stands for "the checkpoint's dtype, served as float32". The servers start side by side
(each loads the model; the ones that fail stop at their connector's start-up check). The static
config works twice over: a second server with the two-tenant config loads what the first saved,
as a server does after a restart (its own prefix cache empty).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import need_engines, vllm_cache_root

need_engines("vllm")

from tinymodel import random_prompt, save_tiny_llama  # noqa: E402

from kvpool.auth import Authority  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVPOOL = os.path.join(REPO, ".venv", "bin", "kvpool")
VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")
START_TIMEOUT_S = 540  # seven servers loading at once on two cores
KV_BYTES = 64 << 20  # each server's KV cache: 32k tokens of the tiny model (2 KiB a token), not vLLM's 1 GiB
# What `kvpool connect vllm` prints for tenant default: the whole config, written once.
STATIC = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
          "kv_role": "kv_both"}
TWO = {**STATIC, "kv_connector_extra_config": {"tenants": ["default", "acme"]}}  # ... for tenants default and acme


def base_env(home, run_dir) -> dict:
    drop = ("VLLM_", "RAY_ADDRESS", "KVPOOL_SECRET", "KVPOOL_RUN_DIR", "KVPOOL_POOL_RECORD", "KVPOOL_CREDENTIAL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"HOME": str(home), "KVPOOL_RUN_DIR": str(run_dir), "HF_HUB_OFFLINE": "1",
                "VLLM_CACHE_ROOT": vllm_cache_root()})
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_extra(**extra) -> dict:
    return {**STATIC, "kv_connector_extra_config": extra}


class Served:
    """`vllm serve MODEL ... --kv-transfer-config CONFIG` in ``env``, its log in ``workdir``."""

    def __init__(self, name: str, model: str, workdir, env: dict, config: dict) -> None:
        self.name, self.port = name, free_port()
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [VLLM, "serve", model, "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                 "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "32", "--enforce-eager",
                 "--max-model-len", "1024", "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
                 "--kv-cache-memory-bytes", str(KV_BYTES), "--kv-transfer-config",
                 json.dumps(config, separators=(",", ":"))],
                stdout=log, stderr=subprocess.STDOUT, env=env,  # no VLLM_*: its KV space is the flag's
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
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def loaded_tokens(self) -> float:
        """The connector's own count of the tokens it loaded that vLLM kept (its /metrics series)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(m[1]) for m in re.finditer(r"^kvpool:loaded_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", text,
                                                     re.M))

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
    r = subprocess.run([KVPOOL, "up", "--model", model, "--dram", "64MiB", "--tenant", "default", "--tenant", "acme",
                        *extra], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return env


def connect(env, *args: str) -> dict:
    r = subprocess.run([KVPOOL, "connect", "vllm", *args], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


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
    # what `kvpool connect` prints is the literal each server below is given
    assert connect(pool, "--tenant", "default", "--tenant", "acme") == TWO
    assert connect(half) == STATIC
    pool_secret = (work / "pool" / ".kvpool" / "secret").read_text().strip()
    empty = work / "empty-run"
    empty.mkdir()
    homes = {name: work / f"home-{name}" for name in ("credentials", "no_credentials", "down")}
    for h in homes.values():
        h.mkdir()
    # three tenants, three mistakes: default's credential from another pool secret, none for acme,
    # globex a tenant the pool does not serve; one start names all three
    write_credentials(homes["credentials"], {"default": Authority("another-pool-secret-" + "3" * 32).issue("default"),
                                             "globex": Authority(pool_secret).issue("globex")})
    cases = {
        "works": (pool, STATIC),
        "works_two_tenants": (pool, TWO),
        "pool_down": (base_env(homes["down"], empty), STATIC),
        "no_credentials": ({**pool, "HOME": str(homes["no_credentials"])}, STATIC),  # no `kvpool connect` here
        "credentials": ({**pool, "HOME": str(homes["credentials"])}, with_extra(tenants=["default", "acme", "globex"])),
        "typo": (pool, with_extra(chunk_token=256)),
        "dtype": (half, STATIC),
        "degraded": (base_env(homes["down"], empty), with_extra(degraded=True)),
    }
    # NOTE: each server's engine bound to a core of its own in turn: vLLM's CPU build binds every one
    # to core 0 by default, and seven engines then start one after another on one core
    cores = os.cpu_count() or 1
    servers = {name: Served(name, model, work, {**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}, config)
               for i, (name, (env, config)) in enumerate(cases.items())}
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
    ("no_credentials", ["tenant 'default' has no credential", "no such file", "kvpool connect vllm --tenant default"]),
    ("credentials", ["3 of its tenants cannot use the pool",
                     "does not take the credential of tenant 'default'", "another pool secret",
                     "kvpool connect vllm --tenant default",
                     "tenant 'acme' has no credential", "kvpool connect vllm --tenant acme",
                     "tenant 'globex' is not one of the pool's tenants ['acme', 'default']",
                     "kvpool up --tenant globex"]),
    ("typo", ["'chunk_token' (did you mean 'chunk_tokens'?)"]),
    ("dtype", ["kvpool up --model MODEL --dtype float32"]),
])
def test_a_mistake_stops_the_server_at_start_with_the_fix(served, case, fix):
    servers, states = served
    log = servers[case].log()
    assert states[case] == "exited", f"{case}: {states[case]}\n{log[-4000:]}"
    for words in fix:
        assert words in log, f"{case}: {words!r} not in the log:\n{log[-4000:]}"


def test_the_static_config_works_and_a_fresh_server_loads_what_another_saved(served):
    servers, states = served
    for case in ("works", "works_two_tenants"):
        assert states[case] == "up", f"{case}: {states[case]}\n{servers[case].log()[-4000:]}"
    prompt = random_prompt(600, seed=1)  # two whole 256-token chunks
    first = servers["works"].complete(prompt)
    again = servers["works_two_tenants"]  # its own prefix cache empty, as after a restart
    second = again.complete(prompt)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 512, second["usage"]
    deadline = time.monotonic() + 5  # the engine publishes its figures after the step that finished the request
    while again.loaded_tokens() < 512 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert again.loaded_tokens() == 512  # loaded from the pool, the connector says, not only planned
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]  # from KV as good as its own


def test_degraded_serves_without_the_pool_and_says_so(served):
    servers, states = served
    s = servers["degraded"]
    assert states["degraded"] == "up", f"degraded: {states['degraded']}\n{s.log()[-4000:]}"
    out = s.complete(random_prompt(300, seed=2))
    assert out["usage"]["prompt_tokens"] == 300 and out["usage"]["completion_tokens"] == 2
    assert "DEGRADED" in s.log()
