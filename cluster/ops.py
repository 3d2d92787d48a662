"""What `kvpool up`, `kvpool down` and `kvpool stats` do (the CLI stays free of Ray imports)."""

from __future__ import annotations

import os
import subprocess
import sys

# NOTE: a local pool stays on the loopback address; Ray reads this when it is first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from kvpool.cluster import ray_open  # noqa: E402
from kvpool.cluster.bootstrap import down, up  # noqa: E402
from kvpool.cluster.controller import CONTROLLER  # noqa: E402
from kvpool.cluster.shard import shard_name  # noqa: E402
from kvpool.errors import Unavailable  # noqa: E402
from kvpool.private import check_private, read_private  # noqa: E402
from kvpool.procs import processes_naming, zombie  # noqa: E402

NAMESPACE = "kvpool"
HEAD_ENV = "KVPOOL_RAY_HEAD"  # the id of the Ray head `kvpool up` started, in its processes' environment
RAY_TOKEN_FILE = os.path.join("~", ".ray", "auth_token")  # Ray's default token file


def ray_auth_mode(env: dict | None = None) -> str:
    """``$RAY_AUTH_MODE``: "token", "disabled", or "" when unset."""
    env = os.environ if env is None else env
    mode = env.get("RAY_AUTH_MODE", "").strip().lower()
    if mode not in ("", "token", "disabled"):
        raise SystemExit(f"kvpool: RAY_AUTH_MODE={mode!r}: use token (Ray token authentication) or disabled")
    return mode


def ray_token_source(env: dict | None = None) -> str | None:
    """Where Ray will read its token from, in Ray's own order: ``$RAY_AUTH_TOKEN``, the file at
    ``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``; None when there is none."""
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return "$RAY_AUTH_TOKEN"
    path = env.get("RAY_AUTH_TOKEN_PATH")
    if path:
        try:
            if read_private(os.path.expanduser(path), "the Ray token file").strip():
                return path
        except OSError as e:
            raise SystemExit(f"kvpool: RAY_AUTH_TOKEN_PATH={path}: cannot read the Ray token ({e.strerror})") from None
        raise SystemExit(f"kvpool: RAY_AUTH_TOKEN_PATH={path} is empty: put the cluster's Ray token in it")
    default = os.path.expanduser(RAY_TOKEN_FILE)
    if not (os.path.isfile(default) and os.path.getsize(default) > 0):
        return None
    return check_private(default, "the Ray token file") or default  # refused when others can read it


def _need_token(where: str) -> None:
    if ray_token_source() is None:
        raise SystemExit(f"kvpool: RAY_AUTH_MODE=token but no Ray token to reach {where}: set RAY_AUTH_TOKEN, or "
                         f"RAY_AUTH_TOKEN_PATH to a file holding it, or put it in {RAY_TOKEN_FILE} (the chart "
                         "keeps it in the Secret <release>-kvpool-ray-token, key auth_token)")


def _new_ray_token() -> str:
    """A Ray token (256 bits, as `ray get-auth-token --generate` makes), 0600, in the file
    ``$RAY_AUTH_TOKEN_PATH`` names, else in Ray's default file."""
    import secrets

    path = os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH") or RAY_TOKEN_FILE)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def _init(address: str, hint: bool = True) -> None:
    """ray.init; a refused or missing Ray token is a message naming the fix (Ray itself retries for
    ~20 s, then says only that it could not connect)."""
    try:  # NOTE: Ray read RAY_AUTH_MODE and the token at import: it reads them again (its own way, private)
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, ray.exceptions.AuthenticationError) as e:
        if not hint:
            raise
        mode = os.environ.get("RAY_AUTH_MODE") or "unset"
        raise SystemExit(f"kvpool: could not connect to the Ray cluster at {address} ({e}; RAY_AUTH_MODE is {mode}). "
                         "A cluster with Ray token authentication needs RAY_AUTH_MODE=token and its own token "
                         f"(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or {RAY_TOKEN_FILE})") from None


def connect(address: str | None, start_local: bool, insecure_ray: bool | None = None) -> None:
    """Connects to ``address`` (else ``$RAY_ADDRESS``: set by the user, it points kvpool at a
    cluster as --ray-address does), or to the local Ray head an earlier ``kvpool up`` started (its
    record, :func:`_head_record`, while that head still runs and answers), or (``start_local``)
    starts a local head that outlives this command. NEVER another Ray that merely runs here (Ray's
    /tmp/ray/ray_current_cluster names the head started last on the machine: on a shared machine,
    somebody else's).

    Ray token authentication is on by default: every connection presents the token (Ray's own
    sources: ``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``, 0600) and a local
    head starts with it (a token is made in ``~/.ray/auth_token`` when there is none). Without it
    any local user could read the actor table and call any actor: `kvpool up` places the pool on
    such a Ray only with ``insecure_ray`` (``--insecure-ray``), loudly; the commands that only act
    on a pool already up (``insecure_ray`` None) follow ``RAY_AUTH_MODE=disabled`` with a warning."""
    mode, placing = ray_auth_mode(), insecure_ray is False  # placing: `kvpool up`, on the cluster it names
    if insecure_ray is None:
        insecure_ray = mode == "disabled"
    if mode == "disabled" and not insecure_ray:
        raise SystemExit("kvpool: RAY_AUTH_MODE=disabled runs Ray without token authentication: any process that "
                         "reaches its ports (any local user) can call the pool's actors. Unset it (kvpool uses Ray's "
                         "token), or pass --insecure-ray to run so anyway")
    running, recorded_mode = _recorded_head()
    if insecure_ray or (not address and running and recorded_mode == "disabled"):
        print("kvpool: WARNING: Ray without token authentication (--insecure-ray): any process that reaches "
              "its ports can act as the pool", file=sys.stderr)
        mode = "disabled"
    else:
        mode = "token"
    os.environ["RAY_AUTH_MODE"] = mode
    if not address and os.environ.get("RAY_ADDRESS", "").strip():
        address = os.environ["RAY_ADDRESS"].strip()
        print(f"kvpool: using the Ray cluster at {address} ($RAY_ADDRESS; unset it to use this machine's own "
              "`kvpool up` head)", file=sys.stderr)
    if address:
        if mode == "token":
            _need_token(address)
            if placing and ray_open.answers_without_token(address):  # a token is presented to any Ray
                raise SystemExit(f"kvpool: the Ray cluster at {address} answers clients without a token: start it "
                                 "with RAY_AUTH_MODE=token (and its token), or pass --insecure-ray to run so anyway")
        _init(address)
        return
    if running:
        if mode == "token":
            _need_token(running)
        _init(running)
        return
    if not start_local:
        raise SystemExit("kvpool: no pool is up on this machine (no single-node pool, and no Ray head started by "
                         "`kvpool up --ray-address local` runs here; another Ray on this machine is never joined "
                         "unasked): start one with `kvpool up`, or pass --ray-address")
    if mode == "token":
        unmade = os.environ.get("RAY_AUTH_TOKEN_PATH") and not os.path.exists(
            os.path.expanduser(os.environ["RAY_AUTH_TOKEN_PATH"]))
        where = (None if unmade else ray_token_source()) or f"{_new_ray_token()} (new)"
        print(f"kvpool: starting a local Ray head on 127.0.0.1 with Ray token authentication (token: {where})",
              file=sys.stderr)
    else:
        print("kvpool: starting a local Ray head on 127.0.0.1 only, WITHOUT Ray token authentication",
              file=sys.stderr)
    import socket

    with socket.socket() as s:  # NOTE: Ray's default port is Redis's 6379, taken on these machines
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    import secrets

    head_id = secrets.token_hex(8)  # in the environment every process of this head inherits (HEAD_ENV)
    r = subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                        "--disable-usage-stats", "--include-dashboard=false"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, HEAD_ENV: head_id})
    if r.returncode:
        raise SystemExit(f"kvpool: could not start a local Ray head:\n{r.stderr[-2000:]}")
    import time

    for attempt in range(4):  # a loaded machine can take a while to bring the head's GCS up
        try:
            _init(f"127.0.0.1:{port}", hint=attempt == 3)
            _remember_head(f"127.0.0.1:{port}", mode, head_id)
            return
        except ConnectionError:
            time.sleep(2.0 * (attempt + 1))


def _head_record() -> str:
    return os.path.expanduser(os.environ.get("KVPOOL_LOCAL_RAY_RECORD", os.path.join("~", ".kvpool", "local-ray.json")))


def _remember_head(address: str, mode: str, head_id: str) -> None:
    """Records the Ray head `kvpool up` started (its address, its session directory, and the id in
    every one of its processes' environment), so that `kvpool down --stop-ray` stops it and no other."""
    import json

    try:
        session = ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:  # a Ray whose internals moved: the head just started is the latest session
        session = os.path.realpath("/tmp/ray/session_latest")
    path = _head_record()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"address": address, "session_dir": session, "ray_auth_mode": mode, "head_id": head_id}, f)


def stop_started_ray(grace_s: float = 5.0) -> list[str]:
    """Stops every process of the Ray head `kvpool up --ray-address local` started (none when it
    started none: a Ray someone else started is theirs): those whose environment holds the head's
    id (every process `ray start` started, and theirs: the client server, the dashboard, the
    agents, the workers), Ray's processes that name its session directory or its address (a head
    recorded without an id), and every process below them: SIGTERM, then SIGKILL for what still
    runs after ``grace_s`` (the GCS server and the autoscaler's monitor do not stop on SIGTERM);
    "pid name" of each process. One that outlives SIGKILL is named on stderr."""
    import json
    import signal
    import time

    from kvpool.procs import describe, processes_with_env, ray_role, with_descendants

    path = _head_record()
    try:
        with open(path) as f:
            rec = json.load(f)
        session, address, head_id = rec["session_dir"], rec.get("address") or "", rec.get("head_id") or ""
    except (OSError, ValueError, KeyError):
        print("kvpool: this machine has no Ray started by `kvpool up`: no Ray stopped", file=sys.stderr)
        return []
    if not session or not session.startswith("/"):
        return []

    def head_processes() -> list[int]:
        roots = (processes_with_env(f"{HEAD_ENV}={head_id}") if head_id else []) + _session_processes(session)
        # NOTE: the address as a whole argument (up to its NUL): 127.0.0.1:4924 is not 127.0.0.1:49247;
        # only Ray's own processes (a user's script that names the address is not the head's)
        roots += [p for p in (processes_naming(address + "\0") if ":" in address else []) if ray_role(p)]
        return with_descendants(roots)

    mine, named = [], []
    for _ in range(3):  # again for what started while it stopped (a worker the raylet was starting)
        if not (new := [p for p in head_processes() if p not in mine]):
            break
        named += [f"{pid} {describe(pid)}" for pid in new]
        mine += new
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in new:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + grace_s
            while any(not zombie(p) for p in new) and time.monotonic() < deadline:
                time.sleep(0.2)
    if left := [n for pid, n in zip(mine, named) if not zombie(pid)]:
        print(f"kvpool: still running after SIGKILL: {', '.join(left)}", file=sys.stderr)
    os.unlink(path)
    return named


def _session_processes(session: str) -> list[int]:
    """The processes (not this one) of the Ray session whose directory is ``session``: every
    process of a Ray head names its session directory on its command line."""
    if not session or not session.startswith("/"):
        return []
    return processes_naming(session)


def _recorded_head() -> tuple[str | None, str]:
    """(the address of the local Ray head `kvpool up` started (its record), if that head still runs
    (processes of its session) and answers; the Ray auth mode it started with). A stale record
    would otherwise make ray.init wait for minutes, and a dead head's port may be somebody else's
    Ray by now."""
    import json
    import socket

    try:
        with open(_head_record()) as f:
            rec = json.load(f)
        addr, session = rec["address"], rec["session_dir"]
        host, port = addr.rsplit(":", 1)
        if not _session_processes(session):
            return None, ""
        with socket.create_connection((host, int(port)), timeout=1.0):
            return addr, rec.get("ray_auth_mode", "disabled")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, ""


def cmd_up(address: str | None, redis: str | None, store: dict, tenants: list[dict],
           secret_file: str | None = None, insecure_ray: bool = False, insecure_redis: bool = False) -> dict:
    """Starts the pool, secured by the pool secret (kvpool.auth_cli.find_secret: --secret-file,
    $KVPOOL_SECRET_FILE, $KVPOOL_SECRET, or ~/.kvpool/secret, made when missing). One at a time on
    this machine (cluster.up_lock, held until the shards answer): `kvpool up --ray-address local`s
    started together start one Ray head, and the others place the pool on it (already placed: they
    find it)."""
    from kvpool.auth_cli import find_secret, secret_path
    from kvpool.cluster import solo
    from kvpool.cluster.up_lock import held
    from kvpool.errors import BadRequest

    secret, where = find_secret(secret_file, create=True)  # before Ray: a bad secret file fails fast
    if redis:  # an open Redis is refused before Ray starts (kvpool.index.redis_acl)
        from kvpool.index.redis_acl import check_locked
        check_locked(redis, insecure_redis)
    with held("kvpool up"):
        if (rec := solo.running()) is not None:  # again, under the lock: one that started meanwhile
            raise BadRequest(f"a single-node pool runs on this machine (pid {rec['pid']}): its engines would find two "
                             "shards here; stop it with `kvpool down` before starting the pool on Ray")
        connect(address, start_local=True, insecure_ray=insecure_ray)
        state = up(store=store, tenants=tenants, index_url=redis, namespace=NAMESPACE, secret=secret,
                   secret_file=secret_path(secret_file, where))
    return {**state, "secret_from": where}


def cmd_down(address: str | None, stop_ray: bool, secret_file: str | None = None) -> tuple[int, list[str]]:
    """Drains and stops the pool, presenting the pool's credential (the secret found as for ``kvpool
    up``; without one, ``$KVPOOL_CREDENTIAL``); (shards drained, the Ray processes stopped)."""
    from kvpool.auth_cli import find_secret
    from kvpool.errors import BadRequest

    try:
        secret = find_secret(secret_file)[0]
    except BadRequest:
        if secret_file:
            raise
        secret = None
    from kvpool.cluster.up_lock import held

    with held("kvpool down"):  # a `kvpool up` under way finishes first: what it starts is stopped
        try:
            connect(address, start_local=False)
            n = down(namespace=NAMESPACE, secret=secret)
            ray.shutdown()
        except BaseException:
            if stop_ray:  # even when the pool could not be reached: only the Ray `kvpool up` started
                print("\n".join(said_stopped(stop_started_ray())), file=sys.stderr)
            raise
        return n, stop_started_ray() if stop_ray else []


def said_stopped(stopped: list[str]) -> list[str]:
    """How `kvpool down` says which processes of the Ray head it stopped ("pid name" each)."""
    if not stopped:
        return []
    return [f"stopped the Ray head `kvpool up` started: {len(stopped)} processes", *(f"  {p}" for p in stopped)]


def on_a_pool_node(address: str | None, fn, *args, timeout_s: float = 1800.0, **kwargs):
    """``fn(*args, shard=..., **kwargs)`` as a Ray task on a node of the pool (the head's, else
    another member's), where it reaches that node's shard as an engine there would: the way a
    Job off the pool's nodes (the chart's warm-up) acts through a shard."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    connect(address, start_local=False)
    shards = ray.get(ray.get_actor(CONTROLLER, namespace=NAMESPACE).state.remote(), timeout=30)["shards"]
    if not shards:
        raise Unavailable("the pool has no shard: run `kvpool up` first")
    head = ray.get_runtime_context().get_node_id()
    sid, info = min(shards.items(), key=lambda kv: kv[1].get("node_id") != head)
    task = ray.remote(num_cpus=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(info["node_id"], soft=False))
    return ray.get(task.remote(*args, shard=sid, **kwargs), timeout=timeout_s)


def cmd_stats(address: str | None, timeout_s: float = 10.0) -> dict:
    """`kvpool stats` from a machine off the pool: one of its shards gathers them (as it does for
    `kvpool stats` on a pool node, asked on its socket)."""
    connect(address, start_local=False)
    state = ray.get(ray.get_actor(CONTROLLER, namespace=NAMESPACE).state.remote(), timeout=timeout_s)
    for sid in sorted(state["shards"]):
        try:
            return ray.get(ray.get_actor(shard_name("default", sid), namespace=NAMESPACE).pool_stats.remote(),
                           timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead shard: ask the next
            continue
    raise Unavailable(f"no shard of the pool answers (membership version {state['version']}, "
                      f"{len(state['shards'])} shards listed)")
