"""`kvpool up`, `kvpool stats` and `kvpool down` as an operator runs them: a local Ray head that
outlives each command, and a head with Ray token authentication."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import free_port, redis_reachable, wait_for

from kvpool.node.trust import default_run_dir

MISSES = """
import os
from kvpool.auth import Authority
from kvpool.node.client import NodeClient
from kvpool.node.messages import Get
client = NodeClient(timeout_s=30)
credential = Authority.from_env().issue("a")
assert client.call(Get(credential, [os.urandom(16) for _ in range(20)]))[0]["count"] == 0
"""


def kvpool(*args, timeout=180, env=None):
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# The demo model's (kvpool warmup --model demo) config: its 64-token float32 chunk is 256 KiB.
DEMO_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1024,
               "dtype": "float32"}


NO_TOKEN_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"kvpool", None, timeout=10)
except Exception as e:
    print("refused", type(e).__name__, e)
else:
    print("answered")
"""

ACTOR_ENVS = """
import json, sys
import ray
from ray.core.generated import gcs_pb2
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
accessor = ray._private.state.state._connect_and_get_accessor()
rows = [gcs_pb2.ActorTableData.FromString(b) for b in accessor.get_actor_table(None, None)]
print(json.dumps([{"name": r.name, "env": r.serialized_runtime_env, "all": str(r)} for r in rows]))
"""


def check_ray_is_locked(address: str, secret: str, tmp_path) -> None:
    """What another local user gets of a default `kvpool up`: not the secret or the token files (as
    `nobody`), no answer from Ray without the token; and the actors' environments Ray stores
    (readable by every Ray client) name the secret's file, never the secret."""
    for path in (os.environ["KVPOOL_SECRET_FILE"], os.environ["RAY_AUTH_TOKEN_PATH"]):
        r = subprocess.run(["/bin/cat", path], capture_output=True, text=True, timeout=30,
                           preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
        assert r.returncode != 0 and "Permission denied" in r.stderr, (path, r.stdout, r.stderr)
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "attacker"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    r = subprocess.run([sys.executable, "-c", NO_TOKEN_PROBE, address], capture_output=True, text=True, timeout=120,
                       env={**base, "RAY_AUTH_MODE": "disabled"})
    assert r.stdout.startswith("refused") and "auth" in r.stdout.lower(), r.stdout + r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", ACTOR_ENVS, address], capture_output=True, text=True, timeout=120,
                       env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": os.environ["RAY_AUTH_TOKEN_PATH"]})
    assert r.returncode == 0, r.stderr[-2000:]
    envs = json.loads(r.stdout.strip().splitlines()[-1])
    assert any("KVPOOL_SECRET_FILE" in json.dumps(e) for e in envs), envs  # the pool's actors are listed
    assert secret not in r.stdout and "KVPOOL_SECRET\"" not in r.stdout


# Run as `nobody` by the system's Python (stdlib only: the suite's virtualenv is under a 0700 home).
OTHER_USER = r"""
import json, os, socket, sys
files, sock_path, peer, pid = json.loads(sys.argv[1])
out = {}
for p in files + [f"/proc/{pid}/environ", f"/proc/{pid}/mem"]:
    try:
        with open(p, "rb") as f:
            out[p] = "read %d bytes" % len(f.read(1 << 20))
    except OSError as e:
        out[p] = e.__class__.__name__
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sock_path)
    out["socket"] = "connected"
except OSError as e:
    out["socket"] = e.__class__.__name__
host, port = peer.rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=10) as c:
    # an opening of the right shape without the pool's secret (kvpool.node.wire.open_peer), then a request
    c.sendall(b"KVP5" + os.urandom(16))
    c.settimeout(10)
    try:
        c.recv(48)  # the port's nonce and proof
        c.sendall(os.urandom(32) + b"\x00\x00\x00\x10" + b"x" * 16)
        out["peer"] = "answered %r" % c.recv(4096)[:40]
    except OSError as e:
        out["peer"] = e.__class__.__name__
print(json.dumps(out))
"""


def check_no_other_user_reads_a_chunk(run_dir: str) -> None:
    """Another Unix user (``nobody``) on the machine of a default `kvpool up` holding chunks: every
    file of the shard (slab, page table, node file) and its process's memory and environment are
    denied; its socket refuses the connection; its peer port hangs up on an opening without the
    pool's secret and answers nothing."""
    node_file = max((os.path.join(run_dir, f) for f in os.listdir(run_dir)
                     if f.startswith("kvpool-") and f.endswith(".node")), key=os.path.getmtime)  # the pool just up
    info = json.loads(open(node_file).read())
    files = [node_file, info["table"], info["slab"]]
    assert all(os.path.isfile(f) for f in files) and os.path.getsize(info["slab"]) > 0, files
    r = subprocess.run(["/usr/bin/python3", "-I", "-c", OTHER_USER,
                        json.dumps([files, info["socket"], info["peer"], info["pid"]])],
                       capture_output=True, text=True, timeout=60, cwd="/",
                       preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert all(v == "PermissionError" for k, v in got.items() if k not in ("peer",)), got
    assert got["peer"] in ("answered b''", "ConnectionResetError"), got  # closed unanswered


def test_an_open_ray_is_refused_unless_asked_for(tmp_path):
    env = {"RAY_AUTH_MODE": "disabled", "KVPOOL_LOCAL_RAY_RECORD": str(tmp_path / "none.json"),
           "KVPOOL_SECRET_FILE": str(tmp_path / "secret")}
    r = kvpool("up", "--ray-address", "local", "--page-size", "256KiB", "--dram-pages", "4", "--secret-file", str(tmp_path / "secret"), env=env)
    assert r.returncode != 0 and "--insecure-ray" in r.stderr and "token authentication" in r.stderr, r.stderr


def test_an_open_remote_ray_is_refused_though_kvpool_holds_a_token(tmp_path, foreign_head):
    """A client with a token connects to a Ray without token authentication without a word from
    Ray: `kvpool up --ray-address` asks the cluster as a tokenless client first, and refuses one
    that answers, unless --insecure-ray."""
    _, address = foreign_head
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {"HOME": str(tmp_path), "RAY_AUTH_MODE": "", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_TOKEN": "",
           "KVPOOL_SECRET_FILE": "", "KVPOOL_SECRET": ""}
    r = kvpool("up", "--ray-address", address, "--page-size", "256KiB", "--dram-pages", "4",
               "--secret-file", str(tmp_path / "secret"), env=env)
    assert r.returncode != 0 and "answers clients without a token" in r.stderr and "--insecure-ray" in r.stderr, \
        r.stderr[-2000:]
    assert "kvpool is up" not in r.stdout


def test_up_stats_warmup_down(tmp_path, monkeypatch, foreign_head):
    home, foreign = foreign_head
    # Somebody else's Ray runs here and Ray's own discovery names it (ray_current_cluster under
    # $RAY_TMPDIR, the test's own: /tmp/ray/ray_current_cluster of the machine is left alone).
    lure = os.path.join(home, "ray", "ray_current_cluster")
    wait_for(lambda: os.path.isfile(lure) and open(lure).read().strip() == foreign, 120, what="Ray's address file")
    monkeypatch.setenv("RAY_TMPDIR", home)
    record = tmp_path / "local-ray.json"  # the record of the head `kvpool up` starts: the test's own
    monkeypatch.setenv("KVPOOL_LOCAL_RAY_RECORD", str(record))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = tmp_path / "demo-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DEMO_CONFIG))
    secret = tmp_path / "pool-secret"
    monkeypatch.setenv("KVPOOL_SECRET_FILE", str(secret))  # every command after `kvpool up` reads it
    # `kvpool up`'s defaults: Ray with its token (made here, 0600), not the suite's open test Rays
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    token = tmp_path / "ray-token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    # every process the head starts inherits this (from `ray start`): the test's own way to find them all
    mark = {"KVPOOL_TEST_HEAD": secrets.token_hex(8)}
    try:
        # A share of memory is resolved by the shard on its node: one too small for 4 pages is refused there.
        # Two at once (cluster.up_lock): one starts a Ray head, the other waits and places the pool on that head.
        ups = [subprocess.Popen([sys.executable, "-m", "kvpool.cli", "up", "--ray-address", "local", "--model", str(model),
                                 "--chunk-tokens", "64", "--dram", "0.0001%", "--tenant", "a", "--policy", "tiered",
                                 "--secret-file", str(secret)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **mark})
               for _ in range(2)]
        errs = [p.communicate(timeout=300)[1] for p in ups]
        for p, err in zip(ups, errs):
            assert p.returncode == 2 and "did not start: --dram 0.0001%" in err and "raise --dram" in err, err[-2000:]
        assert sum("starting a local Ray head" in err for err in errs) == 1, errs  # today: each started one
        # The foreign Ray is not joined: `kvpool up` starts a head of its own, and records it.
        assert json.loads(record.read_text())["address"] != foreign
        assert "with Ray token authentication" in "".join(errs) and token.stat().st_mode & 0o777 == 0o600
        assert secret.stat().st_mode & 0o777 == 0o600
        r = kvpool("up", "--ray-address", "local", "--model", str(model), "--chunk-tokens", "64", "--dram", "4MiB", "--tenant", "a",
                   "--policy", "tiered", "--secret-file", str(secret), env=mark)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "kvpool is up on Ray: 1 shards" in r.stdout and default_run_dir() + "/" in r.stdout
        assert "starting a local Ray head" not in r.stderr  # the head of the record, still answering
        # pages of one KV head's slice of the model's 64-token chunk (2 heads: 2 slices), and 4 MiB of them
        assert "pages: 131072 B (0.12 MiB); a chunk of" in r.stdout and "stored as 2 slices" in r.stdout, r.stdout
        assert "0.0% of each page unused" in r.stdout and "dram 32 pages (4.00 MiB)" in r.stdout, r.stdout
        assert f"pool secret: {secret}" in r.stdout
        check_ray_is_locked(json.loads(record.read_text())["address"], secret.read_text().strip(), tmp_path)
        r = kvpool("stats", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        st = json.loads(r.stdout)
        (shard,) = st["shards"].values()
        assert shard["tiers"]["dram"]["pages_total"] == 32 and "a" in shard["tenants"]
        assert st["healthy"] is True  # idle: nothing out of range (no lookups to judge yet)
        assert "dram" in kvpool("stats").stdout
        # Warm-up: two system prompts of 2 whole chunks (64 tokens each) and a tail.
        warm = tmp_path / "prefixes.jsonl"
        warm.write_text("\n".join(json.dumps({"tenant": "a", "tokens": list(range(s, s + 140))}) for s in (1, 500)))
        r = kvpool("warmup", str(warm), "--model", "demo", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        w = json.loads(r.stdout)
        # the tiered policy pins at most 20% of the shard's 32 pages: 6 of the 8 slices (2 KV heads), 3 chunks
        assert w == {"prefixes": 2, "skipped": 0, "stored_chunks": 4, "pinned_chunks": 3}
        check_no_other_user_reads_a_chunk(default_run_dir())
        st = json.loads(kvpool("stats", "--json").stdout)
        (shard,) = st["shards"].values()
        assert shard["chunks"] == 8 and shard["policy_stats"]["pinned"] == 6  # the store counts slices
        # From a machine with no shard (the chart's Job): as a Ray task on a pool node.
        warm2 = tmp_path / "prefixes2.jsonl"
        warm2.write_text(json.dumps({"tenant": "a", "tokens": list(range(900, 1040))}))
        r = kvpool("warmup", str(warm2), "--model", "demo", "--json", "--no-pin", "--ray-address",
                   json.loads(record.read_text())["address"], env={**os.environ, "KVPOOL_RUN_DIR": str(tmp_path)})
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout) == {"prefixes": 1, "skipped": 0, "stored_chunks": 2, "pinned_chunks": 0}
        assert json.loads(kvpool("stats", "--json").stdout)["shards"].popitem()[1]["chunks"] == 12
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"tenant": "a", "tokens": [1, -2]}')
        r = kvpool("warmup", str(bad))
        assert r.returncode == 2 and "bad.jsonl:1" in r.stderr and "non-negative" in r.stderr
        # Force a figure out of range: lookups that all miss put the hit rate at 0%.
        r = subprocess.run([sys.executable, "-c", MISSES], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        assert r.returncode == 0, r.stderr[-2000:]
        r = kvpool("stats", "--json")
        assert r.returncode == 1  # what a monitor or a readiness probe reads
        st = json.loads(r.stdout)
        assert st["healthy"] is False
        (rate,) = [h for h in st["health"] if h["figure"] == "hit_rate"]
        assert rate["value"] == 0.0 and rate["ok"] is False and rate["low"] == 0.99
        r = kvpool("stats")
        assert r.returncode == 1 and "OUT OF RANGE" in r.stdout and "UNHEALTHY" in r.stdout
    finally:
        head = json.loads(record.read_text()) if record.exists() else {}
        from kvpool.procs import processes_naming, processes_with_env, ray_role, with_descendants, zombie

        entry = "KVPOOL_TEST_HEAD=" + mark["KVPOOL_TEST_HEAD"]
        # the head's own, before down: those its environment names and all below them (an agent the
        # raylet starts may have rewritten its environment's memory with its process title)
        services = {p: ray_role(p) for p in with_descendants(processes_with_env(entry))}
        services = {p: role for p, role in services.items() if role and not role.startswith("worker")}
        r = kvpool("down", "--stop-ray")
    assert r.returncode == 0 and "1 shards drained" in r.stdout
    # every process of the head it started, its client server (port 10001) and its agents too, and it says so
    # NOTE: the agents are not required to be running: on a slow machine Ray's agents may not have
    # come up (the head serves without them); those that ran are listed and stopped as the rest
    for name in ("gcs server", "raylet", "ray client server"):
        assert name in services.values(), services
    for pid, role in services.items():
        assert f"  {pid} {role}\n" in r.stdout + "\n", (pid, role, r.stdout)
    time.sleep(0.5)
    assert processes_with_env(entry) == [], [(p, ray_role(p)) for p in processes_with_env(entry)]  # nothing left
    assert [p for p in services if os.path.exists(f"/proc/{p}") and not zombie(p)] == [], services
    assert processes_naming(head["session_dir"]) == [] and processes_naming(head["address"] + "\0") == []
    with open(lure, "w") as f:  # `ray start` of kvpool's head named it instead: the foreign head again
        f.write(foreign)
    r = kvpool("stats")
    assert r.returncode != 0 and "no pool is up on this machine" in r.stderr


def _start_head(home: str, env: dict, *extra: str):
    """A Ray head of the test's own on a free port, every process of it running in ``home``."""
    port = free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--disable-usage-stats", "--include-dashboard=false", *extra],
                            cwd=home, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: redis_reachable(port=port), 60, interval_s=0.2, what=f"the Ray head on port {port}")
    except BaseException:
        _stop_head(head, home)
        raise
    return head, f"127.0.0.1:{port}"


def _stop_head(head, home: str) -> None:
    head.terminate()
    try:
        head.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    for pid in _processes_in(home):  # its raylet's workers run in their own sessions
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.wait(timeout=15)
    time.sleep(0.5)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def foreign_head():
    """Somebody else's Ray head on this machine, the latest one Ray's own discovery knows
    (ray_current_cluster under its $RAY_TMPDIR: a short folder of the test's own)."""
    home = tempfile.mkdtemp(prefix="kvf", dir="/tmp")  # NOTE: short: Ray's socket paths live under it
    env = {**os.environ, "RAY_TMPDIR": home, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    head, address = _start_head(home, env)
    try:
        yield home, address
    finally:
        _stop_head(head, home)


@pytest.fixture
def token_head(tmp_path):
    """A Ray head of the test's own with Ray token authentication, on a free port and its own
    temp dir (so `kvpool` never finds it as "the Ray running here"); torn down by its processes'
    ids: every process it started runs in that temp dir."""
    home = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # NOTE: short: Ray's socket paths live under it
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_AUTH_TOKEN", None)
    head, address = _start_head(home, env, f"--temp-dir={home}/r")
    try:
        yield address, token
    finally:
        _stop_head(head, home)


def _processes_in(folder: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(folder):
                out.append(int(pid))
        except OSError:
            pass
    return out


def test_up_stats_down_keep_ray_token_auth(token_head, tmp_path):
    address, token = token_head
    home = tmp_path / "home"  # no ~/.ray/auth_token: the token comes only from what the test gives
    home.mkdir()
    secret = tmp_path / "pool-secret"
    env = {"HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_TOKEN": "",
           "KVPOOL_SECRET_FILE": "", "KVPOOL_SECRET": ""}
    r = kvpool("up", "--ray-address", address, "--page-size", "256KiB", "--dram-pages", "4", "--tenant", "a",
               "--secret-file", str(secret), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "kvpool is up on Ray: 1 shards" in r.stdout and f"pool secret: {secret} (new)" in r.stdout
    r = kvpool("stats", "--json", "--ray-address", address, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(json.loads(r.stdout)["shards"]) == 1
    # Without the token: a message naming the fix, at once.
    r = kvpool("stats", "--ray-address", address, env={**env, "RAY_AUTH_TOKEN_PATH": ""})
    assert r.returncode == 1 and "RAY_AUTH_MODE=token but no Ray token" in r.stderr, r.stderr[-2000:]
    # Another token: the cluster refuses it (Ray retries for ~20 s), and the message says why.
    r = kvpool("stats", "--ray-address", address, env={**env, "RAY_AUTH_TOKEN": "not-the-clusters-token"})
    assert r.returncode == 1 and "its own token" in r.stderr, r.stderr[-2000:]
    r = kvpool("down", "--ray-address", address, "--secret-file", str(secret), env=env)
    assert r.returncode == 0 and "1 shards drained" in r.stdout, r.stderr[-2000:]


def test_only_the_recorded_head_that_still_runs_is_joined(tmp_path, monkeypatch):
    """Without --ray-address: the head in `kvpool up`'s record, only while processes of its session
    run and its port answers (a dead head's port may be another Ray by now); nothing else."""
    import socket

    from kvpool.cluster import ops

    record = tmp_path / "local-ray.json"
    monkeypatch.setenv("KVPOOL_LOCAL_RAY_RECORD", str(record))
    assert ops._recorded_head()[0] is None  # no record: no head of ours, whatever else runs here
    session = str(tmp_path / "session_of_ours")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        record.write_text(json.dumps({"address": address, "session_dir": session}))
        assert ops._recorded_head()[0] is None  # the port answers, but no process of our session runs
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--session-dir={session}"])
        try:
            # NOTE: until the child has exec'd, /proc shows the parent's command line, not the session
            deadline = time.monotonic() + 10
            while ops._recorded_head()[0] != address and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ops._recorded_head()[0] == address
        finally:
            ours.kill()
            ours.wait()
    record.write_text("not json")
    assert ops._recorded_head()[0] is None
