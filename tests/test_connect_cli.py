"""`kvpool connect vllm|sglang` against a real pool on this machine (a single-node pool, as `kvpool
up` starts it): the config an engine takes (the short one a user writes once), the credentials it
writes (never on the command line, never rewritten under a running engine), the checks it makes
with the pool first; and the connectors' own start-up check of their tenants' credentials, one
``check`` call each on the shard's socket (kvpool.connectors.pool_start)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from kvpool.auth import Authority
from kvpool.connectors.pool_start import verify_tenants
from kvpool.connectors.pools import check_config, node_pool, spec_for
from kvpool.connectors.tenancy import Tenancy
from kvpool.connectors.vllm_config import split_config
from kvpool.errors import BadRequest, Unauthorized, Unavailable, UnknownTenant
from kvpool.node.client import NodeClient
from kvpool.tenants import Tenant

SECRET = "connect-cli-test-secret-" + "9" * 32
# The config a user writes once, literally: the connector finds the pool, its tenant and credential itself.
STATIC = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
          "kv_role": "kv_both"}
SPEC = spec_for("m", 1, 1, 8, "float32", chunk_tokens=16)


def run(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def start_pool(tmp, *tenants: str) -> dict:
    """A single-node pool serving ``tenants``, in a home and run dir of its own."""
    home, rundir = tmp / "home", tmp / "run"
    home.mkdir()
    rundir.mkdir()
    (home / "secret").write_text(SECRET)
    (home / "secret").chmod(0o600)  # kvpool refuses a secret file others can read
    drop = ("KVPOOL_SECRET", "KVPOOL_RUN_DIR", "KVPOOL_POOL_RECORD", "KVPOOL_CREDENTIAL", "RAY_ADDRESS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"HOME": str(home), "KVPOOL_RUN_DIR": str(rundir), "KVPOOL_SECRET_FILE": str(home / "secret")})
    r = run(env, "up", "--dram", "32MiB", "--page-size", "1MiB", *(a for t in tenants for a in ("--tenant", t)))
    assert r.returncode == 0, r.stderr
    return {"env": env, "home": home, "run": rundir}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Tenants default and acme."""
    p = start_pool(tmp_path_factory.mktemp("connect"), "default", "acme")
    yield p
    run(p["env"], "down")


@pytest.fixture(scope="module")
def acme_pool(tmp_path_factory):
    """`kvpool up --tenant acme`: a pool without tenant default."""
    p = start_pool(tmp_path_factory.mktemp("connect-acme"), "acme")
    yield p
    run(p["env"], "down")


@pytest.fixture
def engine_env(monkeypatch):
    """This process as an engine of ``pool`` on its node: its home (the credentials) and run dir."""
    def enter(p: dict) -> None:
        monkeypatch.setenv("KVPOOL_RUN_DIR", str(p["run"]))
        monkeypatch.setenv("HOME", str(p["home"]))
        monkeypatch.delenv("KVPOOL_SECRET_FILE", raising=False)
        monkeypatch.delenv("KVPOOL_CREDENTIAL", raising=False)
    return enter


def test_the_config_is_the_static_one_a_user_writes_once(pool):
    r = run(pool["env"], "connect", "vllm")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == STATIC  # only JSON on stdout, and nothing but the engine's settings
    r = run(pool["env"], "connect", "vllm", "--tenant", "default", "--tenant", "acme")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg == {**STATIC, "kv_connector_extra_config": {"tenants": ["default", "acme"]}}
    assert "kvp1" not in r.stdout  # no credential on the engine's command line
    creds = pool["home"] / ".kvpool" / "credentials.json"
    assert stat.S_IMODE(os.stat(creds).st_mode) == 0o600
    issued = json.loads(creds.read_text())
    assert {t: Authority(SECRET).verify(c).tenant for t, c in issued.items()} == {"default": "default", "acme": "acme"}
    # what the vLLM connector makes of them: this node's pool (not an in-process one), its tenants
    assert split_config(None)[0] == {"backend": "node"}
    pool_cfg, _ = split_config(cfg["kv_connector_extra_config"])
    assert check_config(pool_cfg)["backend"] == "node" and check_config(pool_cfg)["tenants"] == ["default", "acme"]
    assert split_config({"backend": "local"})[0]["backend"] == "local"  # tests, benchmarks: said, not defaulted


def test_other_settings_are_named_in_the_config(pool, tmp_path):
    creds = tmp_path / "engine" / "creds.json"
    r = run(pool["env"], "connect", "vllm", "--credentials-file", str(creds), "--tenant", "acme", "--chunk-tokens",
            "128")
    assert r.returncode == 0, r.stderr
    extra = json.loads(r.stdout)["kv_connector_extra_config"]
    assert extra == {"tenants": ["acme"], "chunk_tokens": 128, "credentials_file": str(creds)}
    assert list(json.loads(creds.read_text())) == ["acme"]
    r = run(pool["env"], "connect", "sglang", "--tenant", "acme")  # SGLang's backend is local unless told
    assert r.returncode == 0, r.stderr
    assert {k: v for k, v in json.loads(r.stdout).items() if k in ("backend", "tenants")} == {
        "backend": "node", "tenants": ["acme"]}


def test_connect_serves_the_tenants_the_pool_was_started_with(acme_pool, engine_env):
    r = run(acme_pool["env"], "connect", "vllm", "--tenant", "acme")
    assert r.returncode == 0, r.stderr
    extra = json.loads(r.stdout)["kv_connector_extra_config"]
    assert extra == {"tenants": ["acme"]}
    engine_env(acme_pool)
    pool_cfg, _ = split_config(extra)
    tenancy = Tenancy(pool_cfg, engine="test")
    assert tenancy.default.tenant == "acme"  # a config of one tenant serves it by default
    client = NodeClient(timeout_s=5.0)
    try:
        verify_tenants(node_pool(SPEC, client, [Tenant("acme")]), tenancy.pool_routes(), pool_cfg, "test")
    finally:
        client.close()
    # without --tenant: tenant default, which this pool does not serve; the pool's tenants, the fixes
    r = run(acme_pool["env"], "connect", "vllm")
    assert r.returncode == 2 and not r.stdout, r.stderr
    assert "tenant 'default' is not one of the pool's tenants ['acme']" in r.stderr, r.stderr
    assert "kvpool up ... --tenant default" in r.stderr and "--tenant NAME" in r.stderr
    # the static config without tenants on this pool: its engine stops at start, naming "tenants"
    client = NodeClient(timeout_s=5.0)
    try:
        with pytest.raises(UnknownTenant, match=r"""the pool's tenants \['acme'\].*"tenants": \["acme"\]"""):
            verify_tenants(node_pool(SPEC, client, [Tenant("default")]), {"default": Authority(SECRET).issue(
                "default")}, split_config({})[0], "test")
    finally:
        client.close()


def test_a_second_connect_never_rewrites_a_file_a_running_engine_holds(pool, engine_env, tmp_path):
    creds = tmp_path / "engine" / "credentials.json"
    connect = ("connect", "vllm", "--credentials-file", str(creds))
    assert run(pool["env"], *connect, "--tenant", "acme").returncode == 0
    engine_env(pool)
    cfg = split_config({"tenants": ["acme"], "credentials_file": str(creds)})[0]
    tenancy = Tenancy(cfg, engine="test")  # an engine starts: it reads its credential once
    client = NodeClient(timeout_s=5.0)
    engine = node_pool(SPEC, client, [Tenant("acme")])
    acme = tenancy.default.pool_as
    verify_tenants(engine, tenancy.pool_routes(), cfg, "test")
    keys = engine.keys(acme, list(range(32)))
    data = [torch.full(SPEC.chunk_shape, float(i)) for i in range(2)]
    try:
        assert engine.save(acme, keys, data) == 2
        before, text = os.stat(creds), creds.read_text()
        with open(creds) as held:  # the file the engine read, held open
            assert run(pool["env"], *connect, "--tenant", "acme").returncode == 0  # nothing new: not rewritten
            assert (os.stat(creds).st_ino, os.stat(creds).st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
            r = run(pool["env"], *connect, "--tenant", "default")  # another engine, other tenants
            assert r.returncode == 0, r.stderr
            assert os.stat(creds).st_ino != before.st_ino  # a new file took the name: the held one is as it was
            assert held.read() == text == json.dumps({"acme": acme})
        after = json.loads(creds.read_text())
        assert after["acme"] == acme and "default" in after  # and it keeps acme's engine's credential
        # the running engine goes on as before, and one that restarts on the same config finds acme's credential
        assert engine.lookup(acme, keys) == 32 and len(engine.load(acme, keys)) == 2  # tokens, chunks
        assert Tenancy(cfg, engine="test").default.pool_as == acme
    finally:
        client.close()


def test_connects_at_once_keep_every_tenant(pool, tmp_path):
    """Each connect adds its tenants under a lock on the file's folder: none is lost to another's write."""
    creds = tmp_path / "creds.json"
    tenants = [f"t{i}" for i in range(6)]
    procs = [subprocess.Popen([sys.executable, "-m", "kvpool.cli", "connect", "vllm", "--degraded", "--tenant", t,
                               "--credentials-file", str(creds)], env=pool["env"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for t in tenants]
    for p in procs:
        assert p.wait(120) == 0, p.stderr.read()
    assert sorted(json.loads(creds.read_text())) == tenants
    assert sorted(os.listdir(tmp_path)) == ["creds.json"]  # no lock or temporary file left beside it


def test_connect_checks_with_the_pool_first(pool, tmp_path):
    env = pool["env"]
    r = run(env, "connect", "vllm", "--tenant", "globex")  # a tenant the pool does not serve
    assert r.returncode == 2 and "'globex' is not one of the pool's tenants ['acme', 'default']" in r.stderr, r.stderr
    assert "--tenant globex" in r.stderr
    other = tmp_path / "other-secret"
    other.write_text("another-pool-secret-" + "1" * 32)
    other.chmod(0o600)
    r = run(env, "connect", "vllm", "--secret-file", str(other))  # not the running pool's secret
    assert r.returncode == 2 and "does not take credentials issued from the pool secret" in r.stderr, r.stderr
    assert not r.stdout
    # before `kvpool up` (no shard in this run dir, and no pool secret yet): the fix is `kvpool up`
    empty, home = tmp_path / "run", tmp_path / "home"
    empty.mkdir()
    home.mkdir()
    r = run({**env, "KVPOOL_RUN_DIR": str(empty), "HOME": str(home), "KVPOOL_SECRET_FILE": ""}, "connect", "vllm")
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


def test_the_shard_checks_a_credential_as_every_operation_does(pool, engine_env):
    engine_env(pool)
    client = NodeClient(timeout_s=5.0)
    try:
        assert client.check(Authority(SECRET).issue("acme")) == {"tenant": "acme", "served": True}
        # a tenant the pool does not serve, with a credential only the pool secret's holder can issue
        assert client.check(Authority(SECRET).issue("globex")) == {
            "tenant": "globex", "served": False, "tenants": ["acme", "default"]}
        for refused in (Authority("another-pool-secret-" + "2" * 32).issue("acme"), "acme"):
            with pytest.raises(Unauthorized):  # and learns no tenant
                client.check(refused)
    finally:
        client.close()


def test_the_connector_verifies_each_tenants_credential_at_start(pool, engine_env, tmp_path, caplog, monkeypatch):
    """What the vLLM and SGLang connectors ask the pool once at start (kvpool.connectors.pool_start)."""
    engine_env(pool)
    cfg = split_config({"tenants": ["acme"]})[0]
    client = NodeClient(timeout_s=5.0)
    opened = node_pool(SPEC, client, [Tenant("acme")])
    try:
        forged = Authority("another-pool-secret-" + "2" * 32).issue("acme")
        with pytest.raises(Unauthorized, match="another pool secret.*kvpool connect vllm --tenant acme"):
            verify_tenants(opened, {"acme": forged}, cfg, "test")
        with pytest.raises(Unauthorized, match="kvpool connect sglang --tenant acme"):
            verify_tenants(node_pool(SPEC, NodeClient(timeout_s=5.0), [Tenant("acme")]), {"acme": forged}, cfg,
                           "test", "sglang")
        # no credential anywhere (no credentials file in this home): the pool is asked with the bare id
        monkeypatch.setenv("HOME", str(tmp_path))
        routes = Tenancy(cfg, engine="test").pool_routes()
        assert routes == {"acme": "acme"}
        with pytest.raises(Unauthorized, match=r"has no credential \(none in .*no such file\).*kvpool connect vllm "
                                               r"--tenant acme"):
            verify_tenants(node_pool(SPEC, NodeClient(timeout_s=5.0), [Tenant("acme")]), routes, cfg, "test")
        with pytest.raises(UnknownTenant, match=r"'globex' is not one of the pool's tenants \['acme', 'default'\]: "
                                                r"start the pool serving it \(`kvpool up --tenant globex`"):
            verify_tenants(node_pool(SPEC, NodeClient(timeout_s=5.0), [Tenant("globex")]),
                           {"globex": Authority(SECRET).issue("globex")}, split_config({"tenants": ["globex"]})[0],
                           "test")
        # several tenants, each with its own problem: one start names them all, each with its fix
        several = {"acme": forged, "default": "default", "globex": Authority(SECRET).issue("globex")}
        with pytest.raises(Unauthorized) as caught:
            verify_tenants(node_pool(SPEC, NodeClient(timeout_s=5.0), [Tenant("acme")]), several,
                           split_config({"tenants": list(several)})[0], "test")
        said = caught.value.message
        assert said.startswith("test: 3 of its tenants cannot use the pool:\n"), said
        assert "credential of tenant 'acme'" in said and "another pool secret" in said
        assert "tenant 'default' has no credential" in said and "kvpool connect vllm --tenant default" in said
        assert "'globex' is not one of the pool's tenants ['acme', 'default']" in said
        # one good tenant among bad ones is not named
        with pytest.raises(UnknownTenant) as caught:
            verify_tenants(node_pool(SPEC, NodeClient(timeout_s=5.0), [Tenant("acme")]),
                           {"acme": Authority(SECRET).issue("acme"), "globex": Authority(SECRET).issue("globex")},
                           split_config({"tenants": ["acme", "globex"]})[0], "test")
        assert caught.value.message.startswith("test: tenant 'globex' is not one of"), caught.value.message
    finally:
        client.close()
    # a pool that does not answer: a start failure, unless the config says degraded (then a warning)
    down = NodeClient(directory=str(tmp_path), timeout_s=0.3)
    with pytest.raises(Unavailable):
        verify_tenants(node_pool(SPEC, down, [Tenant("acme")]), {"acme": forged}, cfg, "test")
    down = NodeClient(directory=str(tmp_path), timeout_s=0.3)
    verify_tenants(node_pool(SPEC, down, [Tenant("acme")]), {"acme": forged}, {**cfg, "degraded": True}, "test")
    assert "not verified (the pool does not answer" in caplog.text
    down.close()


def test_a_key_typo_says_what_was_meant():
    with pytest.raises(BadRequest, match=r"'chunk_token' \(did you mean 'chunk_tokens'\?\)"):
        check_config({"backend": "node", "chunk_token": 256})
    with pytest.raises(BadRequest, match=r"KVPoolConnector: .*'chunk_token' \(did you mean 'chunk_tokens'\?\)"):
        split_config({"chunk_token": 256})  # vLLM's kv_connector_extra_config
    with pytest.raises(BadRequest, match=r"'breakeven_margn' \(did you mean 'breakeven_margin'\?\)"):
        split_config({"breakeven_margn": 1.2})
    with pytest.raises(BadRequest, match=r"'prefetch_treshold' \(did you mean 'prefetch_threshold'\?\).*known"):
        check_config({"prefetch_treshold": 1}, also={"prefetch_threshold"})  # an engine's own key (SGLang's)
    with pytest.raises(BadRequest, match=r"'quota' \(did you mean 'quota_bytes'\?\)"):
        check_config({"tenants": [{"id": "a", "quota": 5}]})
    with pytest.raises(BadRequest, match=r"unknown .*'zzz'; known"):  # nothing close: no guess
        check_config({"zzz": 1})


def test_a_credentials_file_that_is_not_there_names_connect(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(BadRequest, match=rf"credentials_file {missing}: cannot read it .*kvpool connect vllm\|sglang "
                                         rf"--credentials-file {missing}"):
        Tenancy({"backend": "node", "credentials_file": str(missing)})


def test_a_credentials_file_others_can_read_is_refused_and_no_tenant_is_ever_dropped(tmp_path):
    """A credentials file of 9 tenants that others can read: connecting a tenth is refused naming the
    `chmod 600` (the file untouched, every tenant in it); once private, the tenth is added beside the
    nine. One that is no JSON object of credentials is refused too, never replaced."""
    from kvpool.connect_cli import write_credentials

    creds = tmp_path / "credentials.json"
    held = {f"t{i}": f"credential of t{i}" for i in range(9)}
    creds.write_text(json.dumps(held))
    creds.chmod(0o644)
    before = os.stat(creds)
    with pytest.raises(BadRequest, match=rf"mode 0644.*chmod 600 {creds}.*nothing was written"):
        write_credentials(str(creds), {"t9": "credential of t9"})  # today: replaced by a file of t9 alone
    assert json.loads(creds.read_text()) == held and os.stat(creds).st_ino == before.st_ino
    assert stat.S_IMODE(os.stat(creds).st_mode) == 0o644
    creds.chmod(0o600)
    assert write_credentials(str(creds), {"t9": "credential of t9"}) == str(creds)
    assert json.loads(creds.read_text()) == {**held, "t9": "credential of t9"}
    assert stat.S_IMODE(os.stat(creds).st_mode) == 0o600
    for text in ("{not json", '["t0"]'):
        creds.write_text(text)
        with pytest.raises(BadRequest, match=rf"{creds} is not a JSON object of tenant -> credential"):
            write_credentials(str(creds), {"t9": "credential of t9"})
        assert creds.read_text() == text


def test_connect_refuses_a_credentials_file_others_can_read(pool, tmp_path):
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({"other": "credential of other"}))
    creds.chmod(0o644)
    r = run(pool["env"], "connect", "vllm", "--tenant", "acme", "--credentials-file", str(creds))
    assert r.returncode == 2 and f"chmod 600 {creds}" in r.stderr, r.stderr
    assert json.loads(creds.read_text()) == {"other": "credential of other"}
