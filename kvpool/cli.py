"""The ``kvpool`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvpool.auth_cli import add_auth_parser
from kvpool.bench.cli import add_bench_parser
from kvpool.cli_up import RAY_ADDRESS_HELP, add_up_parser
from kvpool.connect_cli import add_connect_parser
from kvpool.errors import BadRequest, KvPoolError
from kvpool.jsonout import emit, json_stdout
from kvpool.route_cli import add_route_parser
from kvpool.sizing import parse_size
from kvpool.stats_cli import add_stats_parser


def _demo(args: argparse.Namespace) -> int:
    from kvpool.connectors.demo import run as demo

    result = demo.run(args.model, args.tenants, args.conversations, args.turns, max_new_tokens=args.max_new_tokens,
                      progress=not args.json, backend=args.backend, ray_address=args.ray_address, redis=args.redis)
    emit(result) if args.json else print(demo.format_report(result))
    return 0 if result["ok"] else 1  # an answer that changed with the pool fails the demo


def _sim(args: argparse.Namespace) -> int:
    from kvpool.sim import run

    source, reqs = run.load(args.trace, args.workload, args.requests, args.seed, args.merge_blocks)
    if args.instances:  # routing policies over clusters of engine instances
        from kvpool.sim import routes as shown

        rows = shown.run(reqs, source, shown.parse_instances(args.instances), per_node=args.per_node,
                         gpu_blocks=args.gpu_blocks, node_blocks=args.node_blocks, utilization=args.utilization,
                         progress=not args.json)
    elif args.explain:
        from kvpool.sim import gap as shown

        policies, caps = run.parse_policies(args.policy), run.parse_capacities(args.capacity)
        if len(policies) != 1:
            raise BadRequest("--explain compares one policy with Belady: give --policy NAME (e.g. default)")
        rows = [row for cap in caps for row in shown.explain(reqs, policies[0], cap)]
    else:
        shown = run
        rows = run.simulate(reqs, source, run.parse_policies(args.policy), run.parse_capacities(args.capacity),
                            progress=not args.json, with_belady=not args.no_belady, params=run.parse_params(args.param))
    if args.plot:
        shown.plot(rows, args.plot)
    emit(rows) if args.json else print(shown.format_table(rows))
    if args.plot and not args.json:
        print(f"plot: {args.plot}")
    return 0


def _index_from(args: argparse.Namespace):

    from kvpool.errors import BadRequest
    from kvpool.index import open_index

    url = args.redis or os.environ.get("KVPOOL_REDIS_URL")
    if not url:
        raise BadRequest("tenants live in the pool's index: pass --redis URL (or set KVPOOL_REDIS_URL); "
                         "the embedded index exists only inside a running pool process")
    return open_index(url)


_OPERATOR_FIX = "issue one with `kvpool auth issue NAME --role operator` and pass it (--credential or $KVPOOL_CREDENTIAL)"


def _operator(args: argparse.Namespace) -> None:
    """``kvpool tenants`` acts only for an operator, on every backend: the credential presented
    (--credential, $KVPOOL_CREDENTIAL, else the pool's own from the pool secret) is verified with
    the pool secret (found as kvpool.auth_cli.find_secret) before the index is touched."""
    from kvpool import auth
    from kvpool.auth_cli import find_secret
    from kvpool.errors import Forbidden, Unauthorized

    what = f"kvpool tenants {args.action}"
    try:
        secret, _ = find_secret(args.secret_file)
    except BadRequest as e:
        raise Unauthorized(f"{what} needs an operator credential, verified with the pool secret, and found {e.message}; "
                           "run it where the pool secret is (the operator's machine, the chart's Job) with an operator "
                           "credential (`kvpool auth issue NAME --role operator`) or none (the pool's own is used)") from None
    authority = auth.Authority(secret)
    credential = args.credential or os.environ.get(auth.CREDENTIAL_ENV) or authority.pool_credential()
    try:
        authority.require(credential, what)
    except Forbidden as e:
        raise Forbidden(f"{e.message}: {_OPERATOR_FIX}") from None
    except Unauthorized as e:
        raise Unauthorized(f"{what}: {e.message}; it needs an operator credential of this pool: {_OPERATOR_FIX}") from None


def _tenants(args: argparse.Namespace) -> int:
    from kvpool.errors import UnknownTenant

    idx = _index_from(args)
    if args.action == "list":
        if args.args:
            raise SystemExit("usage: kvpool tenants list [--json]")
        _operator(args)
        rows = idx.tenants()
        if args.json:
            emit([{"tenant": t.id, "usage": t.usage, "quota": t.quota, "priority": t.priority} for t in rows], indent=None)
        else:
            print(f"{'tenant':<24}{'usage B':>16}{'quota B':>22}{'used':>8}  priority")
            for t in rows:
                print(f"{t.id:<24}{t.usage:>16}{t.quota:>22}{t.usage / t.quota if t.quota else 0:>8.1%}  {t.priority}")
    elif args.action == "usage":
        if len(args.args) != 1:
            raise SystemExit("usage: kvpool tenants usage TENANT")
        _operator(args)
        print(idx.usage(args.args[0]))
    elif args.action == "set-quota":
        if len(args.args) != 2:
            raise SystemExit("usage: kvpool tenants set-quota TENANT BYTES")
        from kvpool.index.base import check_quota
        from kvpool.tenants import UNLIMITED

        tenant, size = args.args[0], parse_size(args.args[1])
        if size > UNLIMITED:  # NOTE: refused, never capped silently
            raise BadRequest(f"quota {args.args[1]} is over the largest one, 2**62 B ({UNLIMITED} B: unlimited)")
        size = check_quota(size)
        _operator(args)
        try:
            idx.set_quota(tenant, size)
        except UnknownTenant as e:  # NOTE: never created here: a typo would make a tenant nobody serves
            e.message = (f"unknown tenant {tenant!r}: register it first: start the pool serving it (`kvpool up "
                         f"--tenant {tenant}`, or the chart's tenants list), then set its quota")
            raise
        print(f"{tenant}: quota {size} B")
    elif args.action == "set-priority":
        if len(args.args) != 2:
            raise SystemExit("usage: kvpool tenants set-priority TENANT low|normal|high")
        _operator(args)
        idx.set_priority(args.args[0], args.args[1])
        print(f"{args.args[0]}: priority {args.args[1]}")
    return 0


def parse_tenant(text: str) -> dict:
    """``id[:quota[:priority]]``, e.g. ``acme:40GiB:high``; quota and priority are optional."""
    parts = text.split(":")
    if not parts[0] or len(parts) > 3:
        raise BadRequest(f"--tenant {text!r}: write id[:quota[:priority]], e.g. acme:40GiB:high")
    out: dict = {"id": parts[0]}
    if len(parts) > 1 and parts[1]:
        out["quota_bytes"] = parse_size(parts[1])
    if len(parts) > 2 and parts[2]:
        out["priority"] = parts[2]
    from kvpool.index.base import check_name
    from kvpool.tenants import Tenant

    check_name("tenant", parts[0])  # the index's rule, stricter than Tenant's
    Tenant(**out)  # quota and priority checked here, before any Ray or Redis is touched
    return out


def _on_ray(address: str | None) -> bool:
    """Whether `kvpool up` places the pool on Ray: a cluster named (--ray-address, "local" for this
    machine's own head, or $RAY_ADDRESS); else it runs as one process here (cluster/solo.py)."""
    return bool(address or os.environ.get("RAY_ADDRESS", "").strip())


def _up(args: argparse.Namespace) -> int:
    from kvpool.cli_up import describe, shard_line, up_store

    store, chunk = up_store(args)  # NOTE: every size is checked before a process starts
    tenants = [parse_tenant(t) for t in args.tenant] or [{"id": "default"}]
    from kvpool.cluster import solo

    if not _on_ray(args.ray_address):
        if args.insecure_ray:
            raise BadRequest("--insecure-ray is for a pool on Ray: add --ray-address (a single-node pool runs no Ray)")
        return _up_single_node(args, store, chunk, tenants)
    if (rec := solo.running()) is not None:
        raise BadRequest(f"a single-node pool runs on this machine (pid {rec['pid']}): its engines would find two "
                         "shards here; stop it with `kvpool down` before starting the pool on Ray")
    from kvpool.cluster import ops

    state = ops.cmd_up(None if args.ray_address == "local" else args.ray_address, args.redis, store, tenants,
                       secret_file=args.secret_file, insecure_ray=args.insecure_ray, insecure_redis=args.insecure_redis)
    print(f"kvpool is up on Ray: {len(state['shards'])} shards, membership version {state['version']}")
    print(f"  pool secret: {state['secret_from']} (issue credentials with `kvpool auth issue TENANT`)")
    print("\n".join(describe(store, chunk, args)))
    for sid, info in sorted(state["shards"].items()):
        print(shard_line(sid, info))
    return 0


def _up_single_node(args: argparse.Namespace, store: dict, chunk: dict | None, tenants: list[dict]) -> int:
    from kvpool.cli_up import describe, shard_line
    from kvpool.cluster import solo

    if args.redis:
        from kvpool.index.redis_acl import check_locked

        check_locked(args.redis, args.insecure_redis)
    t0 = time.monotonic()
    info = solo.start(store, tenants, args.redis, args.secret_file)
    print(f"kvpool is up on this machine: one process (pid {info['pid']}, no Ray), index "
          f"{'in Redis' if args.redis else 'embedded'}, started in {time.monotonic() - t0:.1f} s")
    print(f"  pool secret: {info['secret_from']} (engines: `kvpool connect vllm`)")
    print(f"  log: {info['log']}; stop it with `kvpool down`")
    print("\n".join(describe(store, chunk, args)))
    print(shard_line(info["shard"], {**info, "node_id": solo.socket.gethostname()}))
    return 0


def _down(args: argparse.Namespace) -> int:
    if not args.ray_address:
        from kvpool.cluster import solo

        if (r := solo.stop()) is not None:
            print(f"kvpool is down: stopped the pool's process (pid {r['pid']}"
                  + (", killed after it did not drain in time" if r["killed"] else "")
                  + (f"; it held {r['chunks']} chunks" if r["chunks"] is not None else "") + ")")
            return 0
    ops = _ray_ops(args.ray_address)

    n, stopped = ops.cmd_down(args.ray_address, args.stop_ray, args.secret_file)
    print("\n".join([f"kvpool is down: {n} shards drained", *ops.said_stopped(stopped)]))
    return 0


def _ray_ops(address: str | None):
    """kvpool.cluster.ops (the commands' Ray side); where Ray is not installed, no pool runs on this
    machine and no Ray cluster is named, that is the message (not "Ray is not installed")."""
    try:
        from kvpool.cluster import ops
    except ModuleNotFoundError as e:
        if e.name != "ray" or address or os.environ.get("RAY_ADDRESS", "").strip():
            raise
        from kvpool.errors import Unavailable

        raise Unavailable("no pool is up on this machine: start one with `kvpool up` (or name a Ray cluster's "
                          "with --ray-address)") from None
    return ops


def _warmup(args: argparse.Namespace) -> int:
    from kvpool.connectors import warmup

    r = warmup.run(args.file, args.model, model_id=args.model_id, chunk_tokens=args.chunk_tokens, pool=args.pool,
                   shard=args.shard, run_dir=args.run_dir, ray_address=args.ray_address, pin=not args.no_pin,
                   progress=not args.json)
    emit(r, indent=None) if args.json else print(
          f"warm-up: {r['prefixes']} prefixes, {r['stored_chunks']} chunks stored, {r['pinned_chunks']} pinned"
          + (f", {r['skipped']} shorter than a chunk" if r["skipped"] else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="A distributed KV-cache pool for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the main job on the embedded default")
    d.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                   help="smollm2: SmolLM2-135M-Instruct answering questions about documents (default); "
                   "tiny: a random-weight Llama on random tokens (no weights, seconds)")
    d.add_argument("--tenants", type=int, help="tenants (default 3; smollm2 has 3 at most)")
    d.add_argument("--conversations", type=int, help="conversations per tenant (default 2)")
    d.add_argument("--turns", type=int, help="turns per conversation (default: 2 smollm2, 4 tiny)")
    d.add_argument("--max-new-tokens", type=int, default=48, help="longest greedy answer (smollm2; default 48)")
    d.add_argument("--backend", choices=["ray", "local"], default="ray",
                   help="ray: local Ray with the embedded index (default); local: this process only")
    d.add_argument("--ray-address", help="run on this Ray cluster instead of a local one")
    d.add_argument("--redis", help="keep the index in this Redis (redis://...) instead of the embedded one")
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.set_defaults(func=_demo)

    s = sub.add_parser("sim", help="replay a trace or workload through eviction policies, or (--instances) through "
                       "routing policies over clusters of engine instances")
    s.add_argument("--trace", help="Mooncake-format jsonl (default: ../shared/data/mooncake/conversation_trace.jsonl)")
    s.add_argument("--workload", help="generate one instead: chat, rag, agent, tenants")
    s.add_argument("--capacity", default="1000,4000,16000", help="blocks, comma-separated (default 1000,4000,16000)")
    s.add_argument("--policy", default="all", help="a name, a comma-separated list, 'default' or 'all'")
    s.add_argument("--requests", type=int, help="use only the first N requests (or generate N)")
    s.add_argument("--seed", type=int, default=0, help="seed of a generated workload")
    s.add_argument("--merge-blocks", type=int, default=1, metavar="N", help="replay in chunks of N 512-token blocks "
                   "(2: 1024-token chunks; capacities are then in those chunks)")
    s.add_argument("--no-belady", action="store_true", help="skip the offline optimum")
    s.add_argument("--param", action="append", metavar="NAME=VALUE", help="a parameter of the policies that take it "
                   "(e.g. margin=0 for density); repeatable")
    s.add_argument("--explain", action="store_true", help="break down where --policy (one) loses to Belady: by depth, "
                   "what it held, time since last use, turn, turn gap, reuse count")
    s.add_argument("--json", action="store_true", help="rows as JSON")
    s.add_argument("--plot", metavar="FILE", help="write a PNG of hit rate vs capacity (or TTFT and locality vs instances)")
    s.add_argument("--instances", help="routing: engine instances per cluster, comma-separated (e.g. 8,32,128)")
    s.add_argument("--per-node", type=int, default=4, help="routing: instances a node (default 4)")
    s.add_argument("--gpu-blocks", type=int, default=600, help="routing: 512-token blocks each instance's GPU cache "
                   "holds (default 600)")
    s.add_argument("--node-blocks", type=int, default=8000, help="routing: blocks each node's shard holds (default 8000)")
    s.add_argument("--utilization", type=float, default=0.7, help="routing: the share of the instances' time cold "
                   "prefill would take (the trace's clock is scaled to it; default 0.7)")
    s.set_defaults(func=_sim)

    add_up_parser(sub, _up)
    d2 = sub.add_parser("down", help="drain every shard and stop the pool")
    d2.add_argument("--ray-address", help=RAY_ADDRESS_HELP.format(new=""))
    d2.add_argument("--stop-ray", action="store_true",
                    help="also stop the local Ray head `kvpool up` started (never a Ray someone else started)")
    d2.add_argument("--secret-file", help="the pool secret (default: as for `kvpool up`)")
    d2.set_defaults(func=_down)
    add_stats_parser(sub, RAY_ADDRESS_HELP.format(new=""))

    w = sub.add_parser("warmup", help="preload and pin prefixes (system prompts, tool schemas) before traffic")
    w.add_argument("file", help='JSON lines: {"tenant": "a", "tokens": [...], "shared": false}')
    w.add_argument("--model", default="demo", help="a local transformers model directory, or 'demo'")
    w.add_argument("--model-id", help="the model name engines use (default: the --model value)")
    w.add_argument("--chunk-tokens", type=int, default=64)
    w.add_argument("--pool", default="default", help="the pool's name (default: default)")
    w.add_argument("--shard", help="this node's shard, where one machine runs several (default: $KVPOOL_SHARD)")
    w.add_argument("--run-dir", help="where this node's shard keeps its node files (default: $KVPOOL_RUN_DIR, "
                   "else /dev/shm)")
    w.add_argument("--ray-address", help="run on a pool node of this Ray cluster, as a Ray task (from a machine "
                   "with no shard, e.g. the chart's Job), instead of through this node's shard")
    w.add_argument("--no-pin", action="store_true", help="store the prefixes without pinning them")
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=_warmup)
    t = sub.add_parser("tenants", help="list tenants, their usage, and set quotas and priorities")
    t.add_argument("action", choices=["list", "usage", "set-quota", "set-priority"])
    t.add_argument("args", nargs="*", help="TENANT [BYTES|CLASS]")
    t.add_argument("--redis", help="the index's URL (default: $KVPOOL_REDIS_URL)")
    t.add_argument("--credential", help="an operator credential (default: $KVPOOL_CREDENTIAL, else the pool's own "
                   "from the pool secret)")
    t.add_argument("--secret-file", help="the pool secret the credential is verified with (default: as for `kvpool "
                   "up`: $KVPOOL_SECRET_FILE, $KVPOOL_SECRET, ~/.kvpool/secret)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_tenants)

    add_auth_parser(sub)
    add_connect_parser(sub)
    add_route_parser(sub)
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with json_stdout(bool(getattr(args, "json", False))):  # --json: only JSON on stdout (logs go to stderr)
            return args.func(args)
    except KvPoolError as e:
        print(f"kvpool: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        # NOTE: engines install kvpool without Ray (they reach the pool through their node's shard)
        print("kvpool: this command runs the pool on Ray, which is not installed here: "
              "pip install 'kvpool[cluster]' (make venv installs it)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
