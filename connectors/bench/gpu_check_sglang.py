"""SGLang's real server with kvpool as its HiCache storage backend, end to end, on a machine with an
NVIDIA GPU: ``python -m kvpool.connectors.bench.gpu_check sglang [--python ENGINE_PYTHON] [--dry-run]``.

1. A pool that outlives the server, run from this interpreter's environment (the pool's, ``.venv``):
   a Ray head of its own (``ray start --head``, loopback, its own temp dir), then ``kvpool up``
   (a secured pool: a fresh secret), both with the pool's run dir in ``$KVPOOL_RUN_DIR``.
2. SGLang's server, ``ENGINE_PYTHON -m sglang.launch_server`` (an environment with SGLang's CUDA
   build and kvpool; default: this interpreter) on a random tiny Llama (fp16, no tokenizer), with
   ``--enable-hierarchical-cache --hicache-storage-backend dynamic`` and kvpool's backend on the
   pool through ``backend: "node"``.
3. A 1024-token prompt, greedy, through ``POST /generate``: the cold answer. Then a wait until the
   pool holds the prompt's pages (SGLang writes them through to storage in the background).
4. The server stopped and started again (its GPU and host caches are gone), the same prompt: the
   answer must be the cold one, and at least a page of its prefix must come from storage
   (``meta_info.cached_tokens_details.storage``).
5. Everything it started is stopped; the Ray head by the processes that name its temp dir (never
   ``ray stop``, which stops every Ray of the machine).

Every wait has a timeout (``TIMEOUTS``) and every step prints a line on stderr; a failing step
shows the end of its log. ``--dry-run`` prints the plan (commands, environment, extra config,
request) as JSON and starts nothing: it needs neither a GPU nor SGLang.

NOTE: why a GPU. SGLang 0.5.23's HiCache has no CPU path: its host pool pins its buffer with
``cudaHostRegister`` through ``torch.cuda.cudart()`` (``pool_host/common.py``:
``alloc_with_host_register``, the allocator for every device but npu/musa/xpu) and binds its
device<->host copy kernels only from ``sgl_kernel.kvcacheio`` on CUDA/ROCm or ``_kvcacheio`` on XPU
(``pool_host/mha.py``). With a CPU torch the server stops at start-up with "Torch not compiled
with CUDA enabled" (the server without HiCache does run on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Optional

from kvpool.procs import processes_naming

PAGE = 64  # tokens per SGLang page = per kvpool chunk
PROMPT_TOKENS = 1024  # 16 pages: well past SGLang's storage prefetch threshold (256 tokens)
NEW_TOKENS = 8
VOCAB = 4096
LAYERS, HEADS, KV_HEADS, HIDDEN = 4, 4, 2, 256  # the tiny Llama: head dim 64
CHUNK_BYTES = PAGE * LAYERS * 2 * KV_HEADS * (HIDDEN // HEADS) * 2  # K and V of a page, fp16: the pool's page
TIMEOUTS = {"preflight": 300, "ray_start": 120, "kvpool_up": 180, "server_start": 600, "request": 120,
            "backup": 120, "stats": 60, "server_stop": 60}
SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (f"make an environment for it: python3 -m venv build/venv-sglang && build/venv-sglang/bin/pip install "
                f"sglang=={SGLANG_VERSION} && build/venv-sglang/bin/pip install -e . ; then pass "
                "--python build/venv-sglang/bin/python (.ci/gpu-check does this)")


class CheckFailed(Exception):
    """A step that did not work; its message says what to look at."""


def say(msg: str) -> None:  # progress, on stderr
    print(f"[sglang-check] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extra_config(run_dir: str, credential: str) -> dict:
    """``--hicache-storage-backend-extra-config``: SGLang's dynamic-backend keys, then kvpool's pool
    config (:mod:`kvpool.connectors.pools`)."""
    return {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang", "class_name": "KVPoolStorage",
            "backend": "node", "pool": "default", "run_dir": run_dir, "timeout_s": 5.0,
            "tenants": [{"id": "default", "credential": credential}], "tenant": "default"}


def server_command(python: str, model: str, port: int, extra: dict) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
            "--skip-tokenizer-init", "--dtype", "float16", "--page-size", str(PAGE), "--context-length", "4096",
            "--max-total-tokens", "65536", "--max-running-requests", "8", "--random-seed", "0",
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-storage-backend", "dynamic",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]


def prompt() -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]


def generate_body(tokens: list[int]) -> dict:
    return {"input_ids": tokens, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                                     "ignore_eos": True}}


def make_plan(workdir: str, engine_python: str, secret: str) -> dict:
    """Everything the check runs, as data (``--dry-run`` prints it)."""
    from kvpool.auth import Authority

    pool_bin = os.path.dirname(os.path.abspath(sys.executable))
    run_dir = os.path.join(workdir, "run")
    # NOTE: short: Ray puts its sockets under its temp dir (a Unix socket path has ~107 bytes)
    ray_tmp = os.path.join(tempfile.gettempdir(), f"kvsg{secrets.token_hex(3)}")
    ray_port = free_port()
    address = f"127.0.0.1:{ray_port}"
    secret_file = os.path.join(workdir, "pool-secret")
    pool_env = {"KVPOOL_RUN_DIR": run_dir, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                "RAY_USAGE_STATS_ENABLED": "0"}
    extra = extra_config(run_dir, Authority(secret).issue("default"))
    model = os.path.join(workdir, "model")
    ports = [free_port()]
    while len(ports) < 2:  # the restarted server gets a port of its own (the old one may linger)
        ports += [p for p in [free_port()] if p not in ports]
    return {
        "workdir": workdir, "model": model, "run_dir": run_dir, "ray_tmp": ray_tmp, "ray_address": address,
        "secret_file": secret_file, "pool_env": pool_env, "engine_env": {"HF_HUB_OFFLINE": "1"},
        "ray_start": [os.path.join(pool_bin, "ray"), "start", "--head", f"--port={ray_port}",
                      "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
                      "--disable-usage-stats", f"--temp-dir={ray_tmp}"],
        "kvpool_up": [os.path.join(pool_bin, "kvpool"), "up", "--ray-address", address, "--page-size", str(CHUNK_BYTES),
                      "--dram-pages", "2048", "--tenant", "default", "--secret-file", secret_file,
                      "--insecure-ray"],
        "kvpool_stats": [os.path.join(pool_bin, "kvpool"), "stats", "--json", "--ray-address", address],
        "extra_config": extra,
        "servers": [server_command(engine_python, model, port, extra) for port in ports],
        "request": {"path": "/generate", "prompt_tokens": PROMPT_TOKENS, "body": {**generate_body([]), "input_ids":
                    f"<{PROMPT_TOKENS} token ids, seed 0>"}},
    }


def redacted(plan: dict) -> dict:
    """The plan with the pool credential hidden (a dry run shows the shape, not the secret)."""
    text = json.dumps(plan)
    cred = plan["extra_config"]["tenants"][0]["credential"]
    return json.loads(text.replace(cred, "<credential of tenant default>"))



def preflight(engine_python: str) -> Optional[str]:
    """Why the check cannot run on this machine (a sentence naming the fix), or None."""
    if shutil.which("nvidia-smi") is None:
        return ("no NVIDIA GPU here (nvidia-smi not found): this check runs SGLang's server with HiCache, which "
                "needs CUDA (SGLang 0.5.23's HiCache host pool has no CPU path; see this module's NOTE). Run it on "
                "a GPU machine (.ci/gpu-check); `--dry-run` prints what it would run")
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi did not answer ({e}): check the NVIDIA driver"
    if gpus.returncode != 0 or "GPU" not in gpus.stdout:
        return f"nvidia-smi lists no GPU ({(gpus.stdout + gpus.stderr).strip()[:300]}): check the NVIDIA driver"
    for tool in ("ray", "kvpool"):
        if not os.access(os.path.join(os.path.dirname(os.path.abspath(sys.executable)), tool), os.X_OK):
            return (f"no `{tool}` next to {sys.executable}: run this check with the pool's environment "
                    "(.venv/bin/python after `make venv`)")
    code = ("import torch; assert torch.cuda.is_available(), 'torch ' + torch.__version__ + ' sees no CUDA GPU'\n"
            "import sglang, sgl_kernel, sglang.launch_server\n"
            "import kvpool.connectors.sglang\n"
            "print(sglang.__version__)")
    try:
        r = subprocess.run([engine_python, "-c", code], capture_output=True, text=True, timeout=TIMEOUTS["preflight"])
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{engine_python} could not be run ({e}); {INSTALL_HINT}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{engine_python} cannot run SGLang with kvpool here: {last}; {INSTALL_HINT}"
    if r.stdout.strip().splitlines()[-1] != SGLANG_VERSION:
        say(f"note: {engine_python} has SGLang {r.stdout.strip()} (kvpool's backend is tested with {SGLANG_VERSION})")
    return None



def log_tail(path: str, lines: int = 60) -> str:  # what a failing step shows
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def run_step(what: str, argv: list[str], env: dict, timeout_s: float, log: str) -> None:
    say(f"{what}: {' '.join(argv[:3])} ... (at most {timeout_s:g} s)")
    try:
        with open(log, "w") as out:
            r = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{what} did not finish in {timeout_s:g} s; its log ({log}):\n{log_tail(log)}") from None
    if r.returncode != 0:
        raise CheckFailed(f"{what} exited with {r.returncode}; its log ({log}):\n{log_tail(log)}")


class Server:
    """One SGLang server process (and the processes it starts: its own session)."""

    def __init__(self, argv: list[str], env: dict, log: str) -> None:
        self.port = int(argv[argv.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise CheckFailed(f"SGLang's server exited with {self.proc.returncode} while starting; its log "
                                  f"({self.log}):\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise CheckFailed(f"SGLang's server did not answer /health in {timeout_s:g} s; its log "
                                  f"({self.log}):\n{log_tail(self.log)}")
            time.sleep(1.0)

    def generate(self, body: dict, timeout_s: float) -> dict:
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except OSError as e:
            raise CheckFailed(f"POST /generate failed ({e}); the server's log ({self.log}):\n"
                              f"{log_tail(self.log)}") from None

    def stop(self, timeout_s: float) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the scheduler it started
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._out.close()


def pool_chunks(plan: dict, env: dict) -> int:
    """The chunks the pool holds (``kvpool stats --json``); -1 when the stats cannot be read."""
    try:
        r = subprocess.run(plan["kvpool_stats"], env=env, capture_output=True, text=True, timeout=TIMEOUTS["stats"])
        st = json.loads(r.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return -1
    shards = [s for s in st.get("shards", {}).values() if "error" not in s]
    return int(sum(t.get("chunks", 0) for s in shards for t in s.get("tiers", {}).values()))


def save_model(path: str) -> None:
    import torch

    from kvpool.connectors.hf_model import tiny_llama

    tiny_llama(0, layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB).to(torch.float16).save_pretrained(path)


def run(plan: dict) -> dict:
    """Runs the plan; the figures of the two requests. Raises CheckFailed."""
    pool_env = {**os.environ, **plan["pool_env"]}
    engine_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_RUN_DIR", "RAY_ADDRESS"))}
    engine_env.update(plan["engine_env"])
    wd = plan["workdir"]
    os.makedirs(plan["run_dir"], exist_ok=True)
    say(f"a random tiny Llama (fp16) in {plan['model']}")
    save_model(plan["model"])
    run_step("the Ray head", plan["ray_start"], pool_env, TIMEOUTS["ray_start"], os.path.join(wd, "ray-start.log"))
    run_step("kvpool up", plan["kvpool_up"], pool_env, TIMEOUTS["kvpool_up"], os.path.join(wd, "kvpool-up.log"))
    tokens = prompt()
    out: dict[str, Any] = {"prompt_tokens": len(tokens), "page_tokens": PAGE}
    for i, (name, argv) in enumerate(zip(("cold", "warm"), plan["servers"])):
        server = Server(argv, engine_env, os.path.join(wd, f"server-{name}.log"))
        try:
            say(f"SGLang's server ({name}) on port {server.port}: waiting for /health (at most "
                f"{TIMEOUTS['server_start']} s)")
            out[f"{name}_start_s"] = round(server.wait_ready(TIMEOUTS["server_start"]), 1)
            t0 = time.monotonic()
            r = server.generate(generate_body(tokens), TIMEOUTS["request"])
            out[f"{name}_request_s"] = round(time.monotonic() - t0, 3)
            meta = r.get("meta_info", {})
            details = meta.get("cached_tokens_details") or {}
            out[f"{name}_tokens"] = [int(t) for t in r.get("output_ids", [])]
            out[f"{name}_cached_tokens"] = int(meta.get("cached_tokens") or 0)
            # NOTE: None where SGLang reports no storage breakdown: then the server's cached tokens count
            # (the restarted server's GPU and host caches are empty, only storage can supply them)
            out[f"{name}_storage_tokens"] = int(details["storage"] or 0) if "storage" in details else None
            out[f"{name}_storage_backend"] = details.get("storage_backend")
            say(f"{name} answer {out[f'{name}_tokens']}, cached {out[f'{name}_cached_tokens']} tokens "
                f"({out[f'{name}_storage_tokens']} from storage)")
            if i == 0:
                out["pool_chunks_after_cold"] = wait_for_backup(plan, pool_env)
        finally:
            say(f"stopping the {name} server")
            server.stop(TIMEOUTS["server_stop"])
    return out


def wait_for_backup(plan: dict, env: dict) -> int:
    """Waits until the pool holds the prompt's whole pages (SGLang backs them up in the background);
    the chunks it holds."""
    want = PROMPT_TOKENS // PAGE
    say(f"waiting for SGLang to write {want} pages to kvpool (at most {TIMEOUTS['backup']} s)")
    deadline = time.monotonic() + TIMEOUTS["backup"]
    chunks = -1
    while time.monotonic() < deadline:
        chunks = pool_chunks(plan, env)
        if chunks >= want:
            return chunks
        time.sleep(2.0)
    if chunks <= 0:
        raise CheckFailed(f"SGLang wrote nothing to kvpool in {TIMEOUTS['backup']} s (pool chunks: {chunks}); look "
                          "for 'kvpool' in the cold server's log")
    say(f"the pool holds {chunks} of {want} pages; going on")
    return chunks


def verdict(out: dict) -> tuple[bool, list[str]]:
    problems = []
    if not out.get("cold_tokens") or out.get("cold_tokens") != out.get("warm_tokens"):
        problems.append(f"the warm answer {out.get('warm_tokens')} is not the cold one {out.get('cold_tokens')}")
    hit = out.get("warm_storage_tokens")
    if (out.get("warm_cached_tokens", 0) if hit is None else hit) < PAGE:
        problems.append(f"no storage hit after the restart (cached {out.get('warm_cached_tokens')} tokens, "
                        f"{out.get('warm_storage_tokens')} from storage)")
    return not problems, problems


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.connectors.bench.gpu_check sglang",
                                description="SGLang's server with kvpool as its HiCache storage backend, across a "
                                "restart (needs an NVIDIA GPU).")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter with SGLang's CUDA build and kvpool (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and start nothing")
    p.add_argument("--workdir", help="where the model, logs and the pool's run dir go (default: a temp dir, removed "
                   "after a passing run)")
    args = p.parse_args(argv)
    if args.dry_run:
        workdir = args.workdir or os.path.join(tempfile.gettempdir(), "kvpool-sglang-check-XXXX")
        print(json.dumps(redacted(make_plan(os.path.abspath(workdir), args.python, secrets.token_hex(32))), indent=2))
        return 0
    why = preflight(args.python)
    if why:
        print(f"SGLang GPU check not run: {why}", file=sys.stderr)
        return 2
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="kvpool-sglang-check-"))
    os.makedirs(workdir, exist_ok=True)
    secret = secrets.token_hex(32)
    plan = make_plan(workdir, args.python, secret)
    fd = os.open(plan["secret_file"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    ok = False
    try:
        out = run(plan)
        ok, problems = verdict(out)
        print(json.dumps({**out, "passed": ok, "problems": problems}, indent=2))
    except CheckFailed as e:
        print(f"SGLang GPU check FAILED: {e}", file=sys.stderr)
    finally:
        pids = processes_naming(plan["ray_tmp"])
        say(f"stopping this check's Ray head ({len(pids)} processes)")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(plan["ray_tmp"], ignore_errors=True)
        if ok and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            say(f"logs kept in {workdir}")
    print("SGLang GPU check:", "passed" if ok else "FAILED")
    return 0 if ok else 1
