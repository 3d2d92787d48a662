"""``kvpool route``: builds the router from its arguments and serves it (:mod:`.proxy`)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.route")


def read_config(text: str) -> dict[str, Any]:
    """The engines' connector config: ``kv_transfer_config`` JSON (what ``kvpool connect vllm``
    prints) or its ``kv_connector_extra_config``, inline or ``@FILE``. A file that holds a
    credential or a request secret itself is refused while others can read it (``chmod 600``)."""
    path = os.path.expanduser(text[1:]) if text.startswith("@") else None
    if path is not None:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise BadRequest(f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        cfg = json.loads(text)
    except ValueError:
        raise BadRequest("--config: not JSON; pass the engines' --kv-transfer-config, e.g. "
                         "--config \"$(kvpool connect vllm)\", or @FILE holding it") from None
    if not isinstance(cfg, dict):
        raise BadRequest("--config: a JSON object (the engines' --kv-transfer-config)")
    cfg = cfg.get("kv_connector_extra_config", {}) if "kv_connector" in cfg else cfg
    tenants = cfg.get("tenants") if isinstance(cfg.get("tenants"), list) else []
    if path is not None and any(isinstance(t, dict) and ({"credential", "request_secret"} & set(t)) for t in tenants):
        from kvpool.private import check_private

        check_private(path, "--config")
    return cfg


def build(args) -> "RouteService":  # noqa: F821 - imported below
    from kvpool.connectors.pool_start import verify_tenants
    from kvpool.connectors.pools import open_pool
    from kvpool.connectors.route.caps import TenantCaps
    from kvpool.connectors.route.costs import OnlineCost
    from kvpool.connectors.route.fleet import Fleet, InstanceSpec
    from kvpool.connectors.route.plan import Planner
    from kvpool.connectors.route.proxy import RouteService
    from kvpool.connectors.route.render import Renderers
    from kvpool.connectors.tenancy import Tenancy
    from kvpool.connectors.vllm_config import split_config
    from kvpool.sim.cluster import DEFAULT_COST

    specs = [InstanceSpec.parse(t) for t in args.instance]
    caps = TenantCaps(args.max_inflight_per_tenant, args.max_body_mib_per_tenant)
    renderers = Renderers(args.tokenizer or args.model, args.render_workers, args.render_timeout)
    pool_config, own = split_config(read_config(args.config))
    tenancy = Tenancy(pool_config, engine="kvpool route")  # as the engines: the first tenant by default
    pool, chunk_tokens, shard = None, int(pool_config.get("chunk_tokens", 256)), ""
    if args.model:
        from kvpool.connectors.route.spec import engine_spec

        spec = engine_spec(args.model, pool_config, own, args.dtype)
        if pool_config.get("backend", "local") != "node":
            raise BadRequest("kvpool route: the engines' pool must be a kvpool cluster's (backend \"node\"): a local "
                             "pool lives inside one engine, and no router can see it")
        pool = open_pool(spec, pool_config)  # the shard must answer (or the config says degraded)
        verify_tenants(pool, tenancy.pool_routes(), pool_config, "kvpool route")  # as the engines check them
        shard = next(iter(pool.client.shards), "")
    elif args.policy == "tier-aware":
        log.warning("kvpool route: no --model: the pool's tiers are unknown, so requests are routed on the instances' "
                    "GPU caches and load alone; pass --model (the checkpoint folder, as vllm serve was given it)")
    if any(not s.shard for s in specs) and not shard and pool is not None:
        raise BadRequest("kvpool route: this node has no shard of the pool to stand for the instances named without "
                         "one: give each --instance URL,shard=ID (kvpool stats lists the shards)")
    tenant_of = (lambda salt: (r.tenant if (r := tenancy.of_secret(salt)) is not None else None))
    fleet = Fleet(specs, tenant_of, shard or pool_config.get("shard", ""), health_s=args.health_interval)
    planner = Planner(tenancy, pool, chunk_tokens)
    return RouteService(fleet, planner, args.policy, OnlineCost(DEFAULT_COST), balance=args.balance,
                        request_timeout_s=args.request_timeout, connect_timeout_s=args.connect_timeout,
                        renderers=renderers, caps=caps)


def run(args) -> int:
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    service = build(args)
    names = ", ".join(f"{u.name} (shard {u.spec.shard or '?'})" for u in service.fleet.instances)
    print(f"kvpool route: {args.policy} over {names} on http://{args.host}:{args.port}", flush=True)
    web.run_app(service.app(), host=args.host, port=args.port, print=None, access_log=None,
                handle_signals=True, shutdown_timeout=5)
    return 0
