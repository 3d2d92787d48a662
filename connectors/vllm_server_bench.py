"""Time to first token through vLLM's real OpenAI server, the pool on the node path (issue 17).

``run(context, repeats, backends)`` starts, for ``backend="node"``, a pool *outside* the engine's
process as an operator runs it (a Ray head with a temp dir and port of its own, ``kvpool up`` with
its index in a redis-server of its own when one is installed, else the embedded index; both with
``.venv/bin`` when it exists, else this environment's; a run dir of its own under /dev/shm), then
``python -m vllm.entrypoints.openai.api_server`` with prefix caching, dev mode (so ``POST
/reset_prefix_cache`` works) and the KVPoolConnector on ``backend: "node"`` (vLLM's multiprocess
engine: the scheduler and the worker each open their own NodeClient). ``backend="local"``: the
same server with vLLM's engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the
connector's in-process pool (what the issue 7 numbers used, there through ``vllm.LLM``).

Per repeat, a fresh random prompt of ``context`` token ids (``prompt`` as a list of ints to
``/v1/completions``, ``max_tokens=1``, ``temperature=0``, ``logprobs=1``):

a. **cold**: the first request (nothing cached anywhere; the connector saves its chunks);
b. **native**: the same prompt again: vLLM's own prefix-cache hit;
c. ``POST /reset_prefix_cache``, then the same prompt: the **pool** hit. Valid only when vLLM's
   ``vllm:prompt_tokens_cached_by_source_total{source="host"}`` grew by the prompt's whole chunks
   (the last token is always computed: ``min(whole chunks, context - 1)`` tokens).

TTFT is the wall time of the non-streamed HTTP request (``max_tokens=1``: the first token is the
whole answer) on a kept-alive connection. Beside it, per request, the deltas of the server's own
histograms (``vllm:time_to_first_token_seconds``, ``..._queue_time``, ``..._prefill_time``) say
where the time went. One warm-up round (cold, native, reset, pool) runs first and is not counted.
The server runs ``TimedKVPoolConnector`` (below): the KVPoolConnector itself, each hook's time and
the connector's load figures (``load_us``: pool read and scatter into vLLM's blocks;
``load_pool_us``: the read) appended to a file this benchmark reads after each request. The
server's processes flush denormal floats to zero (a ``sitecustomize`` on their ``PYTHONPATH``), as
the in-process benchmarks do: random weights make x86 compute on denormals ~3.5x slower.

NOTE: vLLM's own hit covers whole blocks up to the prompt's last token (4064 of 4096 tokens with
32-token blocks): on the native request the connector still loads the 31-token tail from the pool
(one chunk read, ``native_pool_tokens``). The issue 7 numbers measured the same.
Everything started here is stopped on exit, on an exception and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Any

from kvpool.errors import BadRequest

TENANT = "default"
CHUNK_TOKENS = 256
BLOCK_SIZE = 32
START_TIMEOUT_S = 420
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "e2e_request_latency_seconds")


TRACE_ENV = "KVPOOL_BENCH_TRACE"
TRACED = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
          "start_load_kv", "wait_for_save", "get_finished", "build_connector_worker_meta")
COUNTERS = ("load_us", "load_pool_us", "loaded_tokens")


def __getattr__(name: str):
    """``TimedKVPoolConnector``, built when vLLM asks for it (this module imports without vLLM)."""
    if name != "TimedKVPoolConnector":
        raise AttributeError(name)
    from kvpool.connectors.vllm import KVPoolConnector

    def timed(hook: str):
        base = getattr(KVPoolConnector, hook)

        def wrapper(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return base(self, *a, **kw)
            finally:
                _trace(self, hook, time.perf_counter() - t0)

        wrapper.__name__ = hook
        return wrapper

    cls = type("TimedKVPoolConnector", (KVPoolConnector,), {
        "__doc__": "KVPoolConnector, each hook's time appended to $KVPOOL_BENCH_TRACE (the benchmark reads it)",
        "__module__": __name__, **{h: timed(h) for h in TRACED}})
    globals()[name] = cls
    return cls


_trace_file = None


def _trace(conn, hook: str, seconds: float) -> None:
    """One line per hook call: pid, role, hook, seconds; after the scheduler took the worker's
    figures, its load counters (``load_us``: pool read and scatter; ``load_pool_us``: the read)."""
    global _trace_file
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    if _trace_file is None:
        _trace_file = open(path, "a", buffering=1)
    rec: dict[str, Any] = {"pid": os.getpid(), "hook": hook, "s": seconds}
    if hook == "update_connector_output":
        counters = getattr(conn, "counters", {})
        rec["counters"] = {k: counters.get(k, 0) for k in COUNTERS}
    _trace_file.write(json.dumps(rec) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool_bin(name: str) -> str:
    """``name`` from the pool's virtualenv (``.venv``) when there is one, else from this one."""
    for d in (os.path.join(REPO, ".venv", "bin"), os.path.dirname(sys.executable)):
        p = os.path.join(d, name)
        if os.path.exists(p):
            return p
    found = shutil.which(name)
    if found is None:
        raise BadRequest(f"{name} not found in .venv/bin nor beside {sys.executable}")
    return found


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[bench ttft] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


class NodePool:
    """A pool outside this process: Ray head + ``kvpool up`` (+ redis-server), a run dir of its own."""

    def __init__(self, page_bytes: int, dram_pages: int, progress: bool = True) -> None:
        self.progress = progress
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.run_dir = tempfile.mkdtemp(prefix="kvpool-bench-run-", dir=shm)  # the slab lives here: tmpfs
        # NOTE: short: Ray puts its sockets under its temp dir (a Unix socket path has ~107 bytes)
        self.ray_tmp = tempfile.mkdtemp(prefix="kvb", dir="/tmp")
        self.secret_file = os.path.join(self.run_dir, "pool-secret")
        from kvpool.auth import Authority

        secret = os.urandom(24).hex()
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        self.credential = Authority(secret).issue(TENANT)  # what the operator hands the engine
        self.env = {**{k: v for k, v in os.environ.items()
                       if not k.startswith(("VLLM_", "KVPOOL_SECRET", "RAY_ADDRESS", "PYTHONPATH"))},
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                    "KVPOOL_RUN_DIR": self.run_dir, "RAY_USAGE_STATS_ENABLED": "0"}
        self.redis: subprocess.Popen | None = None
        self.index = "embedded"
        self.ray_port = free_port()
        self.address = f"127.0.0.1:{self.ray_port}"
        self.page_bytes, self.dram_pages = page_bytes, dram_pages

    def start(self) -> None:
        if shutil.which("redis-server"):
            port = free_port()
            self.redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL, start_new_session=True)
            _wait_port(port, 10)
            self.index = f"redis://127.0.0.1:{port}"
        _log(f"Ray head on {self.address} (temp dir {self.ray_tmp})", self.progress)
        r = subprocess.run([pool_bin("ray"), "start", "--head", f"--port={self.ray_port}", "--node-ip-address=127.0.0.1",
                            "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats",
                            "--object-store-memory=100000000", f"--temp-dir={self.ray_tmp}"],
                           env=self.env, capture_output=True, text=True, timeout=180, start_new_session=True)
        if r.returncode:
            raise RuntimeError(f"ray start failed:\n{(r.stdout + r.stderr)[-3000:]}")
        _log(f"kvpool up (index {self.index}, {self.dram_pages} pages of {self.page_bytes >> 20} MiB)", self.progress)
        cmd = [pool_bin("kvpool"), "up", "--ray-address", self.address, "--page-size", str(self.page_bytes),
               "--dram-pages", str(self.dram_pages), "--tenant", TENANT, "--secret-file", self.secret_file]
        if self.redis is not None:
            cmd += ["--redis", self.index]
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=240, start_new_session=True)
        if r.returncode:
            raise RuntimeError(f"kvpool up failed:\n{(r.stdout + r.stderr)[-3000:]}")
        if not [f for f in os.listdir(self.run_dir) if f.endswith(".node")]:
            raise RuntimeError(f"kvpool up left no shard file in {self.run_dir}")

    def connector_config(self) -> dict[str, Any]:
        return {"backend": "node", "pool": "default", "run_dir": self.run_dir, "chunk_tokens": CHUNK_TOKENS,
                "tenants": [{"id": TENANT, "credential": self.credential}]}

    def head_pids(self) -> list[int]:
        """This Ray head's processes: every one names its temp dir (other Rays here are left alone)."""
        mine = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.ray_tmp.encode() in f.read():
                        mine.append(int(pid))
            except OSError:
                continue
        return mine

    def close(self) -> None:
        for pid in self.head_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()
            self.redis.wait(10)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Server:
    """vLLM's OpenAI server with the KVPoolConnector on ``pool`` (its connector config)."""

    def __init__(self, model: str, pool: dict[str, Any], context: int, workdir: str, *, multiprocess: bool,
                 kv_cache_gib: int = 2) -> None:
        from kvpool.connectors.vllm import kv_transfer_config

        self.port = free_port()
        kv_config = {**kv_transfer_config(**pool), "kv_connector": "TimedKVPoolConnector",
                     "kv_connector_module_path": __name__}
        self.trace_path = os.path.join(workdir, f"trace-{pool['backend']}.jsonl")
        self.trace_offset = 0
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_RUN_DIR", "RAY_ADDRESS"))}
        env[TRACE_ENV] = self.trace_path
        # NOTE: random weights drive softmax and norms into denormal floats, which x86 computes ~3.5x
        # slower (bench_ttft.run_hf); the in-process benchmarks flush them to zero, as inference
        # servers run. The server's processes do the same through a sitecustomize of this run's own.
        site = os.path.join(workdir, "site")
        os.makedirs(site, exist_ok=True)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write("import torch\ntorch.set_flush_denormal(True)\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(self.port),
               "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
               "--max-model-len", str(max(2048, context + 64)), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
               "--kv-transfer-config", json.dumps(kv_config)]
        if multiprocess:
            cmd[5:5] = ["--distributed-executor-backend", "mp"]
        self.log_path = os.path.join(workdir, f"server-{pool['backend']}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.conn: http.client.HTTPConnection | None = None
        self.logprobs = True
        self.last_counters: dict[str, int] = {}

    def wait_healthy(self) -> float:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                s, _ = self._request("GET", "/health", timeout=2)
                if s == 200:
                    return time.monotonic() - t0
            except OSError:
                self.conn = None
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"the vLLM server did not start in {START_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, n: int = 6000) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        self.conn.timeout = timeout
        if self.conn.sock is not None:  # NOTE: an open connection keeps the timeout it connected with
            self.conn.sock.settimeout(timeout)
        data = None if body is None else json.dumps(body).encode()
        try:
            self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = self.conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = None
            raise

    def metrics(self) -> dict[str, float]:
        """The figures of /metrics this benchmark reads (counters summed over their labels but source)."""
        _, text = self._request("GET", "/metrics", timeout=10)
        out: dict[str, float] = {}
        for m in re.finditer(r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$',
                             text.decode(), re.M):
            out[f"cached_{m[1]}"] = out.get(f"cached_{m[1]}", 0.0) + float(m[2])
        for h in HISTOGRAMS:
            for suffix in ("sum", "count"):
                for m in re.finditer(rf"^vllm:{h}_{suffix}(?:\{{[^}}]*\}})? (\S+)$", text.decode(), re.M):
                    out[f"{h}_{suffix}"] = out.get(f"{h}_{suffix}", 0.0) + float(m[1])
        return out

    def complete(self, tokens: list[int]) -> dict[str, Any]:
        """One request, timed; its answer and the deltas of the server's figures it caused."""
        before = self.metrics()
        self.read_trace()  # what came before this request
        body = {"model": "bench", "prompt": tokens, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        if self.logprobs:  # NOTE: as "token_id:N" strings: the server has no tokenizer
            body.update(logprobs=1, return_tokens_as_token_ids=True)
        t0 = time.perf_counter()
        status, raw = self._request("POST", "/v1/completions", body)
        took = time.perf_counter() - t0
        if status == 400 and self.logprobs and b"tokenizer" in raw:
            self.logprobs = False  # this vLLM wants a tokenizer for log-probs: compare the tokens only
            return self.complete(tokens)
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {raw[:500]!r}")
        out = json.loads(raw)
        choice = out["choices"][0]
        lp = (choice.get("logprobs") or {}).get("token_logprobs") or [None]
        # NOTE: the engine publishes a request's stats after the step that finished it: wait for them
        deadline = time.monotonic() + 5
        while True:
            after = self.metrics()
            if after.get("time_to_first_token_seconds_count", 0) > before.get("time_to_first_token_seconds_count", 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
        hooks = self.read_trace()
        return {"ttft_s": took, "token": [int(t) for t in choice.get("token_ids") or []], "logprob": lp[0],
                "cached_tokens": int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                "pool_tokens": int(delta.get("cached_host", 0)), "local_tokens": int(delta.get("cached_device", 0)),
                "server_ttft_s": delta.get("time_to_first_token_seconds_sum", 0.0),
                "server_queue_s": delta.get("request_queue_time_seconds_sum", 0.0),
                "server_prefill_s": delta.get("request_prefill_time_seconds_sum", 0.0), "connector": hooks}

    def read_trace(self) -> dict[str, float]:
        """Seconds spent in each connector hook since the last call (both processes), and the
        connector's own load figures (``load_s``: pool read and scatter into vLLM's blocks,
        ``load_pool_s``: the pool read)."""
        try:
            with open(self.trace_path) as f:
                f.seek(self.trace_offset)
                text = f.read()
        except FileNotFoundError:
            return {}
        text = text[: text.rfind("\n") + 1]
        self.trace_offset += len(text.encode())
        out: dict[str, float] = {}
        last = None
        for line in text.splitlines():
            rec = json.loads(line)
            out[rec["hook"]] = out.get(rec["hook"], 0.0) + rec["s"]
            if "counters" in rec:
                last = rec["counters"]
        if last is not None:
            prev, self.last_counters = self.last_counters, last
            out["load_s"] = (last["load_us"] - prev.get("load_us", 0)) / 1e6
            out["load_pool_s"] = (last["load_pool_us"] - prev.get("load_pool_us", 0)) / 1e6
            out["loaded_tokens"] = last["loaded_tokens"] - prev.get("loaded_tokens", 0)
        return out

    def reset_prefix_cache(self) -> None:
        for _ in range(100):
            status, raw = self._request("POST", "/reset_prefix_cache")
            if status == 200 and (not raw.strip() or json.loads(raw).get("success", True)):
                return
            time.sleep(0.1)
        raise RuntimeError("vLLM did not reset its prefix cache")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the engine processes it started
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def _terminated_as_interrupt():
    """SIGTERM raises KeyboardInterrupt here, so the ``finally`` blocks tear everything down."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _round(server: Server, prompt: list[int]) -> dict[str, dict]:
    cold = server.complete(prompt)
    native = server.complete(prompt)
    server.reset_prefix_cache()
    pool = server.complete(prompt)
    return {"cold": cold, "native": native, "pool": pool}


def _measure(server: Server, context: int, repeats: int, vocab: int, seed: int, progress: bool,
             label: str) -> dict[str, Any]:
    whole = min(context // CHUNK_TOKENS * CHUNK_TOKENS, context - 1)
    _round(server, _prompt(context, seed + 10_000, vocab))  # warm-up: not counted
    rows = []
    for i in range(repeats):
        r = _round(server, _prompt(context, seed + i, vocab))
        c, n, p = r["cold"], r["native"], r["pool"]
        lps = [x["logprob"] for x in (c, n, p) if x["logprob"] is not None]
        row = {"repeat": i, "cold_s": c["ttft_s"], "native_s": n["ttft_s"], "pool_s": p["ttft_s"],
               "pool_vs_native": p["ttft_s"] / n["ttft_s"], "cold_vs_pool": c["ttft_s"] / p["ttft_s"],
               "pool_tokens": p["pool_tokens"], "pool_local_tokens": p["local_tokens"],
               "native_local_tokens": n["local_tokens"], "native_pool_tokens": n["pool_tokens"],
               "cold_cached_tokens": c["local_tokens"] + c["pool_tokens"],
               "pool_hit_valid": p["pool_tokens"] >= whole and c["local_tokens"] + c["pool_tokens"] == 0,
               "same_token": c["token"] == n["token"] == p["token"] and bool(c["token"]),
               "logprob_max_diff": (max(lps) - min(lps)) if len(lps) == 3 else None,
               "tokens": [c["token"], n["token"], p["token"]],
               "server": {k: {f: x[f"server_{f}_s"] for f in ("ttft", "queue", "prefill")}
                          for k, x in (("cold", c), ("native", n), ("pool", p))},
               "connector": {k: x["connector"] for k, x in (("cold", c), ("native", n), ("pool", p))}}
        rows.append(row)
        _log(f"{label} repeat {i}: cold {row['cold_s']:.3f} s, native {row['native_s']:.3f} s, pool "
             f"{row['pool_s']:.3f} s ({row['pool_vs_native']:.2f}x native), pool tokens {row['pool_tokens']}, "
             f"same token {row['same_token']}", progress)
    return summarize(rows, whole)


def summarize(rows: list[dict], whole: int) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float]:
        v = [r[key] for r in rows]
        return {"median": median(v), "min": min(v), "max": max(v)}

    diffs = [r["logprob_max_diff"] for r in rows if r["logprob_max_diff"] is not None]
    return {"repeats": rows, "expected_pool_tokens": whole,
            **{k: stat(k) for k in ("cold_s", "native_s", "pool_s", "pool_vs_native", "cold_vs_pool")},
            "server_median": {case: {f: median(r["server"][case][f] for r in rows) for f in ("ttft", "queue", "prefill")}
                              for case in ("cold", "native", "pool")},
            "connector_median": {case: {k: median(r["connector"][case].get(k, 0.0) for r in rows)
                                        for k in sorted({k for r in rows for k in r["connector"][case]})}
                                 for case in ("cold", "native", "pool")},
            "valid": all(r["pool_hit_valid"] for r in rows),
            "same_answers": all(r["same_token"] for r in rows) and (not diffs or max(diffs) <= 1e-4),
            "logprob_max_diff": max(diffs) if diffs else None}


def run(context: int = 4096, repeats: int = 5, backends: tuple[str, ...] = ("node", "local"), *,
        tiny: bool = False, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """One server per backend, one after the other (never two at once on a small machine); see the
    module docstring. ``tiny``: the engine tests' 2-layer Llama instead of the benchmark model."""
    for b in backends:
        if b not in ("node", "local"):
            raise BadRequest(f"backend {b!r}: the server benchmark runs 'node' or 'local'")
    if repeats < 1 or context <= CHUNK_TOKENS:
        raise BadRequest(f"--repeats at least 1 and --context more than one chunk ({CHUNK_TOKENS} tokens)")
    result: dict[str, Any] = {"engine": "vllm-server", "context": context, "chunk_tokens": CHUNK_TOKENS,
                              "block_size": BLOCK_SIZE, "repeats": repeats,
                              "ttft": "wall time of a non-streamed POST /v1/completions, max_tokens=1",
                              "backends": {}}
    with _terminated_as_interrupt():
        return _run(result, context, repeats, backends, tiny, progress, seed)


def _run(result: dict[str, Any], context: int, repeats: int, backends: tuple[str, ...], tiny: bool, progress: bool,
         seed: int) -> dict[str, Any]:
    import torch

    from kvpool.connectors.bench_ttft import bench_model

    workdir = tempfile.mkdtemp(prefix="kvpool-ttft-server-")
    to_close: list = []
    try:
        model_dir = os.path.join(workdir, "model")
        model = bench_model()
        if tiny:
            from kvpool.connectors.hf import tiny_llama

            model = tiny_llama(0, layers=2, hidden=256, heads=4, kv_heads=2, vocab=1024)
        model.save_pretrained(model_dir)
        cfg = model.config
        vocab = cfg.vocab_size
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        chunk_bytes = cfg.num_hidden_layers * 2 * CHUNK_TOKENS * cfg.num_key_value_heads * head_dim * 4
        chunks = (repeats + 2) * -(-context // CHUNK_TOKENS) + 8
        result["model"] = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                           "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                           "head_dim": head_dim, "vocab": vocab, "dtype": "float32", "chunk_bytes": chunk_bytes}
        del model
        torch.set_flush_denormal(True)
        for backend in backends:
            pool = None
            if backend == "node":
                pool = NodePool(1 << max(chunk_bytes - 1, 1).bit_length(), chunks, progress)
                to_close.append(pool)
                pool.start()
                config = pool.connector_config()
            else:
                config = {"backend": "local", "pool": "bench", "chunk_tokens": CHUNK_TOKENS,
                          "dram_mib": chunks * chunk_bytes // (1 << 20) + 64, "tenants": [TENANT]}
            _log(f"vLLM server, backend {backend}", progress)
            server = Server(model_dir, config, context, workdir, multiprocess=backend == "node")
            to_close.append(server)
            start_s = server.wait_healthy()
            _log(f"server up in {start_s:.0f} s", progress)
            try:
                r = _measure(server, context, repeats, vocab, seed, progress, backend)
            except Exception:
                print(f"--- the vLLM server's log (backend {backend}), its end:\n{server.log_tail()}",
                      file=sys.stderr)
                raise
            r.update({"server_start_s": start_s,
                      "engine": "multiprocess (scheduler and worker apart)" if backend == "node" else "in-process",
                      "index": pool.index if pool else None})
            result["backends"][backend] = r
            server.close()
            to_close.remove(server)
            if pool is not None:
                pool.close()
                to_close.remove(pool)
    finally:
        # NOTE: a second Ctrl-C or SIGTERM must not cut the teardown short (a starting vLLM server
        # may take its 30 s to stop): ignored until everything is down
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for x in reversed(to_close):
            with contextlib.suppress(Exception):
                x.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def failures(result: dict[str, Any]) -> list[str]:
    why = []
    for b, r in result["backends"].items():
        if not r["valid"]:
            bad = [x["repeat"] for x in r["repeats"] if not x["pool_hit_valid"]]
            why.append(f"{b}: repeats {bad} did not load the prompt's {r['expected_pool_tokens']} tokens from the "
                       "pool (or the cold request was not cold): INVALID run")
        if not r["same_answers"]:
            why.append(f"{b}: the answers differ between cold, native and pool (logprob diff {r['logprob_max_diff']})")
    return why


def format_table(result: dict[str, Any]) -> str:
    lines = [f"vLLM server, context {result['context']}, TTFT = {result['ttft']}"]
    for b, r in result["backends"].items():
        lines.append(f"\nbackend {b} ({r['engine']} engine, index {r['index']}):")
        lines.append(f"{'repeat':>6}{'cold s':>9}{'native s':>10}{'pool s':>9}{'pool/native':>13}{'cold/pool':>11}"
                     f"{'pool tok':>10}  same")
        for x in r["repeats"]:
            lines.append(f"{x['repeat']:>6}{x['cold_s']:>9.3f}{x['native_s']:>10.3f}{x['pool_s']:>9.3f}"
                         f"{x['pool_vs_native']:>12.2f}x{x['cold_vs_pool']:>10.1f}x{x['pool_tokens']:>10}"
                         f"  {x['same_token']}")
        lines.append(f"{'median':>6}{r['cold_s']['median']:>9.3f}{r['native_s']['median']:>10.3f}"
                     f"{r['pool_s']['median']:>9.3f}{r['pool_vs_native']['median']:>12.2f}x"
                     f"{r['cold_vs_pool']['median']:>10.1f}x")
        lines.append(f"pool/native range {r['pool_vs_native']['min']:.2f}-{r['pool_vs_native']['max']:.2f}x; "
                     f"valid {r['valid']}; same answers {r['same_answers']} (logprob diff {r['logprob_max_diff']})")
        sm = r["server_median"]
        lines.append("server-side medians (s): " + "; ".join(
            f"{c}: ttft {sm[c]['ttft']:.4f}, queue {sm[c]['queue']:.4f}, prefill {sm[c]['prefill']:.4f}"
            for c in ("cold", "native", "pool")))
        cm = r["connector_median"]
        lines.append("connector medians (s): " + "; ".join(
            f"{c}: " + ", ".join(f"{k} {v:.4f}" for k, v in cm[c].items() if k != "loaded_tokens" and v >= 5e-4)
            for c in ("native", "pool")))
    return "\n".join(lines)
