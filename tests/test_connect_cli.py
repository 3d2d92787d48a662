"""`kvpool connect vllm|sglang` against a real pool on this machine (a single-node pool, as `kvpool
up` starts it): the config an engine takes, the credentials it writes (never on the command line,
never rewritten under a running engine), and the checks it makes with the pool first; and the
connector's own start-up check of its tenants' credentials (kvpool.connectors.pool_start)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from kvpool.auth import Authority
from kvpool.connectors.pools import check_config, node_pool, spec_for
from kvpool.errors import BadRequest, Unauthorized, UnknownTenant
from kvpool.tenants import Tenant

SECRET = "connect-cli-test-secret-" + "9" * 32
STATIC = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def run(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A single-node pool serving tenants default and acme, in a home and run dir of its own."""
    tmp = tmp_path_factory.mktemp("connect")
    home, rundir = tmp / "home", tmp / "run"
    home.mkdir()
    rundir.mkdir()
    (home / "secret").write_text(SECRET)
    (home / "secret").chmod(0o600)  # kvpool refuses a secret file others can read
    drop = ("KVPOOL_SECRET", "KVPOOL_RUN_DIR", "KVPOOL_POOL_RECORD", "KVPOOL_CREDENTIAL", "RAY_ADDRESS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"HOME": str(home), "KVPOOL_RUN_DIR": str(rundir), "KVPOOL_SECRET_FILE": str(home / "secret")})
    r = run(env, "up", "--dram", "32MiB", "--page-size", "1MiB", "--tenant", "default", "--tenant", "acme")
    assert r.returncode == 0, r.stderr
    yield {"env": env, "home": home, "run": rundir}
    run(env, "down")


def test_vllm_config_is_the_static_one_and_the_credentials_verify(pool):
    r = run(pool["env"], "connect", "vllm", "--tenant", "default", "--tenant", "acme")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)  # only JSON on stdout
    # the config a user writes once, literally: the connector finds the pool and the credentials itself
    assert cfg == {**STATIC, "kv_connector_extra_config": {"backend": "node", "tenants": ["default", "acme"]}}
    assert "kvp1" not in r.stdout  # no credential on the engine's command line
    creds = pool["home"] / ".kvpool" / "credentials.json"
    assert stat.S_IMODE(os.stat(creds).st_mode) == 0o600
    issued = json.loads(creds.read_text())
    assert {t: Authority(SECRET).verify(c).tenant for t, c in issued.items()} == {"default": "default", "acme": "acme"}
    check_config(cfg["kv_connector_extra_config"])  # what the connector will accept


def test_other_settings_are_named_in_the_config(pool, tmp_path):
    creds = tmp_path / "engine" / "creds.json"
    r = run(pool["env"], "connect", "vllm", "--credentials-file", str(creds), "--tenant", "acme", "--chunk-tokens",
            "128")
    assert r.returncode == 0, r.stderr
    extra = json.loads(r.stdout)["kv_connector_extra_config"]
    assert extra == {"backend": "node", "tenants": ["acme"], "chunk_tokens": 128, "credentials_file": str(creds)}
    assert list(json.loads(creds.read_text())) == ["acme"]


def test_a_second_connect_never_takes_a_running_engines_tenants_away(pool):
    creds = pool["home"] / ".kvpool" / "credentials.json"
    assert run(pool["env"], "connect", "vllm", "--tenant", "acme").returncode == 0
    first = json.loads(creds.read_text())
    before = os.stat(creds)
    assert run(pool["env"], "connect", "vllm", "--tenant", "acme").returncode == 0  # nothing new: not rewritten
    assert os.stat(creds).st_ino == before.st_ino and os.stat(creds).st_mtime_ns == before.st_mtime_ns
    r = run(pool["env"], "connect", "sglang", "--tenant", "default")
    assert r.returncode == 0, r.stderr
    after = json.loads(creds.read_text())
    assert after["acme"] == first["acme"] and "default" in after  # acme's engine keeps its credential


def test_connect_checks_with_the_pool_first(pool, tmp_path):
    env = pool["env"]
    r = run(env, "connect", "vllm", "--tenant", "globex")  # a tenant the pool does not serve
    assert r.returncode == 2 and "'globex' is not one of the pool's tenants" in r.stderr and "--tenant globex" in r.stderr
    other = tmp_path / "other-secret"
    other.write_text("another-pool-secret-" + "1" * 32)
    other.chmod(0o600)
    r = run(env, "connect", "vllm", "--secret-file", str(other))  # not the running pool's secret
    assert r.returncode == 2 and "does not take credentials issued from the pool secret" in r.stderr, r.stderr
    assert not r.stdout
    # before `kvpool up` (no shard in this run dir): the fix is `kvpool up`, not a new secret
    empty = tmp_path / "run"
    empty.mkdir()
    r = run({**env, "KVPOOL_RUN_DIR": str(empty), "KVPOOL_SECRET_FILE": ""}, "connect", "vllm")
    assert r.returncode == 2 and "no pool is up on this node" in r.stderr and "kvpool up" in r.stderr, r.stderr
    assert "auth init" not in r.stderr and not r.stdout
    r = run({**env, "KVPOOL_RUN_DIR": str(empty)}, "connect", "sglang", "--chunk-tokens", "64", "--degraded")
    assert r.returncode == 0, r.stderr  # --degraded: the engine may start before the pool
    cfg = json.loads(r.stdout)
    assert (cfg["backend_name"], cfg["module_path"], cfg["class_name"]) == (
        "kvpool", "kvpool.connectors.sglang", "KVPoolStorage")
    assert cfg["chunk_tokens"] == 64 and cfg["degraded"] is True
    r = run(env, "connect", "vllm", "--chunk-tokens", "0")
    assert r.returncode == 2 and "--chunk-tokens" in r.stderr
    r = run(env, "connect", "vllm", "--tenant", "bad name!")
    assert r.returncode == 2 and "tenant" in r.stderr


def test_prefill_and_decode_instances_get_their_kv_roles(pool):
    roles = {}
    for role in ("both", "producer", "consumer"):
        r = run(pool["env"], "connect", "vllm", "--role", role)
        assert r.returncode == 0, r.stderr
        roles[role] = json.loads(r.stdout)["kv_role"]
    assert roles == {"both": "kv_both", "producer": "kv_producer", "consumer": "kv_consumer"}
    r = run(pool["env"], "connect", "sglang", "--role", "producer")
    assert r.returncode != 0 and "vLLM's (kv_role)" in r.stderr and not r.stdout


def test_the_connector_verifies_each_tenants_credential_at_start(pool, monkeypatch):
    """What the vLLM and SGLang connectors ask the pool once at start (kvpool.connectors.pool_start)."""
    from kvpool.connectors.pool_start import verify_tenants
    from kvpool.connectors.tenancy import Tenancy
    from kvpool.node.client import NodeClient

    monkeypatch.setenv("KVPOOL_RUN_DIR", str(pool["run"]))
    monkeypatch.setenv("HOME", str(pool["home"]))
    monkeypatch.delenv("KVPOOL_SECRET_FILE", raising=False)
    assert run(pool["env"], "connect", "vllm", "--tenant", "acme").returncode == 0
    cfg = check_config({"backend": "node", "tenants": ["acme"]})  # the static config: no file named
    tenancy = Tenancy(cfg, engine="test")
    assert tenancy.default.tenant == "acme"  # a config of one tenant serves it by default
    assert tenancy.pool_routes()["acme"].startswith("kvp1.")  # found in ~/.kvpool/credentials.json
    spec = spec_for("m", 1, 1, 8, "float32", chunk_tokens=16)
    client = NodeClient(timeout_s=5.0)
    opened = node_pool(spec, client, [Tenant("acme"), Tenant("default"), Tenant("globex")])
    try:
        verify_tenants(opened, tenancy.pool_routes(), cfg, "test")  # the pool takes it
        forged = Authority("another-pool-secret-" + "2" * 32).issue("acme")
        with pytest.raises(Unauthorized, match="kvpool connect vllm --tenant acme"):
            verify_tenants(opened, {"acme": forged}, cfg, "test")
        client = NodeClient(timeout_s=5.0)
        opened = node_pool(spec, client, [Tenant("globex")])
        with pytest.raises(UnknownTenant, match="kvpool up --tenant globex"):
            verify_tenants(opened, {"globex": Authority(SECRET).issue("globex")}, cfg, "test")
    finally:
        client.close()


def test_a_key_typo_says_what_was_meant():
    with pytest.raises(BadRequest, match=r"'chunk_token' \(did you mean 'chunk_tokens'\?\)"):
        check_config({"backend": "node", "chunk_token": 256})
    from kvpool.connectors.vllm_config import split_config

    with pytest.raises(BadRequest, match=r"'breakeven_margn' \(did you mean 'breakeven_margin'\?\)"):
        split_config({"breakeven_margn": 1.2})
    with pytest.raises(BadRequest, match=r"'quota' \(did you mean 'quota_bytes'\?\)"):
        check_config({"tenants": [{"id": "a", "quota": 5}]})
    with pytest.raises(BadRequest, match=r"unknown .*'zzz'; known"):  # nothing close: no guess
        check_config({"zzz": 1})
