"""The ``kvpool bench`` commands: each benchmark beside its baseline in the same run. Benchmarks
that need Ray or an engine are imported when their command runs."""

from __future__ import annotations

import argparse
import os
import sys

from kvpool.bench.cli_engines import add_engine_benches
from kvpool.errors import BadRequest
from kvpool.jsonout import emit, json_command, show
from kvpool.spec import STORAGE_FORMATS


def _bench_store(args: argparse.Namespace) -> int:
    from kvpool.bench import store

    result = store.run(chunks=args.chunks, trials=args.trials, progress=not args.json, policy_rounds=args.policy_rounds)
    show(args, result, store.format_table)
    return 0


def _bench_slices(args: argparse.Namespace) -> int:
    from kvpool.bench import slices

    tps = tuple(int(t) for t in args.tp.split(",") if t)
    show(args, slices.run(args.chunks, args.rounds, tps, progress=not args.json), slices.format_table)
    return 0


def _bench_concurrency(args: argparse.Namespace) -> int:
    from kvpool.bench import concurrency

    setup = concurrency.Setup(hbm_gib=args.hbm_gib, horizon_s=args.horizon)
    policies = None if args.policy == "all" else args.policy.split(",")
    result = concurrency.run(setup, policies, progress=not args.json)
    show(args, result, concurrency.format_table)
    return 0


def _bench_index(args: argparse.Namespace) -> int:
    from kvpool.bench import index

    if args.keys < 1 or args.reps < 1:
        raise BadRequest("--keys and --reps are at least 1")
    result = index.run(args.redis, prompt_chunks=args.keys, reps=args.reps, progress=not args.json)
    show(args, result, index.format_table)
    return 0


def _bench_peers(args: argparse.Namespace) -> int:
    from kvpool.bench import peers

    names = tuple(p for p in args.peers.split(",") if p)
    unknown = [p for p in names if p not in peers.PEERS]
    if unknown or args.rounds < 1 or args.ops256 < 1 or args.ops32 < 1:
        raise BadRequest(f"--peers: choose from {', '.join(peers.PEERS)}; --rounds, --ops256, --ops32: at least 1")
    kw = dict(rounds=args.rounds, peers=names, ops={"256KiB": args.ops256, "32MiB": args.ops32},
              redis_url=args.redis)
    r = peers.run(**kw, progress=True)
    show(args, r, peers.format_table)
    return 0 if peers.wrong_bytes(r) == 0 else 1


def _bench_datapath(args: argparse.Namespace) -> int:
    if args.rdt:
        from kvpool.cluster.bench import rdt

        emit(rdt.probe_rdt())
        return 0
    from kvpool.cluster.bench import node as bench_node

    if args.rounds < 1 or args.ops256 < 1 or args.ops32 < 1 or args.large_mib < 1 or args.dram_pages < 4:
        raise BadRequest("--rounds, --ops256, --ops32, --large-mib: at least 1; --dram-pages: at least 4")
    peers = bench_node.mooncake_installed() if args.peers is None else args.peers
    if peers and args.large_mib != 32:
        raise BadRequest("--peers measures 32 MiB chunks: leave --large-mib at 32, or add --no-peers")
    kw = dict(rounds=args.rounds, ops={"small": args.ops256, "large": args.ops32}, large_mib=args.large_mib,
              peers=peers, redis_url=args.redis, dram_pages=args.dram_pages, progress=True)
    r = bench_node.run(**kw)
    show(args, r, bench_node.format_table)
    why = bench_node.failures(r)
    for w in why:
        print(f"bench datapath: FAILED: {w}", file=sys.stderr)
    return 1 if why else 0


def _bench_placement(args: argparse.Namespace) -> int:
    from kvpool.cluster.bench import placement

    if args.nodes < 2 or args.capacity < 1:
        raise BadRequest("--nodes: at least 2 (a node is lost mid-trace); --capacity: at least 1 chunk")
    show(args, placement.run(args.trace, nodes=args.nodes, capacity=args.capacity), placement.format_table)
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    from kvpool.cluster.bench import soak

    r = soak.run(seconds=args.seconds, clients=args.clients, nodes=args.nodes, progress=not args.json)
    show(args, r, soak.format_report)
    return 0 if r["wrong_bytes"] == 0 else 1


def _bench_chaos(args: argparse.Namespace) -> int:
    from kvpool.cluster.bench import chaos

    faults = args.faults.split(",") if args.faults else None
    unknown = [f for f in faults or [] if f not in chaos.FAULTS]
    if unknown:
        raise BadRequest(f"--faults: unknown {unknown}; choose from {', '.join(chaos.FAULTS)}")
    kw = dict(faults=faults, runs=args.runs, seconds_per_fault=args.seconds_per_fault, clients=args.clients)
    r = chaos.run(**kw, progress=True)
    show(args, r, chaos.format_table)
    return 0 if r["total"]["wrong_bytes"] == 0 and not r["hung_clients"] else 1


def _bench_kernels(args: argparse.Namespace) -> int:
    from kvpool.bench import kernels

    result = kernels.run(device=args.device, context=args.context, progress=not args.json)
    show(args, result, kernels.format_table)
    return 0


def _bench_capacity(args: argparse.Namespace) -> int:
    from kvpool.bench import capacity

    rows = capacity.run(args.mib, tuple(f for f in args.formats.split(",") if f), args.dtype, progress=not args.json)
    show(args, rows, capacity.format_table)
    return 0


def _bench_auth(args: argparse.Namespace) -> int:
    from kvpool.bench import auth

    result = auth.run(calls=args.calls, progress=not args.json)
    show(args, result, auth.format_table)
    return 0


def _bench_secure(args: argparse.Namespace) -> int:
    from kvpool.cluster.bench import secure

    try:
        result = secure.run(rounds=args.rounds, steps=args.steps, index=args.index, control=args.control,
                            progress=not args.json)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    show(args, result, secure.format_table)
    for w in secure.failures(result):
        print(f"bench secure: FAILED: {w}", file=sys.stderr)
    return 1 if secure.failures(result) else 0


def add_bench_parser(sub) -> None:
    """Adds ``kvpool bench ...`` to the CLI's subcommands."""
    b = sub.add_parser("bench", help="benchmarks, each beside its baseline in the same run")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser("store", help="key hashing and chunk-store put/get vs a plain copy")
    bs.add_argument("--chunks", type=int, default=8, help="chunks per trial (32 MiB each)")
    bs.add_argument("--trials", type=int, default=7)
    bs.add_argument("--policy-rounds", type=int, default=3, help="rounds of the eviction policies' cost per access "
                    "vs LRU (0: skip)")
    bs.set_defaults(func=_bench_store)
    bl = bsub.add_parser("slices", help="a TP rank's load from per-head slices vs per-rank slices, side by side")
    for flag, kw in (("--chunks", dict(type=int, default=8, help="chunks per load (8 MiB each)")),
                     ("--rounds", dict(type=int, default=7)), ("--tp", dict(default="1,2,8", help="TP sizes of 1,2,4,8"))):
        bl.add_argument(flag, **kw)
    bl.set_defaults(func=_bench_slices)
    bc = bsub.add_parser("concurrency", help="most concurrent sessions each eviction strategy sustains")
    bc.add_argument("--hbm-gib", type=float, default=16.0, help="GPU memory for KV (default 16)")
    bc.add_argument("--horizon", type=float, default=600.0, help="simulated seconds per trial (default 600)")
    bc.add_argument("--policy", default="all")
    bc.set_defaults(func=_bench_concurrency)
    bi = bsub.add_parser("index", help="prefix lookup latency and publish throughput vs a plain MGET")
    bi.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    bi.add_argument("--keys", type=int, default=512, help="keys a lookup (512: a 128K prompt's chunks; 4096: its "
                    "slices, 8 KV heads)")
    bi.add_argument("--reps", type=int, default=2000)
    bi.set_defaults(func=_bench_index)
    bd = bsub.add_parser("datapath", help="the data path as engines use it (their node's shard, without Ray) vs "
                         "Mooncake Store, Redis and memcpy in the same run")
    bd.add_argument("--rounds", type=int, default=3, help="the output gives the range over rounds")
    bd.add_argument("--ops256", type=int, default=200, help="operations per round on 256 KiB chunks (default 200)")
    bd.add_argument("--ops32", type=int, default=8, help="operations per round on the large chunks (default 8)")
    bd.add_argument("--large-mib", type=int, default=32, help="size of the large chunks in MiB (default 32)")
    bd.add_argument("--dram-pages", type=int, default=32, help="pages of each node's slab (default 32)")
    bd.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                    help="also Mooncake Store and Redis, round for round (default: when mooncake is installed)")
    bd.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the Redis peer (else a redis-server of "
                    "its own); the pool's index is always a redis-server of the run's own")
    bd.add_argument("--rdt", action="store_true", help="probe Ray's direct tensor transport against the object store")
    bd.set_defaults(func=_bench_datapath)
    bp = bsub.add_parser("peers", help="put, same-node and cross-process get on Mooncake Store and Redis vs memcpy")
    bp.add_argument("--peers", default="mooncake,redis", help="comma-separated (default mooncake,redis)")
    bp.add_argument("--rounds", type=int, default=3, help="the output gives the range over rounds")
    bp.add_argument("--ops256", type=int, default=200, help="operations per round on 256 KiB chunks (default 200)")
    bp.add_argument("--ops32", type=int, default=8, help="operations per round on 32 MiB chunks (default 8)")
    bp.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="else a redis-server of its own")
    bp.set_defaults(func=_bench_peers)
    bk = bsub.add_parser("kernels", help="paged gather/scatter vs a plain copy, quantization, scoring at 32K")
    bk.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    bk.add_argument("--context", type=int, default=32768)
    bk.set_defaults(func=_bench_kernels)
    bf = bsub.add_parser("capacity", help="chunks of SmolLM2 one pool holds in each storage format (raw, fp8, int8, "
                         "int4/int2 KIVI)")
    bf.add_argument("--mib", type=int, default=1024, help="the pool's size in MiB (default 1024)")
    bf.add_argument("--formats", default=",".join(STORAGE_FORMATS), help="comma-separated (default: all)")
    bf.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="the raw KV's dtype (default float32, as kvpool.connectors.demo.smollm2 loads the model)")
    bf.set_defaults(func=_bench_capacity)
    bpl = bsub.add_parser("placement", help="where new chunks go: locality + spill vs the hash ring, on a trace")
    bpl.add_argument("--trace", default=os.path.join("..", "shared", "data", "mooncake", "conversation_trace.jsonl"),
                     help="a Mooncake-format trace (default: the published conversation trace, ../shared/data)")
    bpl.add_argument("--nodes", type=int, default=4)
    bpl.add_argument("--capacity", type=int, default=4096, help="chunks each node holds (default 4096)")
    bpl.set_defaults(func=_bench_placement)
    bs = bsub.add_parser("soak", help="concurrent clients on a local multi-node pool: throughput, p99, errors, RSS")
    bs.add_argument("--seconds", type=float, default=600.0, help="measured time after warm-up (default 600)")
    bs.add_argument("--clients", type=int, default=4)
    bs.add_argument("--nodes", type=int, default=2)
    bs.set_defaults(func=_bench_soak)
    bx = bsub.add_parser("chaos", help="faults one at a time on a local 3-node pool under verifying load")
    bx.add_argument("--faults", default="", help="comma-separated, default all: shard-kill, local-shard-kill, "
                    "node-kill, redis-stop, redis-restart, controller-restart, fill, members-change")
    bx.add_argument("--runs", type=int, default=1, help="times the schedule of faults runs")
    bx.add_argument("--seconds-per-fault", type=float, default=10.0, help="quiet period after each fault")
    bx.add_argument("--clients", type=int, default=3, help="verifying client processes")
    bx.set_defaults(func=_bench_chaos)
    ba = bsub.add_parser("auth", help="the credential check on lookup, get and put vs the same calls without it")
    ba.add_argument("--calls", type=int, default=400, help="calls per figure (a quarter for 32 MiB chunks)")
    ba.set_defaults(func=_bench_auth)
    bs = bsub.add_parser("secure", help="a pool locked by default (Ray token, pool secret) vs an open one, side by "
                         "side: put, same-node get and lookups through the node's shard")
    bs.add_argument("--rounds", type=int, default=3)
    bs.add_argument("--steps", type=int, default=300, help="operations of each kind per round and pool")
    bs.add_argument("--index", choices=["actor", "redis"], default="actor",
                    help="the pools' index: their own Ray actor (kvpool up's default) or a redis-server each "
                    "(the secured one with kvpool's ACL users, as kvpool up --redis)")
    bs.add_argument("--control", action="store_true", help="both pools open: the harness's own noise between "
                    "two equal pools")
    bs.set_defaults(func=_bench_secure)
    add_engine_benches(bsub)
    for p in bsub.choices.values():  # --json prints only JSON on stdout: engines, Ray, native code log to stderr
        p.add_argument("--json", action="store_true", help="the result as JSON on stdout")
        p.set_defaults(func=json_command(p.get_default("func")))
