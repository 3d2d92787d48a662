"""``kvpool route``'s arguments; the router itself is :mod:`kvpool.connectors.route`."""

from __future__ import annotations

import argparse

from kvpool.routing import POLICIES


def _route(args: argparse.Namespace) -> int:
    from kvpool.connectors.route.main import run

    return run(args)


def add_route_parser(sub) -> None:
    r = sub.add_parser(
        "route", help="an OpenAI-compatible router in front of vLLM servers: each request goes where its prefix is "
        "cheapest (own GPU cache, node's shard, the pool, prefill) against load",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=(
            "Forwards /v1/completions and /v1/chat/completions to the instance where the request's time to first\n"
            "token is expected lowest, and streams the answer back. Instances that fail are routed around\n"
            "(a request goes to a second one only when nothing of it reached the first); the router keeps no\n"
            "state it cannot rebuild. See docs/engines.md (\"A router in front\")."))
    r.add_argument("--instance", action="append", default=[], required=True, metavar="URL[,shard=ID][,events=ADDR]",
                   help="a vLLM server (repeat): its base URL; shard=: its node's pool shard (default: this node's); "
                   "events=: where to read its KV events (default: what it announces at /kv_event_sources)")
    r.add_argument("--config", required=True, metavar="JSON|@FILE",
                   help="the engines' --kv-transfer-config (e.g. \"$(kvpool connect vllm)\"): the router reads their "
                   "pool, tenants and credentials from it, and keys requests as they do")
    r.add_argument("--model", metavar="PATH",
                   help="the checkpoint folder, exactly as vllm serve was given it (its chunk keys name it): without it "
                   "the pool's tiers are unknown and requests route on GPU caches and load")
    r.add_argument("--dtype", help="the dtype the engines serve (vllm serve --dtype; default: the config's)")
    r.add_argument("--tokenizer", metavar="PATH", help="the served model's tokenizer (default: --model) for text "
                   "prompts and chat messages; prompts given as token ids need none")
    r.add_argument("--policy", choices=POLICIES, default="tier-aware",
                   help="tier-aware (default): every tier at its measured cost; gpu-prefix: the instances' own GPU "
                   "caches only; least-loaded; round-robin")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    r.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    r.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health checks of each instance, and their deadline (default 1)")
    r.add_argument("--balance", type=float, default=1.25,
                   help="an instance sent more than this many times the mean of recent work is passed over (default 1.25)")
    r.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    r.add_argument("--connect-timeout", type=float, default=3.0, help="seconds to reach an instance (default 3)")
    r.add_argument("--render-workers", type=int, default=2, metavar="N",
                   help="processes that render chat templates and tokenize text prompts, each holding the tokenizer "
                   "(default 2)")
    r.add_argument("--render-timeout", type=float, default=5.0, metavar="S",
                   help="seconds a prompt may take to render and tokenize; past it the request is refused (400) and "
                   "its worker replaced (default 5)")
    r.add_argument("--max-inflight-per-tenant", type=int, default=256, metavar="N",
                   help="requests of one tenant the router holds at once; past it a 429 (default 256)")
    r.add_argument("--max-body-mib-per-tenant", type=float, default=256.0, metavar="MIB",
                   help="MiB of request bodies of one tenant the router holds at once; past it a 429 (default 256)")
    r.set_defaults(func=_route)
