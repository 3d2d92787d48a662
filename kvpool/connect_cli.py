"""``kvpool connect ENGINE``: the exact connector config an engine on this machine needs to use the
pool `kvpool up` started, printed for the engine's own command line.

    vllm serve MODEL ... --kv-transfer-config "$(kvpool connect vllm)"
    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config "$(kvpool connect sglang)"

The engine reaches the pool through its node's shard (connector backend ``"node"``: the engine never
joins Ray). Its tenants' credentials are issued here from the pool secret (found as ``kvpool up``
finds it) and written to a credentials file (mode 0600) that the config names, so no credential
appears on the engine's command line (which every local user can read in ``ps``).
"""

from __future__ import annotations

import argparse
import json
import os

from kvpool import auth
from kvpool.errors import BadRequest

DEFAULT_CREDENTIALS = os.path.join("~", ".kvpool", "credentials.json")
ENGINES = ("vllm", "sglang")


def write_credentials(path: str, credentials: dict[str, str]) -> str:
    """Writes ``{tenant: credential}`` to ``path`` (mode 0600, atomically); its absolute path."""
    from kvpool.auth_cli import write_private

    return write_private(path, json.dumps(credentials), "the engine's credentials", "--credentials-file")


def pool_config(tenants: list[str], chunk_tokens: int, credentials_file: str, pool: str = "default",
                storage_format: str | None = None, degraded: bool = False, run_dir: str | None = None) -> dict:
    """The connector's pool config (kvpool.connectors.pools) for an engine on a node of the pool."""
    cfg: dict = {"backend": "node", "pool": pool, "tenants": list(tenants), "chunk_tokens": chunk_tokens,
                 "credentials_file": credentials_file}
    if storage_format and storage_format != "raw":
        cfg["storage_format"] = storage_format
    if degraded:
        cfg["degraded"] = True
    if run_dir:
        cfg["run_dir"] = run_dir
    return cfg


KV_ROLES = {"both": "kv_both", "producer": "kv_producer", "consumer": "kv_consumer"}


def engine_config(engine: str, cfg: dict, role: str = "both") -> dict:
    """What the engine's own flag takes: vLLM's ``--kv-transfer-config`` (``role``: both, or the
    prefill instance's ``producer`` / the decode instance's ``consumer``), SGLang's
    ``--hicache-storage-backend-extra-config``."""
    if role not in KV_ROLES:
        raise BadRequest(f"--role {role!r}: one of {', '.join(KV_ROLES)}")
    if engine == "vllm":
        return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
                "kv_role": KV_ROLES[role], "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}
    if role != "both":
        raise BadRequest(f"--role {role}: prefill/decode roles are vLLM's (kv_role); SGLang's backend saves and loads")
    if engine == "sglang":
        return {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang", "class_name": "KVPoolStorage",
                **cfg}
    raise BadRequest(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")


def _connect(args: argparse.Namespace) -> int:
    from kvpool.auth_cli import find_secret
    from kvpool.index.base import check_name

    tenants = args.tenant or ["default"]
    for t in tenants:
        check_name("tenant", t)
    if args.chunk_tokens < 1:
        raise BadRequest(f"--chunk-tokens {args.chunk_tokens}: at least 1 (vLLM: a multiple of its --block-size; "
                         "SGLang: its --page-size)")
    secret, _ = find_secret(args.secret_file)  # the pool's: `kvpool up` made or found it
    authority = auth.Authority(secret)
    path = write_credentials(args.credentials_file, {t: authority.issue(t) for t in tenants})
    cfg = pool_config(tenants, args.chunk_tokens, path, pool=args.pool, storage_format=args.storage_format,
                      degraded=args.degraded, run_dir=args.run_dir)
    print(json.dumps(engine_config(args.engine, cfg, args.role), separators=(",", ":")))
    return 0


def add_connect_parser(sub) -> None:
    c = sub.add_parser("connect", help="print the connector config an engine on this node uses to reach the pool")
    c.add_argument("engine", choices=ENGINES, help="vllm: for --kv-transfer-config; sglang: for "
                   "--hicache-storage-backend-extra-config")
    c.add_argument("--tenant", action="append", default=[],
                   help="a tenant the engine serves (repeat; default: default); the first serves requests "
                   "that name none")
    c.add_argument("--chunk-tokens", type=int, default=256,
                   help="tokens per chunk (default 256; the same in every engine that shares chunks)")
    c.add_argument("--pool", default="default", help="the pool's name (default: default)")
    c.add_argument("--storage-format", default=None,
                   help="raw (default, exact) or a LOSSY opt-in format: fp8, int8, int4-kivi, int2-kivi")
    c.add_argument("--degraded", action="store_true",
                   help="let the engine start while the pool is unreachable (it recomputes, and says so) "
                   "instead of failing at start")
    c.add_argument("--run-dir", help="where the node's shard announces itself (default: $KVPOOL_RUN_DIR, else "
                   "/dev/shm)")
    c.add_argument("--role", choices=list(KV_ROLES), default="both",
                   help="vllm: both (default: loads and saves), producer (a prefill instance: saves, never loads) or "
                   "consumer (a decode instance: loads, never saves)")
    c.add_argument("--credentials-file", default=DEFAULT_CREDENTIALS,
                   help=f"where the tenants' credentials are written, mode 0600 (default {DEFAULT_CREDENTIALS})")
    c.add_argument("--secret-file", help="the pool secret (default: as for `kvpool up`)")
    c.set_defaults(func=_connect)
