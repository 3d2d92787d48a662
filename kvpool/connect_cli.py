"""``kvpool connect ENGINE``: checks that the pool on this node takes the engine's tenants, writes
their credentials, and prints the connector config the engine's command line takes:

    kvpool connect vllm
    vllm serve MODEL ... --kv-transfer-config '{"kv_connector":"KVPoolConnector","kv_connector_module_path":"kvpool.connectors.vllm","kv_role":"kv_both"}'

The config is the same every time (nothing in it but the engine's settings: no credential, no
address; with other tenants than ``default``, ``"kv_connector_extra_config":{"tenants":[...]}``),
so it can be written into the engine's command line once, as a literal; the connector finds its
pool and credentials itself, and stops the engine at start, naming the fix, when it cannot use
them (kvpool.connectors.pool_start).

The engine reaches the pool through its node's shard (connector backend ``"node"``: the engine never
joins Ray). Its tenants' credentials are issued here from the pool secret (found as ``kvpool up``
finds it) and added to ``~/.kvpool/credentials.json`` (mode 0600), where the connector looks for
them (``--credentials-file``: another file, which the config then names), so no credential appears
on the engine's command line (which every local user can read in ``ps``).
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
    """Adds ``{tenant: credential}`` to the credentials file at ``path`` (mode 0600) and returns its
    absolute path. The file is never rewritten in place: a new file takes its name atomically
    (tmp + rename; an engine reading it sees the old one or the new one whole), it keeps every
    other tenant it held (an engine that runs on them, or restarts on them later, keeps its
    tenants), and concurrent connects take turns (a lock on its folder). A tenant's credential is
    the same every time the same pool secret issues it, so nothing new writes nothing.

    A file this cannot keep whole is refused (400), nothing written: one others can read (naming
    the ``chmod 600`` that fixes it, as an engine refuses it), one it cannot read, and one that is
    no JSON object of tenant -> credential."""
    import fcntl

    from kvpool.auth_cli import write_private

    full = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(os.path.dirname(full), mode=0o700, exist_ok=True)
        lock = os.open(os.path.dirname(full), os.O_RDONLY)  # its folder: no lock file left beside it
    except OSError as e:
        raise BadRequest(f"cannot write the engine's credentials to {full} ({e.strerror}): pass --credentials-file "
                         "with a path you can write") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = _held_credentials(full)
        if all(held.get(t) == c for t, c in credentials.items()):
            return full  # nothing new: not rewritten
        return write_private(full, json.dumps({**held, **credentials}), "the engine's credentials",
                             "--credentials-file")
    finally:
        os.close(lock)  # and with it the lock


def _held_credentials(full: str) -> dict:
    """Every entry of the credentials file at ``full`` ({} when there is none yet), or a 400 naming
    the fix when it cannot be kept whole: a new file of the new tenants alone would drop the others."""
    from kvpool.private import read_private

    try:
        text = read_private(full, "the engine's credentials")
    except FileNotFoundError:
        return {}
    except BadRequest as e:  # others can read it: engines refuse it too, and its tenants stay in it
        raise BadRequest(f"{e.message}; nothing was written (its tenants are kept as they are)") from None
    except OSError as e:
        raise BadRequest(f"cannot read the engine's credentials {full} ({e.strerror}): nothing was written; fix its "
                         "access, or pass --credentials-file with another path") from None
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise BadRequest(f"the engine's credentials {full} is not a JSON object of tenant -> credential: nothing was "
                         "written; fix it or move it away (`kvpool connect` writes it anew)")
    return data


def pool_config(engine: str, tenants: list[str], chunk_tokens: int, credentials_file: str, pool: str = "default",
                storage_format: str | None = None, degraded: bool = False, run_dir: str | None = None) -> dict:
    """The connector's pool config (kvpool.connectors.pools) for an engine on a node of the pool:
    only what differs from the connector's defaults (vLLM's: backend "node", tenant ``default``,
    the credentials in ~/.kvpool/credentials.json, the shard found in the run dir), so the usual
    config is the short one a user writes once."""
    cfg: dict = {} if engine == "vllm" else {"backend": "node"}
    if list(tenants) != ["default"] or engine != "vllm":
        cfg["tenants"] = list(tenants)
    if pool != "default":
        cfg["pool"] = pool
    if chunk_tokens != 256:
        cfg["chunk_tokens"] = chunk_tokens
    if os.path.abspath(os.path.expanduser(credentials_file)) != os.path.abspath(os.path.expanduser(DEFAULT_CREDENTIALS)):
        cfg["credentials_file"] = credentials_file
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
    prefill instance's ``producer`` / the decode instance's ``consumer``; the connector makes
    vLLM recompute what the pool cannot return, so ``kv_load_failure_policy`` need not be said),
    SGLang's ``--hicache-storage-backend-extra-config``."""
    if role not in KV_ROLES:
        raise BadRequest(f"--role {role!r}: one of {', '.join(KV_ROLES)}")
    if engine == "vllm":
        out = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
               "kv_role": KV_ROLES[role]}
        return {**out, "kv_connector_extra_config": cfg} if cfg else out
    if role != "both":
        raise BadRequest(f"--role {role}: prefill/decode roles are vLLM's (kv_role); SGLang's backend saves and loads")
    if engine == "sglang":
        return {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang", "class_name": "KVPoolStorage",
                **cfg}
    raise BadRequest(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")


def check_with_pool(args: argparse.Namespace, tenants: list[str]) -> auth.Authority:
    """The pool secret's authority, once the node's shard checked each tenant's credential issued
    from it (one call a tenant): a pool that is not up here, a pool secret that is not the pool's
    and a tenant the pool does not serve are errors naming the fix, before anything is written."""
    from kvpool.errors import Unauthorized, Unavailable, UnknownTenant
    from kvpool.node.client import NodeClient
    from kvpool.node.probe import why_down

    client = NodeClient(pool=args.pool, directory=args.run_dir, timeout_s=5.0)
    try:
        # NOTE: the pool first: before `kvpool up` there is no pool secret either, and the fix is
        # the pool, not a new secret
        why = None if args.degraded else why_down(client)
        if why is not None:
            raise Unavailable(f"no pool is up on this node ({why}): start it with `kvpool up`; or pass --degraded to "
                              "let the engine start without it (recomputing every prompt until it answers)")
        authority, where = _authority(args.secret_file)
        if args.degraded:
            return authority
        for t in tenants:
            try:
                said = client.check(authority.issue(t))
            except Unauthorized:
                raise Unauthorized(f"the pool on this node does not take credentials issued from the pool secret in "
                                   f"{where}: pass the pool's own (--secret-file, as given to `kvpool up`)") from None
            if not said.get("served"):
                e = UnknownTenant(t)
                e.message = (f"tenant {t!r} is not one of the pool's tenants {said.get('tenants', [])}: start the pool "
                             f"serving it (`kvpool down`, then `kvpool up ... --tenant {t}` with the others), or "
                             "connect the engine as a tenant the pool serves (--tenant NAME)")
                raise e
    finally:
        client.close()
    return authority


def _authority(secret_file: str | None) -> tuple[auth.Authority, str]:
    from kvpool.auth_cli import find_secret

    try:
        secret, where = find_secret(secret_file)  # the pool's: `kvpool up` made or found it
    except BadRequest as e:
        raise BadRequest(f"the pool secret is not here ({e.message.split(':')[0]}): `kvpool connect` issues the "
                         "engine's credentials from the secret `kvpool up` used: pass its --secret-file") from None
    return auth.Authority(secret), where


def _connect(args: argparse.Namespace) -> int:
    import sys

    from kvpool.index.base import check_name

    tenants = args.tenant or ["default"]
    for t in tenants:
        check_name("tenant", t)
    if args.chunk_tokens < 1:
        raise BadRequest(f"--chunk-tokens {args.chunk_tokens}: at least 1 (vLLM: a multiple of its --block-size; "
                         "SGLang: its --page-size)")
    if args.degraded:
        print("kvpool: --degraded: the pool is not asked now; the engine starts even while it does not answer",
              file=sys.stderr)
    authority = check_with_pool(args, tenants)
    path = write_credentials(args.credentials_file, {t: authority.issue(t) for t in tenants})
    cfg = pool_config(args.engine, tenants, args.chunk_tokens, path, pool=args.pool, storage_format=args.storage_format,
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
