"""``kvpool stats``: the pool's shards, its engines (one line each, their tenants beneath) and its
health, asked of this node's shard on its socket (else through Ray); ``--forget NAME`` clears an
engine that went silent (its process killed) before its expiry."""

from __future__ import annotations

import argparse
import os
import time

from kvpool.jsonout import emit

FORGET_WAIT_S = 10.0  # a Ray pool's controller hears the goodbye through the shard, asynchronously


def _stats(args: argparse.Namespace) -> int:
    from kvpool.cli import _ray_ops
    from kvpool.cluster.stats_view import format_stats

    if args.forget:
        return _forget(args)
    st = None if args.ray_address else _stats_here()
    if st is None:
        ops = _ray_ops(args.ray_address)

        st = ops.cmd_stats(None if args.ray_address == "local" else args.ray_address)
    emit(st, default=str) if args.json else print(format_stats(st))
    if not st["healthy"]:
        return 1  # NOTE: monitors and readiness probes read the exit code
    return 0


def _stats_here() -> dict | None:
    """The pool's stats from this node's shard, on its socket (no Ray: well under a second); None
    when no shard of the pool runs here."""
    from kvpool.errors import Unavailable
    from kvpool.node.client import NodeClient
    from kvpool.node.paths import node_files, run_dir

    if not node_files(run_dir(), "default"):
        return None
    client = NodeClient(timeout_s=10.0)
    try:
        return client.shard_stats(pool=True)
    except Unavailable:
        return None
    finally:
        client.close()


def _forget(args: argparse.Namespace) -> int:
    """Says goodbye for a listed engine, with a credential of the tenant it reports as: the one
    given (--credential, $KVPOOL_CREDENTIAL), else one issued from the pool secret (an operator's
    machine), else, on an open pool, the tenant's id."""
    from kvpool.auth import CREDENTIAL_ENV, Authority
    from kvpool.auth_cli import find_secret
    from kvpool.errors import BadRequest, Forbidden, Unavailable
    from kvpool.node import messages as m
    from kvpool.node.client import NodeClient

    listed = args.forget
    client = NodeClient(timeout_s=10.0)
    try:
        try:
            engines = client.shard_stats(pool=True)["engines"]
        except Unavailable as e:
            raise Unavailable(f"{e.message}; --forget asks this node's shard: run it on a node of the pool") from None
        if listed not in engines:
            raise BadRequest(f"no engine {listed!r} is listed: name one as `kvpool stats` lists it "
                             f"({', '.join(map(repr, sorted(engines)[:8])) or 'none is listed'})")
        tenant = engines[listed].get("tenant") or "default"
        name = listed[: -len(f" [{tenant}]")] if listed.endswith(f" [{tenant}]") else listed  # kept apart by tenant
        credential = args.credential or os.environ.get(CREDENTIAL_ENV) or (
            Authority(find_secret(args.secret_file)[0]).issue(tenant) if client.secured else tenant)
        client.call(m.Report(credential, name, {"goodbye": True}))
        deadline = time.monotonic() + FORGET_WAIT_S
        while listed in client.shard_stats(pool=True)["engines"]:
            if time.monotonic() > deadline:
                raise Forbidden(f"engine {listed!r} is still listed: it reports as tenant {tenant!r}, and only a "
                                f"credential of {tenant!r} clears it (pass none where the pool secret is: one is "
                                "issued from it)")
            time.sleep(0.2)
    finally:
        client.close()
    print(f"kvpool: engine {listed!r} forgotten (it is listed again if it reports again)")
    return 0


def add_stats_parser(sub, ray_address_help: str) -> None:
    st = sub.add_parser("stats", help="per shard and tier: chunks, bytes, hit rate, evictions, tenants; per engine "
                        "its counts and its tenants'")
    st.add_argument("--ray-address", help=ray_address_help)
    st.add_argument("--json", action="store_true")
    st.add_argument("--forget", metavar="NAME", help="clear an engine listed as SILENT (its process gone) now, not "
                    "after its expiry")
    st.add_argument("--credential", help="with --forget: a credential of the tenant the engine reports as (default: "
                    "$KVPOOL_CREDENTIAL, else one issued from the pool secret)")
    st.add_argument("--secret-file", help="with --forget: the pool secret (default: as for `kvpool up`)")
    st.set_defaults(func=_stats)
