"""Whom an engine trusts on its node (kvpool.node.trust): another Unix user who plants a pool in a
run dir it can write in gets nothing; neither does a process in the shard's place that cannot prove
it holds the pool secret; a captured peer-port opening replays nowhere.

The attacker is ``nobody``, run by the system's Python (stdlib only: the suite's virtualenv is under
a 0700 home), planting files in a world-writable, sticky directory as /dev/shm is."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import IN_CI, make_keys, payload, wait_for

from kvpool.auth import Authority, new_secret
from kvpool.errors import Unauthorized, Unavailable
from kvpool.node import messages as m
from kvpool.node import wire
from kvpool.node.client import NodeClient
from kvpool.node.probe import why_down
from kvpool.node.trust import UntrustedRunDir, default_run_dir, ensure_run_dir, why_untrusted_dir

NOBODY = 65534
PAGE = 16 << 10
SYSTEM_PYTHON = "/usr/bin/python3"

# Stands in for a shard: a node file naming itself, a socket that records the connections it
# accepted and the bytes each brought before it closed (into COUNT, JSON), a page table an engine
# maps and a slab. Prints "ready" once listening.
IMPOSTOR = r"""
import fcntl, json, os, socket, struct, sys, threading
run, name, count = sys.argv[1], sys.argv[2], sys.argv[3]
base = os.path.join(run, name)
sock = base + ".sock"
with open(base + ".slab", "wb") as f:
    f.truncate(1 << 20)
with open(base + ".kvtable", "wb") as f:  # a page table's header (kvpool.node.table_file), 1024 empty slots
    f.write(struct.pack("<8sIIQQQQQQ", b"KVPTAB01", 1, 64, 1024, 1, os.getpid(), 0, 0, 0))
    f.truncate(128 + 1024 * 64)
alive = os.open(base + ".kvtable", os.O_RDONLY)
fcntl.flock(alive, fcntl.LOCK_EX)  # as a live shard holds it
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sock)
os.chmod(sock, 0o777)
s.listen(16)
info = {"wire": %d, "pool": "default", "shard": name.split("-", 2)[2], "socket": sock, "table": base + ".kvtable",
        "slab": base + ".slab", "page_bytes": 4096, "dram_pages": 256, "incarnation": "x", "pid": os.getpid(),
        "secured": True, "peer": "127.0.0.1:1"}
with open(base + ".node", "w") as f:
    json.dump(info, f)
lock, accepted, closed = threading.Lock(), [0], []
def note():
    with open(count + ".tmp", "w") as f:
        json.dump({"accepted": accepted[0], "closed": closed}, f)
    os.replace(count + ".tmp", count)
def serve(c):
    n = 0
    while True:
        b = c.recv(65536)
        if not b:
            break
        n += len(b)
    with lock:
        closed.append(n)
        note()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    with lock:
        accepted[0] += 1
        note()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
""" % m.WIRE_VERSION


def _need_root() -> None:
    if os.geteuid() != 0:
        (pytest.fail if IN_CI else pytest.skip)("needs root to run a process as another user")


@pytest.fixture
def world():
    """A directory as /dev/shm is: every user may write in it (sticky)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="kvpool-world-", dir=base)
    os.chmod(path, 0o1777)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def impostor(world):
    """Starts nobody's impostor shard in a directory; ``start(...)`` returns ``got(socket_path)``."""
    _need_root()
    procs = []

    def start(run: Path, name: str = "kvpool-default-single-node"):
        count = world / f"count-{len(procs)}"
        p = subprocess.Popen([SYSTEM_PYTHON, "-c", IMPOSTOR, str(run), name, str(count)], stdout=subprocess.PIPE,
                             text=True, preexec_fn=lambda: (os.setgid(NOBODY), os.setuid(NOBODY)))
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        def state() -> dict:
            return json.loads(count.read_text()) if count.exists() else {"accepted": 0, "closed": []}

        def got(sock: Path) -> int:
            """The bytes every connection to the impostor brought. A connection of our own to its
            socket (now at ``sock``), closed at once, is accepted after every earlier one (accepts
            come in order); then every accepted one must close, its count final."""
            marker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            marker.connect(str(sock))
            marker.close()
            wait_for(lambda: (st := state())["accepted"] >= 1 and len(st["closed"]) == st["accepted"], 10,
                     what="every connection to the impostor to close")
            return sum(state()["closed"])

        return got

    yield start
    for p in procs:
        p.kill()
        p.wait()


def kvpool_cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvpool"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_default_run_dir_is_the_users_own_and_made_private(tmp_path):
    assert default_run_dir() == f"/dev/shm/kvpool-{os.geteuid()}"
    run = tmp_path / "made"
    ensure_run_dir(str(run))
    assert run.stat().st_mode & 0o777 == 0o700 and why_untrusted_dir(str(run)) is None
    run.chmod(0o770)
    with pytest.raises(UntrustedRunDir, match="others can write in it"):
        ensure_run_dir(str(run))


def test_another_user_planting_a_pool_in_a_shared_dir_gets_nothing(world, impostor, tmp_path):
    """Row: another Unix user plants a pool where engines look. Before any pool runs, nobody stands a
    node file and a socket in a world-writable run dir; `kvpool up` and `kvpool connect` are refused
    there with the fix, and an engine's client sends it no byte (no credential, no KV)."""
    got = impostor(world)
    secret = new_secret()
    alice = Authority(secret).issue("alice")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "RAY_ADDRESS"))}
    env.update({"HOME": str(tmp_path), "KVPOOL_RUN_DIR": str(world), "KVPOOL_SECRET": secret})
    for args in (("connect", "vllm", "--tenant", "default", "--tenant", "acme"), ("up", "--dram", "32MiB", "--page-size", "4MiB")):
        r = kvpool_cli(env, *args)
        assert r.returncode != 0 and "not trusted" in r.stderr and "others can write in it" in r.stderr, r.stderr
        assert "mkdir -m 700" in r.stderr
    with pytest.raises(UntrustedRunDir):
        NodeClient(directory=str(world))
    # nobody's own directory under the user's default name is refused the same way (it is not the user's)
    squat = world / "kvpool-squat"
    subprocess.run(["/bin/mkdir", "-m", "777", str(squat)], check=True,
                   preexec_fn=lambda: (os.setgid(NOBODY), os.setuid(NOBODY)))
    with pytest.raises(UntrustedRunDir, match="belongs to nobody"):
        ensure_run_dir(str(squat))
    with pytest.raises(UntrustedRunDir):
        NodeClient(directory=str(squat)).check(alice)
    assert got(world / "kvpool-default-single-node.sock") == 0


def test_another_users_files_or_process_in_a_private_run_dir_are_not_used(world, impostor):
    """In the user's own private run dir, a node file or socket that is another user's, or a socket
    whose process runs as another user (SO_PEERCRED), is never used: the client says why and sends
    nothing."""
    run = world / "ours"  # private, on the same filesystem as nobody's files (moved in below)
    ensure_run_dir(str(run))
    alice = Authority(new_secret()).issue("alice")
    got = impostor(world, "kvpool-default-s1")
    for suffix in (".node", ".sock", ".kvtable", ".slab"):  # moved in, still nobody's
        os.rename(world / f"kvpool-default-s1{suffix}", run / f"kvpool-default-s1{suffix}")
    info = json.loads((run / "kvpool-default-s1.node").read_text())
    info.update({k: str(run / os.path.basename(info[k])) for k in ("socket", "table", "slab")})
    (run / "kvpool-default-s1.node").write_text(json.dumps(info))
    os.chown(run / "kvpool-default-s1.node", NOBODY, NOBODY)
    c = NodeClient(directory=str(run), timeout_s=1.0)
    assert "node file" in why_down(c) and "belongs to nobody" in why_down(c)
    with pytest.raises(Unavailable):
        c.check(alice)
    os.chown(run / "kvpool-default-s1.node", 0, 0)  # the node file ours: the socket is still nobody's
    c._next_try = 0.0
    assert "socket" in why_down(c) and "belongs to nobody" in why_down(c)
    for suffix in (".sock", ".kvtable", ".slab"):  # every file ours: the process behind the socket is not
        os.chown(run / f"kvpool-default-s1{suffix}", 0, 0)
    c._next_try = 0.0
    assert "runs as nobody" in why_down(c), why_down(c)
    c.close()
    assert c.counts["untrusted"] >= 3
    assert got(run / "kvpool-default-s1.sock") == 0


@pytest.fixture
def shard_of(tmp_path, monkeypatch):
    """A single-node shard (no Ray) in a private run dir, with ``secret`` (None: an open pool)."""
    from kvpool.cluster.shard_core import Shard
    from kvpool.cluster.solo import Alone
    from kvpool.index.embedded import EmbeddedIndex

    made = []

    def start(secret: str | None):
        monkeypatch.setenv("KVPOOL_RUN_DIR", str(tmp_path / f"run{len(made)}"))
        monkeypatch.delenv("KVPOOL_SECRET_FILE", raising=False)
        if secret is None:
            monkeypatch.delenv("KVPOOL_SECRET", raising=False)
        else:
            monkeypatch.setenv("KVPOOL_SECRET", secret)
        s = Shard("s1", "default", {"page_bytes": PAGE, "dram_pages": 16}, [{"id": "alice"}], EmbeddedIndex(),
                  Alone(), node_id="n", host="127.0.0.1")
        made.append(s)
        return s, str(tmp_path / f"run{len(made) - 1}")

    yield start
    for s in made:
        s.drain(s.auth.pool_credential())


def test_a_shard_that_cannot_prove_the_pool_secret_is_sent_no_credential(shard_of):
    """The client asks the shard to prove it holds the secret that issued a credential before the
    credential leaves: a shard of another secret, or an open one, never receives it."""
    alice = Authority(new_secret()).issue("alice")
    for secret, why in ((new_secret(), "another pool secret"), (None, "open pool")):
        shard, run = shard_of(secret)
        seen: list[str] = []
        verify = shard.service.auth.verify

        def spied(cred, _verify=verify, _seen=seen):
            _seen.append(cred)
            return _verify(cred)

        shard.service.auth.verify = spied
        c = NodeClient(directory=run)
        with pytest.raises(Unauthorized, match=why) as e:
            c.check(alice)
        assert "kvpool connect" in e.value.message
        with pytest.raises(Unauthorized, match=why):
            c.put(alice, make_keys(1), [payload(0, PAGE)])
        assert alice not in seen and c.counts["unproven"] == 2
        c.close()
    shard, run = shard_of(ours_secret := new_secret())  # the pool's own secret: proven once, then served
    alice = Authority(ours_secret).issue("alice")
    c = NodeClient(directory=run)
    assert c.put(alice, make_keys(2), [payload(i, PAGE) for i in range(2)]) == 2
    assert len(c.get(alice, make_keys(2))) == 2 and c.counts["unproven"] == 0 and len(c._proven) == 1
    c.close()


def test_a_captured_peer_port_opening_replays_nowhere(shard_of):
    """The peer port's opening is a challenge both ways over fresh nonces: the bytes of a real
    opening, sent again, are hung up on before any header is read; a port that cannot prove the
    pool's credential is sent nothing past the dialer's nonce."""
    secret = new_secret()
    shard, _ = shard_of(secret)
    pool_key = Authority(secret).pool_credential()
    host, port = shard.node.peer_address.rsplit(":", 1)
    sent: list[bytes] = []

    class Tap:  # the dialer's socket, its bytes recorded as a listener on the wire would
        def __init__(self, s):
            self.s = s

        def sendall(self, b):
            sent.append(bytes(b))
            return self.s.sendall(b)

        def __getattr__(self, name):
            return getattr(self.s, name)

    s = socket.create_connection((host, int(port)), timeout=5)
    ch = wire.open_peer(Tap(s), pool_key, deadline=time.monotonic() + 5)
    msg = m.PeerGet(pool_key, Authority(secret).issue("alice"), [bytes(make_keys(1)[0])], False)
    ok, r, _ = ch.request(msg, deadline=time.monotonic() + 5, timeout_s=5)
    assert ok and r["checksums"] == [], r  # a real opening: served
    s.close()
    refused = shard.node.refused_peers
    replay = socket.create_connection((host, int(port)), timeout=5)
    replay.sendall(sent[0])  # the same magic and nonce
    replay.recv(wire.PEER_NONCE + wire.PEER_MAC)  # the port's answer, over a fresh nonce of its own
    replay.sendall(sent[1] + b"\0" * 64)  # the captured proof, then what would be a frame
    replay.settimeout(5)
    try:
        assert replay.recv(1) == b""  # hung up on
    except ConnectionResetError:  # hung up on with our bytes unread
        pass
    replay.close()
    wait_for(lambda: shard.node.refused_peers == refused + 1, 5, what="the replayed opening to be refused")
    # a dialer of another secret: the port's proof fails on its side, and it sends nothing more
    with pytest.raises(wire.PeerUnproven):
        wire.open_peer(socket.create_connection((host, int(port)), timeout=5), Authority(new_secret()).pool_credential(),
                       deadline=time.monotonic() + 5)
    wait_for(lambda: shard.node.refused_peers == refused + 2, 5, what="the other secret's opening to be refused")
