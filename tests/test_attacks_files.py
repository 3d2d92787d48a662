"""Attacks through the files that hold a secret: the pool secret (``$KVPOOL_SECRET_FILE``,
``~/.kvpool/secret``), the Ray token (``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``) and an
engine's credentials file. One that users other than its owner can read was used without a word
(another user read it, minted credentials and read a tenant's chunks): each is refused now with the
``chmod 600`` that fixes it, and the files kvpool writes are its owner's alone (0600), checked as
another Unix user (``nobody``). No Ray: the functions and the CLI, called as an operator would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpool import auth, auth_cli
from kvpool.auth import Authority, new_secret
from kvpool.connectors.tenancy import Tenancy
from kvpool.errors import BadRequest
from kvpool.private import check_private

NOBODY = 65534


def as_nobody(*argv: str, **kw) -> subprocess.CompletedProcess:
    """``argv`` run as another Unix user (``nobody``), as an attacker on the same machine."""
    if os.geteuid() != 0:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "needs root to run a process as another user")
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: (os.setgid(NOBODY), os.setuid(NOBODY)), **kw)


@pytest.fixture
def open_dir():
    """A folder every user can reach (pytest's tmp_path is under a 0700 one): only the files'
    own modes stand between them and another user."""
    path = tempfile.mkdtemp(prefix="kvpool-files-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def written(path, text: str, mode: int) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def kvpool_cli(tmp_path, *args, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_SECRET", "KVPOOL_SECRET_FILE")}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**base, "HOME": str(tmp_path), **env})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o666], ids=lambda m: f"{m:04o}")
def test_a_pool_secret_file_others_can_read_is_refused_naming_the_chmod(tmp_path, mode):
    secret = new_secret()
    path = written(tmp_path / "secret", secret + "\n", mode)
    with pytest.raises(BadRequest, match=rf"mode {mode:04o}.*chmod 600 {path}"):
        Authority.from_env({auth.SECRET_FILE_ENV: path})
    with pytest.raises(BadRequest, match=f"chmod 600 {path}"):
        auth_cli.find_secret(path, env={})
    with pytest.raises(BadRequest, match=f"chmod 600 {path}"):
        auth_cli.find_secret(env={auth.SECRET_FILE_ENV: path})
    os.chmod(path, 0o600)  # the fix it names
    assert Authority.from_env({auth.SECRET_FILE_ENV: path}).same_secret(Authority(secret))
    assert auth_cli.find_secret(path, env={})[0] == secret


def test_the_default_secret_and_the_cli_refuse_a_readable_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".kvpool").mkdir(mode=0o700)
    default = written(tmp_path / ".kvpool" / "secret", new_secret(), 0o644)
    with pytest.raises(BadRequest, match=f"chmod 600 {default}"):
        auth_cli.find_secret(env={})
    r = kvpool_cli(tmp_path, "auth", "issue", "acme")
    assert r.returncode == 2 and f"chmod 600 {default}" in r.stderr and "kvp1." not in r.stdout, r.stderr
    os.chmod(default, 0o600)
    r = kvpool_cli(tmp_path, "auth", "issue", "acme")
    assert r.returncode == 0 and r.stdout.startswith("kvp1.tenant.acme."), r.stderr


def test_a_mounted_secret_is_judged_by_the_file_its_link_points_at(tmp_path):
    """A Kubernetes Secret volume: ``KEY -> ..data/KEY``, ``..data -> ..<timestamp>``; the mode
    that matters is the target's."""
    real = tmp_path / "..2024_01_01"
    real.mkdir()
    target = written(real / "pool-secret", new_secret(), 0o644)
    (tmp_path / "..data").symlink_to(real.name)
    (tmp_path / "pool-secret").symlink_to("..data/pool-secret")
    link = str(tmp_path / "pool-secret")
    with pytest.raises(BadRequest, match=f"chmod 600 {target}"):
        Authority.from_env({auth.SECRET_FILE_ENV: link})
    os.chmod(target, 0o400)  # the chart's defaultMode
    assert Authority.from_env({auth.SECRET_FILE_ENV: link}).secured


def test_a_ray_token_file_others_can_read_is_refused(tmp_path, monkeypatch):
    from kvpool.cluster import ops

    monkeypatch.setenv("HOME", str(tmp_path))
    token = written(tmp_path / "tok", "t" * 64, 0o644)
    with pytest.raises(BadRequest, match=f"chmod 600 {token}"):
        ops.ray_token_source({"RAY_AUTH_TOKEN_PATH": token})
    os.chmod(token, 0o600)
    assert ops.ray_token_source({"RAY_AUTH_TOKEN_PATH": token}) == token
    (tmp_path / ".ray").mkdir()
    default = written(tmp_path / ".ray" / "auth_token", "t" * 64, 0o640)
    with pytest.raises(BadRequest, match=f"chmod 600 {default}"):
        ops.ray_token_source({})
    os.chmod(default, 0o600)
    assert ops.ray_token_source({}) == default


def test_a_credentials_file_others_can_read_is_refused(tmp_path):
    issuer = Authority(new_secret())
    creds = written(tmp_path / "credentials.json", json.dumps({"acme": issuer.issue("acme")}), 0o644)
    cfg = {"backend": "node", "tenants": ["acme"], "tenant": "acme", "credentials_file": creds}
    with pytest.raises(BadRequest, match=f"chmod 600 {creds}") as e:
        Tenancy(cfg)
    assert issuer.issue("acme") not in str(e.value)  # the error never shows a credential
    os.chmod(creds, 0o600)
    assert Tenancy(cfg).default.pool_as == issuer.issue("acme")


def test_another_user_reads_a_file_kvpool_would_refuse_and_none_kvpool_writes(open_dir):
    """The attack, then the defence: as ``nobody`` a 0644 secret file is read (so kvpool refuses
    it); ``kvpool connect`` refuses to add to an old world-readable credentials file (naming the
    chmod); the secret ``kvpool auth init`` writes and the credentials ``kvpool connect`` writes are
    not readable by ``nobody``, and are used."""
    tmp_path = open_dir
    loose = written(tmp_path / "loose-secret", new_secret(), 0o644)
    assert as_nobody("/bin/cat", loose).returncode == 0  # readable: kvpool must not use it
    with pytest.raises(BadRequest, match="chmod 600"):
        Authority.from_env({auth.SECRET_FILE_ENV: loose})

    secret = tmp_path / "kvpool" / "secret"
    r = kvpool_cli(tmp_path, "auth", "init", "--secret-file", str(secret))
    assert r.returncode == 0, r.stderr
    creds = tmp_path / "kvpool" / "credentials.json"
    creds.write_text("{}")
    creds.chmod(0o644)  # an old file of the same name, world-readable: refused, left as it is
    args = ("connect", "vllm", "--tenant", "acme", "--secret-file", str(secret), "--credentials-file", str(creds),
            "--degraded")  # no pool here: nothing to check with
    r = kvpool_cli(tmp_path, *args)
    assert r.returncode == 2 and f"chmod 600 {creds}" in r.stderr and creds.read_text() == "{}", r.stderr
    creds.chmod(0o600)
    r = kvpool_cli(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    for path in (secret, creds):
        assert path.stat().st_mode & 0o777 == 0o600, path
        os.chmod(path.parent, 0o755)  # even with its folder open to all (kvpool made it 0700)
        r = as_nobody("/bin/cat", str(path))
        assert r.returncode != 0 and "Permission denied" in r.stderr and not r.stdout, (path, r.stdout)
    assert Authority.from_env({auth.SECRET_FILE_ENV: str(secret)}).secured
    t = Tenancy({"backend": "node", "tenants": ["acme"], "tenant": "acme", "credentials_file": str(creds)})
    assert Authority(secret.read_text()).verify(t.default.pool_as).tenant == "acme"


def test_a_secret_mounted_for_a_pods_group_is_read_and_one_for_everyone_is_not(tmp_path, monkeypatch):
    """Kubernetes mounts a Secret root's, ``defaultMode | 0440`` with the pod's fsGroup: a pod
    that does not run as root reads it through that group, which passes; read access for everyone
    else never does, nor a group's on the reader's own file."""
    import kvpool.private as private

    path = written(tmp_path / "pool-secret", new_secret(), 0o440)
    os.chown(path, 0, NOBODY)  # root's, the pod's group
    check = lambda: check_private(path, "the pool secret")  # noqa: E731
    with pytest.raises(BadRequest, match="mode 0440"):
        check()  # as root, the file's owner: a group may read its own file
    monkeypatch.setattr(private.os, "geteuid", lambda: 1000)  # the pod's user, in group NOBODY
    monkeypatch.setattr(private.os, "getegid", lambda: NOBODY)
    check()
    monkeypatch.setattr(private.os, "getegid", lambda: 100)
    monkeypatch.setattr(private.os, "getgroups", lambda: [100])
    with pytest.raises(BadRequest, match="mode 0440"):
        check()  # a group this user is not in
    monkeypatch.setattr(private.os, "getgroups", lambda: [100, NOBODY])
    check()
    os.chmod(path, 0o444)
    with pytest.raises(BadRequest, match="mode 0444.*chmod 600"):
        check()  # everyone may read it
