"""SGLang's real server with kvpool as its HiCache storage backend: what a CPU machine can check.

SGLang 0.5.23's server runs on a CPU (``--device cpu``, torch_native attention), but not with
``--enable-hierarchical-cache``: its HiCache host pool pins its buffer through
``torch.cuda.cudart()`` and has device<->host copy kernels for CUDA/ROCm/XPU only, so the server
stops at start-up ("Torch not compiled with CUDA enabled"); see
:mod:`kvpool.connectors.bench.gpu_check_sglang`. The end-to-end run (a pool, the server, the same
prompt across a restart, a storage hit with the same answer) is
``python -m kvpool.connectors.bench.gpu_check sglang`` on a GPU machine (``.ci/gpu-check``).

Here, with SGLang's own code:

- the check's ``--dry-run`` plan: SGLang's own command-line parser (``prepare_server_args``)
  accepts the server command, with HiCache, the dynamic backend and kvpool's extra config; the
  pool commands point the server at the pool the check starts;
- that extra config builds kvpool's backend through SGLang's own ``StorageBackendFactory``;
- without a GPU (or without SGLang's CUDA build) the check exits with 2 and a sentence, no trace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import need_engines

need_engines("sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from tinymodel import save_tiny_llama  # noqa: E402

from kvpool.connectors.weights import note_loading  # noqa: E402

CHECK = [sys.executable, "-m", "kvpool.connectors.bench.gpu_check"]


def check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CHECK, *args], capture_output=True, text=True, timeout=300, env=env)


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_dry_run_plan_is_one_sglangs_own_parser_accepts(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    r = check("sglang", "--dry-run", "--python", "/opt/sglang/bin/python", "--workdir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)  # only JSON on stdout
    cold, warm = plan["servers"]
    assert cold[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert option(cold, "--port") != option(warm, "--port")  # the restarted server: the same but for its port
    assert [a for a in cold if a != option(cold, "--port")] == [a for a in warm if a != option(warm, "--port")]

    args = prepare_server_args(cold[3:])  # what `sglang.launch_server` parses (argparse exits on a bad flag)
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert args.hicache_storage_prefetch_policy == "wait_complete"  # the warm request waits for its prefix
    assert args.model_path == plan["model"] and args.skip_tokenizer_init and args.page_size == 64
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra == plan["extra_config"]
    assert (extra["backend_name"], extra["module_path"], extra["class_name"]) == (
        "kvpool", "kvpool.connectors.sglang", "KVPoolStorage")
    assert extra["tenants"] == [{"id": "default", "credential": "<credential of tenant default>"}]  # not printed

    # the pool the server reaches: `kvpool up` on the check's own Ray head, in the run dir it names
    assert extra["backend"] == "node" and extra["run_dir"] == plan["run_dir"] == plan["pool_env"]["KVPOOL_RUN_DIR"]
    assert plan["run_dir"].startswith(str(tmp_path))
    assert f"--port={plan['ray_address'].rsplit(':', 1)[1]}" in plan["ray_start"]
    assert f"--temp-dir={plan['ray_tmp']}" in plan["ray_start"]
    up = plan["kvpool_up"]
    assert up[1] == "up" and option(up, "--ray-address") == plan["ray_address"]
    assert option(up, "--secret-file") == plan["secret_file"]
    assert option(plan["kvpool_stats"], "--ray-address") == plan["ray_address"]
    for argv in (plan["ray_start"], up, plan["kvpool_stats"]):  # the pool's tools: this interpreter's environment
        assert os.path.dirname(argv[0]) == os.path.dirname(sys.executable)
    assert os.listdir(tmp_path) == []  # a dry run starts and writes nothing


def test_the_servers_extra_config_builds_kvpools_backend_through_sglangs_factory(tmp_path):
    from kvpool.auth import Authority
    from kvpool.connectors.bench import gpu_check_sglang
    from kvpool.connectors.sglang import KVPoolStorage

    secret = "k" * 64
    plan = gpu_check_sglang.make_plan(str(tmp_path), sys.executable, secret)
    save_tiny_llama(plan["model"], seed=0)  # the folder SGLang serves (its name is the model name it passes)
    note_loading(plan["model"])  # as SGLang's scheduler process (started after it was written) loads it
    extra = json.loads(option(plan["servers"][0], "--hicache-storage-backend-extra-config"))
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name=plan["model"], extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, mem_pool_host=None)
    assert type(backend) is KVPoolStorage
    assert backend.config["backend"] == "node" and backend.config["run_dir"] == plan["run_dir"]
    assert backend.tenant == "default"
    assert extra["interface_v1"] == 1  # SGLang moves pages with the zero-copy calls
    # the credential the server gets is the pool's (the secret `kvpool up` reads from the file)
    assert Authority(secret).verify(extra["tenants"][0]["credential"]).tenant == "default"


def test_without_a_gpu_the_check_says_so_and_exits_2(tmp_path):
    bare = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.path.dirname(sys.executable)}"}  # no nvidia-smi
    r = check("sglang", env=bare)
    assert r.returncode == 2, r.stderr
    assert "no NVIDIA GPU here" in r.stderr and "--dry-run" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""

    # a machine that shows a GPU but whose interpreter has no CUDA SGLang (this one): a sentence, not a trace
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    r = check("sglang", "--python", sys.executable, env=bare)
    assert r.returncode == 2, r.stderr
    assert "SGLang GPU check not run:" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""
    assert "sees no CUDA GPU" in r.stderr or "no `ray` next to" in r.stderr, r.stderr

    r = check()
    assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr


def test_the_verdict_needs_the_same_answer_and_a_storage_hit():
    from kvpool.connectors.bench.gpu_check_sglang import PAGE, verdict

    same = {"cold_tokens": [5, 6], "warm_tokens": [5, 6]}
    assert verdict({**same, "warm_cached_tokens": 960, "warm_storage_tokens": 960}) == (True, [])
    # no storage breakdown from SGLang: the restarted server's cached tokens can only come from storage
    assert verdict({**same, "warm_cached_tokens": 960, "warm_storage_tokens": None})[0]
    ok, problems = verdict({**same, "warm_cached_tokens": 960, "warm_storage_tokens": PAGE - 1})
    assert not ok and "no storage hit" in problems[0]
    ok, problems = verdict({"cold_tokens": [5, 6], "warm_tokens": [5, 7], "warm_storage_tokens": 960})
    assert not ok and "not the cold one" in problems[0]
    assert not verdict({"cold_tokens": [], "warm_tokens": [], "warm_storage_tokens": 960})[0]  # no answer at all


def test_kvpool_connect_sglang_builds_kvpools_backend_through_sglangs_factory(tmp_path):
    """What `kvpool connect sglang` prints (docs/engines.md) is an extra config SGLang's own factory
    turns into kvpool's backend, with the tenant's credential from the file `kvpool connect` wrote (no pool
    up yet: --degraded)."""
    from kvpool.auth import Authority
    from kvpool.connectors.sglang import KVPoolStorage

    secret = "s" * 64
    (tmp_path / "secret").write_text(secret)
    (tmp_path / "secret").chmod(0o600)  # a secret others can read is refused
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_SECRET")} | {"HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "connect", "sglang", "--secret-file",
                        str(tmp_path / "secret"), "--chunk-tokens", "64", "--degraded"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    extra = json.loads(r.stdout)
    model = save_tiny_llama(tmp_path / "model", seed=0)
    note_loading(str(model))  # as SGLang's scheduler process (started after it was written) loads it
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name=str(model), extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, mem_pool_host=None)
    assert type(backend) is KVPoolStorage and backend.config["backend"] == "node"
    assert backend.tenant == "default"
    assert extra["degraded"] is True and "credentials_file" not in extra  # the default file, which it finds
    creds = json.loads((tmp_path / ".kvpool" / "credentials.json").read_text())
    assert Authority(secret).verify(creds["default"]).tenant == "default"
