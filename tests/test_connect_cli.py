"""`kvpool connect vllm|sglang`: the config an engine on this node takes, and the credentials file
it names (the tenants' credentials, issued from the pool secret, never on the command line)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from kvpool.auth import Authority
from kvpool.connectors.pools import check_config

SECRET = "connect-cli-test-secret-" + "9" * 32


def connect(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_SECRET")} | {"HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", "connect", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_vllm_config_names_a_private_credentials_file_the_pool_accepts(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "secret").chmod(0o600)  # kvpool refuses a secret file others can read
    creds = tmp_path / "engine" / "creds.json"
    r = connect(tmp_path, "vllm", "--secret-file", str(tmp_path / "secret"), "--credentials-file", str(creds),
                "--tenant", "default", "--tenant", "acme", "--chunk-tokens", "128")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)  # only JSON on stdout: it goes straight into --kv-transfer-config
    assert (cfg["kv_connector"], cfg["kv_connector_module_path"]) == ("KVPoolConnector", "kvpool.connectors.vllm")
    assert cfg["kv_load_failure_policy"] == "recompute"
    extra = cfg["kv_connector_extra_config"]
    assert extra["backend"] == "node" and extra["tenants"] == ["default", "acme"] and extra["chunk_tokens"] == 128
    assert "kvp1" not in r.stdout  # no credential on the engine's command line
    assert extra["credentials_file"] == str(creds)
    assert stat.S_IMODE(os.stat(creds).st_mode) == 0o600
    issued = json.loads(creds.read_text())
    authority = Authority(SECRET)
    assert {t: authority.verify(c).tenant for t, c in issued.items()} == {"default": "default", "acme": "acme"}
    assert check_config(extra)["credentials_file"] == str(creds)  # what the connector will accept


def test_sglang_config_is_the_dynamic_backends(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "secret").chmod(0o600)  # kvpool refuses a secret file others can read
    r = connect(tmp_path, "sglang", "--secret-file", str(tmp_path / "secret"), "--chunk-tokens", "64", "--degraded")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert (cfg["backend_name"], cfg["module_path"], cfg["class_name"]) == (
        "kvpool", "kvpool.connectors.sglang", "KVPoolStorage")
    assert cfg["chunk_tokens"] == 64 and cfg["degraded"] is True
    assert cfg["credentials_file"] == str(tmp_path / ".kvpool" / "credentials.json")  # the default, under $HOME
    assert os.path.isfile(cfg["credentials_file"])


def test_bad_input_names_the_fix(tmp_path):
    r = connect(tmp_path, "vllm")  # no pool secret anywhere
    assert r.returncode == 2 and "kvpool auth init" in r.stderr and not r.stdout
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "secret").chmod(0o600)  # kvpool refuses a secret file others can read
    r = connect(tmp_path, "vllm", "--secret-file", str(tmp_path / "secret"), "--chunk-tokens", "0")
    assert r.returncode == 2 and "--chunk-tokens" in r.stderr
    r = connect(tmp_path, "vllm", "--secret-file", str(tmp_path / "secret"), "--tenant", "bad name!")
    assert r.returncode == 2 and "tenant" in r.stderr


def test_prefill_and_decode_instances_get_their_kv_roles(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "secret").chmod(0o600)
    roles = {}
    for role in ("both", "producer", "consumer"):
        r = connect(tmp_path, "vllm", "--secret-file", str(tmp_path / "secret"), "--role", role)
        assert r.returncode == 0, r.stderr
        roles[role] = json.loads(r.stdout)["kv_role"]
    assert roles == {"both": "kv_both", "producer": "kv_producer", "consumer": "kv_consumer"}
    r = connect(tmp_path, "sglang", "--secret-file", str(tmp_path / "secret"), "--role", "producer")
    assert r.returncode != 0 and "vLLM's (kv_role)" in r.stderr and not r.stdout
