"""The ``kvpool`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from kvpool.errors import KvPoolError


def _demo(args: argparse.Namespace) -> int:
    from kvpool import demo

    result = demo.run(tenants=args.tenants, conversations=args.conversations, turns=args.turns,
                      progress=not args.json)
    print(json.dumps(result, indent=2) if args.json else demo.format_report(result))
    return 0


def _bench_store(args: argparse.Namespace) -> int:
    from kvpool.bench import store

    result = store.run(chunks=args.chunks, trials=args.trials, progress=not args.json)
    print(json.dumps(result, indent=2) if args.json else store.format_table(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="A distributed KV-cache pool for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the main job on the embedded default")
    d.add_argument("--tenants", type=int, default=3)
    d.add_argument("--conversations", type=int, default=2, help="conversations per tenant")
    d.add_argument("--turns", type=int, default=4)
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.set_defaults(func=_demo)

    b = sub.add_parser("bench", help="benchmarks, each beside its baseline in the same run")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser("store", help="key hashing and chunk-store put/get vs a plain copy")
    bs.add_argument("--chunks", type=int, default=8, help="chunks per trial (32 MiB each)")
    bs.add_argument("--trials", type=int, default=7)
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(func=_bench_store)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvPoolError as e:
        print(f"kvpool: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
