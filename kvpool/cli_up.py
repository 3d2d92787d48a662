"""`kvpool up`: its arguments, and how its pages and tiers are sized (kvpool.sizing)."""

from __future__ import annotations

import argparse
import sys

from kvpool.errors import BadRequest
from kvpool.policies import DEFAULT_POLICY, describe_policies
from kvpool.sizing import DEFAULT_DRAM, DEFAULT_PAGE, MAX_SHARE_PERCENT, MIN_PAGES, mib, parse_size, parse_tier
from kvpool.spec import DTYPE_BYTES, STORAGE_FORMATS

RAY_ADDRESS_HELP = ("the pool's Ray cluster ('local': the Ray head `kvpool up --ray-address local` started on this "
                    "machine{new}; default: this machine's pool, then $RAY_ADDRESS when set, then that local head; "
                    "never another Ray that merely runs here)")
UP_RAY_HELP = ("run the pool on this Ray cluster, a shard on every node ('local': the Ray head an earlier `kvpool up "
               "--ray-address local` started on this machine if it still answers, else a new one on 127.0.0.1); "
               "default: $RAY_ADDRESS when set, else a single-node pool: one process on this machine, no Ray")


def add_up_parser(sub, func) -> None:
    u = sub.add_parser("up", help="start the pool: one process on this machine, or a shard on every node of a Ray "
                       "cluster (--ray-address)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=(
                           "Pages hold one stored chunk each: --model sizes them to the model's chunk (else\n"
                           f"pages are {DEFAULT_PAGE}, or --page-size). Tiers: --dram / --disk in bytes (64GiB) or "
                           "as a\nshare (25%, in (0, "
                           f"{MAX_SHARE_PERCENT}]%) of each node's memory (its cgroup's limit when lower) or of\n"
                           "the disk tier's filesystem, resolved by each shard on its own node; at least "
                           f"{MIN_PAGES} pages\na tier. A shard's DRAM slab is committed when the shard starts (a "
                           "/dev/shm file,\nreserved and populated), so the default DRAM tier is a fixed "
                           f"{DEFAULT_DRAM}, not a\nshare of memory: give a serving node more, e.g. --dram 25%."))
    u.add_argument("--ray-address", help=UP_RAY_HELP)
    u.add_argument("--insecure-ray", action="store_true",
                   help="with --ray-address: run Ray WITHOUT its token authentication (default: on; without it any process that reaches "
                   "Ray's ports, any local user, can act as the pool)")
    u.add_argument("--redis", help="the index's Redis URL (default: the embedded index, in the pool's process or a Ray "
                   "actor); a Redis that "
                   "anyone may write without a password is refused (see --insecure-redis)")
    u.add_argument("--insecure-redis", action="store_true",
                   help="run on an open Redis (its default user without a password) WITHOUT refusing it, with a warning: "
                   "anyone who reaches its port can then drop any tenant's index entries or fill its quota")
    u.add_argument("--model", metavar="PATH",
                   help="size pages to this model's stored chunk: a local Hugging Face model folder (with "
                   "config.json) or a config.json path (no weights are read)")
    u.add_argument("--chunk-tokens", type=int, default=256,
                   help="tokens per chunk, as the connectors' chunk_tokens (default 256); with --model")
    u.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                   help="the KV cache's dtype (default: the config's dtype, else float16); with --model")
    u.add_argument("--storage-format", choices=STORAGE_FORMATS, default="raw",
                   help="how engines store chunks (default raw; the others are lossy, smaller); with --model")
    u.add_argument("--page-size", help=f"bytes per page, one KV head's slice of a chunk (overrides --model; default {DEFAULT_PAGE} "
                   "without --model)")
    dram = u.add_mutually_exclusive_group()
    dram.add_argument("--dram", help=f"DRAM tier per shard: bytes (64GiB) or a share of the node's memory (25%%); "
                      f"default {DEFAULT_DRAM}, committed at start")
    dram.add_argument("--dram-pages", type=int, help="DRAM tier per shard in pages (instead of --dram)")
    u.add_argument("--disk-dir", help="directory of a disk tier (on every node)")
    disk = u.add_mutually_exclusive_group()
    disk.add_argument("--disk", help="disk tier per shard: bytes (500GiB) or a share of --disk-dir's filesystem "
                      "(50%%); sparse until written")
    disk.add_argument("--disk-pages", type=int, help="disk tier per shard in pages (instead of --disk)")
    u.add_argument("--policy", default="default",
                   help=f"eviction policy of every shard (default: {DEFAULT_POLICY}). {describe_policies()}")
    u.add_argument("--tenant", action="append", default=[],
                   help="a tenant to serve, id[:quota[:priority]] (repeat); a known tenant keeps its quota unless given")
    u.add_argument("--secret-file", help="the pool secret (made here if missing; default: $KVPOOL_SECRET_FILE, "
                   "$KVPOOL_SECRET, else ~/.kvpool/secret, made if missing)")
    u.set_defaults(func=func)


def up_store(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """(the shards' store config, the model's chunk or None), checked before any Ray is touched."""
    chunk = None
    if args.model:
        from kvpool.cluster.sizing import model_chunk

        chunk = model_chunk(args.model, args.chunk_tokens, args.dtype, args.storage_format)
    elif args.dtype or args.storage_format != "raw" or args.chunk_tokens != 256:
        raise BadRequest("--chunk-tokens, --dtype and --storage-format describe the model of --model: add --model PATH")
    if args.page_size:
        page = parse_size(args.page_size)
        if chunk and page < chunk["page_bytes"]:
            raise BadRequest(f"--page-size {args.page_size} ({page} B) is smaller than one stored slice (a KV head's "
                             f"chunk) of {args.model} ({chunk['page_bytes']} B): drop --page-size to fit pages to "
                             "the model")
    elif chunk:
        page = chunk["page_bytes"]
    else:
        page = parse_size(DEFAULT_PAGE)
        print(f"kvpool: pages are {mib(page)} each (the default); `--model PATH` sizes them to a model's chunk",
              file=sys.stderr)
    store: dict = {"page_bytes": page, "policy": args.policy}
    if args.dram_pages is not None:
        store["dram_pages"] = args.dram_pages
    else:
        store["dram"] = parse_tier(args.dram or DEFAULT_DRAM, "--dram")
        if isinstance(store["dram"], int) and store["dram"] // page < MIN_PAGES:
            raise BadRequest(f"--dram {args.dram or DEFAULT_DRAM} holds {store['dram'] // page} pages of {page} B, "
                             f"and a tier needs at least {MIN_PAGES}: raise --dram")
    if args.disk_dir:
        store["disk_dir"] = args.disk_dir
        if args.disk is not None:
            store["disk"] = parse_tier(args.disk, "--disk")
        elif args.disk_pages is not None:
            store["disk_pages"] = args.disk_pages
        else:
            raise BadRequest("--disk-dir needs the disk tier's size: --disk 500GiB (or a share like 50%) or "
                             "--disk-pages N")
    elif args.disk is not None or args.disk_pages:
        raise BadRequest("--disk and --disk-pages size a disk tier: add --disk-dir DIR (on every node)")
    return store, chunk


def describe(store: dict, chunk: dict | None, args: argparse.Namespace) -> list[str]:
    """The sizing lines `kvpool up` prints before the shards' own figures."""
    page = store["page_bytes"]
    lines = [f"  pages: {page} B ({mib(page)})"]
    if chunk:
        waste = 1 - chunk["page_bytes"] / page
        lines[0] += (f"; a chunk of {args.model} ({chunk['spec'].chunk_tokens} tokens, {chunk['dtype']}, "
                     f"{chunk['spec'].storage_format}) is stored as {chunk['slices']} slices (one a KV head) of "
                     f"{chunk['page_bytes']} B, a page each: {waste:.1%} of each page unused")
    for tier in ("dram", "disk"):
        if tier in store:
            req = store[tier]
            lines.append(f"  {tier}: {req if isinstance(req, str) else mib(req)} requested per shard"
                         + (" of each node's memory" if isinstance(req, str) and tier == "dram" else ""))
    return lines


def shard_line(sid: str, info: dict) -> str:
    page = info.get("page_bytes") or 0
    out = (f"  {sid} on node {info['node_id'][:12]}  slab {info['slab']}  dram {info.get('dram_pages')} pages "
           f"({mib(page * (info.get('dram_pages') or 0))})")
    if info.get("disk_pages"):
        out += f", disk {info['disk_pages']} pages ({mib(page * info['disk_pages'])})"
    return out
