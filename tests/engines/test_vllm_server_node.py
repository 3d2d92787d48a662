"""vLLM's real OpenAI server on a kvpool cluster through ``backend: "node"``: the engine never joins
Ray, starts before the pool exists, hits the pool once it is up, and keeps answering (recomputing)
through every fault of the pool.

The pool runs outside the engine's environment, as an operator runs it: a Ray head (``ray start``
from ``.venv``, its own ``--temp-dir``), ``kvpool up`` (a secured pool, its index in a Redis started
here), all sharing ``$KVPOOL_RUN_DIR`` (a temp dir) with the server, whose connector finds the
node's shard there. The server runs vLLM's multiprocess engine and executor
(``--distributed-executor-backend mp``): the scheduler's and the worker's connectors each open
their own NodeClient.

One server for the module, in this order (every check through HTTP answers only):

1. started with no pool at all: it starts and answers (the reference answers, all recomputed);
2. the pool comes up: a prompt answered, vLLM's own prefix cache reset, the same prompt again is a
   pool hit (``vllm:prompt_tokens_cached_by_source_total{source="host"}`` grows) with the same
   answer;
3. Redis killed: answers stay right and fast; then Redis is back;
4. the node's shard killed (``ray.kill``): the same;
5. the Ray head killed (its processes, found by its temp dir): the server keeps answering for more
   than 70 s (an engine that joined Ray as a driver would die there: "Failed to connect to GCS
   within 60 seconds", then EngineDeadError; the engine's client never joins Ray).

Between 2 and 3, `kvpool stats` against the server's own counters: the server serves tenants
``acme`` and ``globex`` beside ``default`` (each by its request secret as ``cache_salt``), and
`kvpool stats --json` lists it once, its figures equal to vLLM's /metrics, its tenants' adding up.
"""

from __future__ import annotations

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
import urllib.request

import pytest
from conftest import need_engines, wait_for

need_engines("vllm")

from tinymodel import random_prompt, save_tiny_llama  # noqa: E402

from kvpool.auth import Authority  # noqa: E402
from kvpool.connectors.vllm import kv_transfer_config  # noqa: E402

POOL_SECRET = "test-node-pool-secret-" + "7" * 32
CHUNK = 64
WHOLE = 4 * CHUNK  # a 300-token prompt's whole chunks
START_TIMEOUT_S = 240
REQUEST_BOUND_S = 10.0  # any request, under any fault (a cold one takes well under a second here)
HEAD_DOWN_S = 72  # > 60 s: where an engine joined to Ray gave up on its GCS
SECRETS = {"acme": "acme-request-secret-0001", "globex": "globex-request-secret-0002"}  # the server's other tenants
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POOL_BIN = os.path.join(REPO, ".venv", "bin")
FIGURES: dict[str, list[float]] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    """The pool's processes, run with ``.venv`` (never the engine's environment)."""

    def __init__(self, workdir) -> None:
        self.run_dir = str(workdir / "run")
        os.makedirs(self.run_dir)
        # NOTE: short: Ray puts its sockets under the temp dir (a Unix socket path has ~107 bytes)
        self.ray_tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
        self.secret_file = workdir / "pool-secret"
        self.secret_file.write_text(POOL_SECRET)
        self.secret_file.chmod(0o600)
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVPOOL_SECRET", "RAY_ADDRESS"))},
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                    "KVPOOL_RUN_DIR": self.run_dir, "RAY_USAGE_STATS_ENABLED": "0"}
        self.redis_port = free_port()
        self.redis = None
        self.start_redis()
        self.ray_port = free_port()
        self.address = f"127.0.0.1:{self.ray_port}"
        self.head = subprocess.Popen(
            [os.path.join(POOL_BIN, "ray"), "start", "--head", f"--port={self.ray_port}", "--node-ip-address=127.0.0.1",
             "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.ray_tmp}"],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def start_redis(self) -> None:
        self.redis = subprocess.Popen(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.redis_port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill_redis(self) -> None:
        self.redis.kill()
        self.redis.wait(10)

    def up(self, dram_pages: int = 64, tenants: tuple[str, ...] = ("default",)) -> None:
        out, _ = self.head.communicate(timeout=120)
        assert self.head.returncode == 0, out[-3000:]
        r = subprocess.run([os.path.join(POOL_BIN, "kvpool"), "up", "--ray-address", self.address,
                            "--redis", f"redis://127.0.0.1:{self.redis_port}", "--insecure-redis", "--page-size", str(256 << 10),
                            "--dram-pages", str(dram_pages), *(a for t in tenants for a in ("--tenant", t)),
                            "--secret-file", str(self.secret_file), "--insecure-ray"],
                           env=self.env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]

    def shard_files(self) -> list[str]:
        return [f for f in os.listdir(self.run_dir) if f.endswith(".node")]

    def kill_shards(self) -> None:
        code = ("import ray\n"
                "from kvpool.cluster.controller import CONTROLLER\n"
                "from kvpool.cluster.shard import shard_name\n"
                f"ray.init(address={self.address!r}, namespace='kvpool', logging_level='ERROR', log_to_driver=False)\n"
                "sids = ray.get(ray.get_actor(CONTROLLER).state.remote(), timeout=30)['shards']\n"
                "for sid in sids:\n"
                "    ray.kill(ray.get_actor(shard_name('default', sid)))\n"
                "print(len(sids))\n")
        r = subprocess.run([os.path.join(POOL_BIN, "python"), "-c", code], env=self.env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split()[-1] == "1", (r.stdout + r.stderr)[-3000:]

    def head_pids(self) -> list[int]:
        """The processes of this Ray head: every one names its temp dir (another Ray on the machine
        is left alone, which `ray stop --force` would not do)."""
        mine = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.ray_tmp.encode() in f.read():
                        mine.append(int(pid))
            except OSError:
                continue
        return mine

    def kill_head(self) -> int:
        pids = self.head_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return len(pids)

    def close(self) -> None:
        if self.head.poll() is None:
            self.head.kill()
        self.kill_head()
        if self.redis is not None and self.redis.poll() is None:
            self.kill_redis()
        for f in os.listdir(self.run_dir):
            os.unlink(os.path.join(self.run_dir, f))
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


class Server:
    def __init__(self, model: str, workdir, run_dir: str, kv_role: str = "kv_both", name: str = "server",
                 max_model_len: int = 1024, extra_env: dict | None = None, tensor_parallel: int = 1,
                 secrets: dict[str, str] | None = None) -> None:
        """``secrets``: more tenants, each served to requests whose cache_salt is its request secret."""
        auth = Authority(POOL_SECRET)  # the operator issues the engine its tenants' credentials
        tenants = [{"id": "default", "credential": auth.issue("default")}, *(
            {"id": t, "credential": auth.issue(t), "request_secret": s} for t, s in (secrets or {}).items())]
        pool = {"backend": "node", "pool": "default", "run_dir": run_dir, "timeout_s": 2.0, "chunk_tokens": CHUNK,
                "tenants": tenants,
                "degraded": True,  # started before the pool, on purpose (it would fail at start otherwise)
                "breakeven_margin": 0.0}  # always load a pool hit: this module tests the pool's faults
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_RUN_DIR", "RAY_ADDRESS"))}
        # NOTE: vLLM's multiprocess engine (need_engines turned it off for in-process tests): the
        # scheduler and the worker are different processes, each with its own NodeClient
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                    "HF_HUB_OFFLINE": "1", **(extra_env or {})})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               "--distributed-executor-backend", "mp", "--tensor-parallel-size", str(tensor_parallel),
               "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "32", "--enforce-eager",
               "--max-model-len", str(max_model_len), "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--uvicorn-log-level", "warning", "--kv-transfer-config",
               json.dumps(kv_transfer_config(kv_role, **pool))]
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {self.proc.returncode}:\n{self.log()[-6000:]}", pytrace=False)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
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

    def own_metrics(self) -> dict[str, float]:
        """The connector's own series on the server's /metrics (connectors/vllm_metrics.py), summed
        over vLLM's labels; a failure cause as ``kvpool:load_failures_total{cause}``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for name, labels, value in re.findall(r'^(kvpool:\w+)(?:\{([^}]*)\})? ([0-9.e+-]+)$', text, re.M):
            cause = re.search(r'cause="(\w+)"', labels or "")
            key = f"{name}{{{cause[1]}}}" if cause else name
            out[key] = out.get(key, 0.0) + float(value)
        return out

    def cached_by_source(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        pat = r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pat, text, re.M)}

    def vllm_counters(self) -> dict[str, float]:
        """vLLM's own counters on /metrics (summed over its labels): prompt tokens, and the tokens
        its connector supplied (``host``; the same as ``external``, vLLM's external prefix cache hits)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {"prompt_tokens": 0.0, "external": 0.0, "host": self.cached_by_source().get("host", 0.0)}
        for name, value in re.findall(r'^vllm:(prompt_tokens|external_prefix_cache_hits)_total\{[^}]*\} ([0-9.e+]+)$',
                                      text, re.M):
            out["external" if name == "external_prefix_cache_hits" else name] += float(value)
        return out

    def complete(self, tokens: list[int], what: str, max_tokens: int = 4,
                 salt: str | None = None) -> tuple[list[int], float, float]:
        """(the answer's tokens, the seconds the request took, the tokens it loaded from the pool).
        Greedy, a few tokens: the answer shows whether the prompt's KV was right. ``salt``: the
        request's cache_salt (a tenant's request secret)."""
        before = self.cached_by_source().get("host", 0.0)
        t0 = time.monotonic()
        out = self.post("/v1/completions", {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens,
                                            "temperature": 0.0, "return_token_ids": True, "ignore_eos": True,
                                            **({"cache_salt": salt} if salt else {})})
        took = time.monotonic() - t0
        FIGURES.setdefault(what, []).append(took)
        answer = [int(t) for t in out["choices"][0]["token_ids"]]
        # NOTE: the engine publishes its stats after the step that finished the request; wait for them
        cached = int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        deadline = time.monotonic() + 5
        while True:
            host = self.cached_by_source().get("host", 0.0) - before
            if host or not cached or time.monotonic() > deadline:
                return answer, took, host
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
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the engine processes it started
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-node")
    model = save_tiny_llama(workdir / "model", seed=0)
    pool = Pool(workdir)  # Redis and the Ray head start beside the server; no kvpool yet
    server = None
    try:
        server = Server(model, workdir, pool.run_dir, secrets=SECRETS)
        server.wait_healthy()
        yield server, pool
    finally:
        if server is not None:
            server.close()
        pool.close()
        if FIGURES:
            print("\nrequest seconds: " + "; ".join(f"{k}: " + ", ".join(f"{t:.2f}" for t in v)
                                                     for k, v in FIGURES.items()))
            print("pool tokens loaded: " + "; ".join(f"{k}: {[int(h) for h in v]}" for k, v in HOST.items()))


PROMPTS = [random_prompt(300, seed=s) for s in (21, 22, 23, 24)]  # stored in the pool once it is up
FRESH = {what: random_prompt(300, seed=s) for what, s in (("redis down", 31), ("shard down", 32),
                                                          ("ray head down", 33))}  # asked first under that fault
TRUTH: dict[tuple, list[int]] = {}  # each prompt's answer, computed before there was any pool
HOST: dict[str, list[float]] = {}  # tokens loaded from the pool, per stage


def ask(server: Server, prompt: list[int], what: str) -> float:
    """Asks ``prompt`` (vLLM's own prefix cache reset first, so the pool is asked) and checks its
    answer and the time it took; the tokens it loaded from the pool."""
    server.reset_local_prefix_cache()
    answer, took, host = server.complete(prompt, what)
    assert answer == TRUTH[tuple(prompt)], what
    assert took < REQUEST_BOUND_S, (what, took)
    HOST.setdefault(what, []).append(host)
    return host


def test_a_server_started_before_the_pool_answers(stack):
    server, pool = stack
    assert pool.shard_files() == []
    for p in [*PROMPTS, *FRESH.values()]:
        server.reset_local_prefix_cache()
        TRUTH[tuple(p)], took, host = server.complete(p, "no pool yet")
        assert host == 0 and took < REQUEST_BOUND_S


def test_the_pool_comes_up_and_a_repeated_prompt_is_a_pool_hit(stack):
    server, pool = stack
    pool.up(dram_pages=128, tenants=("default", *SECRETS))  # room for every prompt of the module
    assert len(pool.shard_files()) == 1
    # the connectors look for the shard again at most every retry_s (1 s): the first requests after
    # the pool came up may still miss it
    deadline = time.monotonic() + 20
    while ask(server, PROMPTS[0], "pool up") != WHOLE:  # saved by the first, loaded by a later one
        assert time.monotonic() < deadline, "the pool never served the repeated prompt"
        time.sleep(0.5)
    for p in PROMPTS[1:]:
        assert ask(server, p, "pool up") == 0  # saved
        assert ask(server, p, "pool up") == WHOLE  # loaded: the same answer
    # the connector's own series agree with vLLM's count of what its connector supplied (no load failed)
    hits = sum(1 for h in HOST["pool up"] if h)
    own, host = server.own_metrics(), server.cached_by_source().get("host", 0.0)
    assert own["kvpool:loaded_tokens_total"] == host == WHOLE * hits, (own, host)
    assert own["kvpool:loads_total"] == own["kvpool:load_seconds_count"] == hits, own
    assert own["kvpool:lookups_total"] >= len(HOST["pool up"]) + len(PROMPTS) + len(FRESH), own  # before the pool too
    assert own["kvpool:failed_tokens_total"] == 0 and not any(k.startswith("kvpool:load_failures") for k in own), own


def test_a_load_that_fails_its_checksum_is_counted_by_cause(stack):
    """A chunk whose bytes changed in the node's slab after the save: the scheduler's lookup lists it,
    the worker's in-place read fails its checksum, vLLM recomputes (the same answer). vLLM's own
    source="host" counts the planned tokens as supplied; the connector's series count a failed load
    by its cause, and no token loaded."""
    server, pool = stack
    prompt = random_prompt(300, seed=41)
    (node,) = pool.shard_files()
    with open(os.path.join(pool.run_dir, node)) as f:
        info = json.load(f)
    slab, page = info["slab"], info["page_bytes"]
    before = open(slab, "rb").read()
    server.reset_local_prefix_cache()
    TRUTH[tuple(prompt)], _, host = server.complete(prompt, "checksum")  # cold: its 4 chunks saved in the step
    assert host == 0
    after = open(slab, "rb").read()
    changed = [i for i in range(0, len(after), page) if after[i : i + page] != before[i : i + page]]
    assert changed, "the prompt's chunks were not saved in this node's slab"
    with open(slab, "r+b") as f:  # one byte of every page the save wrote, flipped
        for i in changed:
            j = next(k for k in range(i, i + page) if after[k] != before[k])
            f.seek(j)
            f.write(bytes([after[j] ^ 0xFF]))
    own0, host0 = server.own_metrics(), server.cached_by_source().get("host", 0.0)
    ask(server, prompt, "checksum")  # the same answer: recomputed
    deadline = time.monotonic() + 5
    while (own := server.own_metrics()).get("kvpool:load_failures_total{checksum}", 0) < 1:
        assert time.monotonic() < deadline, own
        time.sleep(0.1)
    assert server.cached_by_source().get("host", 0.0) - host0 == WHOLE  # vLLM: counted at admission
    failed = {k: v - own0.get(k, 0.0) for k, v in own.items() if k.startswith("kvpool:load_failures_total")}
    assert failed == {"kvpool:load_failures_total{checksum}": 1}, failed  # read in place: it did not verify
    assert own["kvpool:loaded_tokens_total"] == own0["kvpool:loaded_tokens_total"], (own0, own)  # no hit
    assert own["kvpool:loads_total"] == own0["kvpool:loads_total"]
    assert own["kvpool:failed_tokens_total"] - own0["kvpool:failed_tokens_total"] == WHOLE, own


def test_kvpool_stats_names_the_engine_by_its_address_and_agrees_with_metrics(stack):
    """`kvpool stats` names the engine by its server's address and shows the counts /metrics shows."""
    server, pool = stack
    name, deadline = f"vllm 127.0.0.1:{server.port} (tiny)", time.monotonic() + 10
    while True:  # the engine reports within a second of a load
        r = subprocess.run([os.path.join(POOL_BIN, "kvpool"), "stats", "--json"], env=pool.env, capture_output=True,
                           text=True, timeout=60)
        assert r.stdout, r.stderr[-2000:]
        engines, own = json.loads(r.stdout)["engines"], server.own_metrics()
        if engines.get(name, {}).get("requests") == own["kvpool:lookups_total"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert name in engines, (list(engines), r.stderr[-2000:])
    e = engines[name]
    assert e["loads"] == own["kvpool:loads_total"] and e["loaded_tokens"] == own["kvpool:loaded_tokens_total"], \
        json.dumps({"engine": e, "own": own, "now": time.time()})
    assert e["load_failures"] == own["kvpool:load_failures_total{checksum}"] == 1, (e, own)
    assert e["requests"] == own["kvpool:lookups_total"] and e["failed_tokens"] == WHOLE, (e, own)
    # vLLM counted the failed load's tokens when it admitted the request: so does `kvpool stats` (pool_tokens)
    assert e["tenants"] == {"default": {"prompt_tokens": e["prompt_tokens"], "pool_tokens": e["pool_tokens"]}}, e
    assert e["pool_tokens"] == e["loaded_tokens"] + e["failed_tokens"], e  # one tenant so far: its figures are the engine's
    text = subprocess.run([os.path.join(POOL_BIN, "kvpool"), "stats"], env=pool.env, capture_output=True, text=True,
                          timeout=60).stdout
    print(text)
    line = text[text.index(f"  {name}"):]
    assert re.search(rf"^\s+{e['loads']} loads \({e['loaded_tokens']} tokens from the pool\) in {e['requests']} "
                     rf"requests", line, re.M) and "; 1 failed loads" in line, text


def stats(pool: Pool) -> dict:
    r = subprocess.run([os.path.join(POOL_BIN, "kvpool"), "stats", "--json"], env=pool.env, capture_output=True,
                       text=True, timeout=60)
    assert r.stdout, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_kvpool_stats_lists_a_server_of_several_tenants_once_and_equals_its_metrics(stack):
    """Requests of three tenants (by their request secrets), one whose secret is nobody's and one
    shorter than a chunk: `kvpool stats` lists the server once, reporting as its default tenant,
    its prompt tokens and those from the pool equal to vLLM's own counters, its tenants adding
    up to them, each tenant's pool tokens what its own requests loaded."""
    server, pool = stack
    name = f"vllm 127.0.0.1:{server.port} (tiny)"
    loaded: dict[str, float] = {}
    for i, tenant in enumerate(["acme", "globex", "acme", "default"]):
        prompt = random_prompt(300, seed=60 + i)
        for _ in range(2):  # saved, then loaded (vLLM's own prefix cache reset before each)
            server.reset_local_prefix_cache()
            _, _, host = server.complete(prompt, "tenants", salt=SECRETS.get(tenant))
            loaded[tenant] = loaded.get(tenant, 0.0) + host
    server.complete(random_prompt(300, seed=70), "tenants", salt="nobodys-request-secret-0003")  # not cached
    server.complete(random_prompt(40, seed=71), "tenants", salt=SECRETS["acme"])  # no whole chunk to key
    assert loaded["acme"] == 2 * WHOLE and loaded["globex"] == WHOLE, loaded

    def agree():  # the engine reports within a second of a load, and every 5 s
        st, vllm = stats(pool), server.vllm_counters()
        e = st["engines"].get(name, {})
        return (e.get("prompt_tokens"), e.get("pool_tokens")) == (vllm["prompt_tokens"], vllm["host"]) and (st, vllm)

    wait_for(agree, 15, what="kvpool stats to equal the server's /metrics")
    got = agree()
    assert got, "kvpool stats and the server's /metrics parted again, with no request in flight"
    st, vllm = got
    assert [n for n in st["engines"] if str(server.port) in n] == [name], list(st["engines"])  # listed once
    e = st["engines"][name]
    assert e["tenant"] == "default" and not e["silent"], e  # it reports as its default tenant, whoever it served
    assert vllm["host"] == vllm["external"] == e["pool_tokens"], (vllm, e)
    for what in ("prompt_tokens", "pool_tokens"):
        assert sum(t[what] for t in e["tenants"].values()) == e[what], (what, e)
    assert {t: f["pool_tokens"] for t, f in e["tenants"].items() if t in SECRETS} == \
        {t: int(loaded[t]) for t in SECRETS}, e  # vLLM's source="host" tokens of each tenant's own requests
    assert e["tenants"]["(none)"]["prompt_tokens"] > 0 and e["tenants"]["(none)"]["pool_tokens"] == 0, e
    assert st["tenants"] == e["tenants"]  # the pool's one engine
    text = subprocess.run([os.path.join(POOL_BIN, "kvpool"), "stats"], env=pool.env, capture_output=True, text=True,
                          timeout=60).stdout
    print(text)
    mine = text[text.index(f"  {name}"):text.index("\ntenants (")]
    assert f"as vLLM counts them: {e['pool_tokens']} of {e['prompt_tokens']} prompt tokens from the pool" in mine, text
    assert re.search(rf"^      acme: {int(loaded['acme'])} of \d+ prompt tokens from the pool", mine, re.M), text


def test_redis_killed_the_server_keeps_answering(stack):
    server, pool = stack
    pool.kill_redis()
    try:
        for p in PROMPTS:
            ask(server, p, "redis down")
        # a new prompt: asked, then asked again (the node's shard may still keep it: its index is down)
        for _ in range(2):
            ask(server, FRESH["redis down"], "redis down")
    finally:
        pool.start_redis()


def test_the_shard_killed_the_server_keeps_answering(stack):
    server, pool = stack
    pool.kill_shards()
    # a new prompt goes to the dead shard's socket: a miss, and nothing stored (recomputed twice)
    assert ask(server, FRESH["shard down"], "shard down") == 0
    assert ask(server, FRESH["shard down"], "shard down") == 0
    for p in PROMPTS:  # NOTE: may still be found in the dead shard's memory, which the engine maps
        ask(server, p, "shard down")


def test_the_ray_head_killed_the_server_keeps_answering(stack):
    server, pool = stack
    assert pool.kill_head() > 0
    t0 = time.monotonic()
    prompts = [FRESH["ray head down"], *PROMPTS]
    # a request every 10 s, the last one past HEAD_DOWN_S
    for i, at in enumerate([*range(0, HEAD_DOWN_S, 10), HEAD_DOWN_S + 1]):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        ask(server, prompts[i % len(prompts)], "ray head down")
    assert time.monotonic() - t0 > HEAD_DOWN_S
    assert server.proc.poll() is None
    assert "EngineDeadError" not in server.log() and "Failed to connect to GCS" not in server.log()
