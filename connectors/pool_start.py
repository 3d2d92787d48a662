"""What a connector checks at start about its "node" pool, so that a pool it cannot use stops the
engine with the fix instead of an engine that serves without the pool: that the node's shard
answers (or, with ``"degraded": true``, a warning), and that the pool takes each tenant's
credential."""

from __future__ import annotations

import logging
from typing import Any

from kvpool.connect_cli import DEFAULT_CREDENTIALS
from kvpool.errors import Unavailable

log = logging.getLogger("kvpool.connectors")
START_TIMEOUT_S = 30.0  # how long a connector waits at start for a "node" pool that is starting


def node_answers(client, cfg: dict[str, Any]) -> None:
    """Start-up check of a "node" pool: its shard answers within ``start_timeout_s``, else
    Unavailable naming what did not answer -- or, with ``degraded``, a WARNING and on we go."""
    from kvpool.node.probe import wait_until_up

    degraded = bool(cfg.get("degraded"))
    why = wait_until_up(client, float(cfg.get("start_timeout_s", 0.0 if degraded else START_TIMEOUT_S)))
    if why is None:
        return
    if degraded:
        log.warning("kvpool: pool %r does not answer (%s); starting DEGRADED (\"degraded\": true): every prompt is "
                    "recomputed until the pool answers, looked for again every %g s", cfg["pool"], why,
                    client.retry_s)
        return
    client.close()
    raise Unavailable(f"the kvpool pool {cfg['pool']!r} did not answer at start: {why}. Start the pool (`kvpool up` "
                      "on this node), fix the connector's settings (run_dir, pool, shard), or set \"degraded\": true "
                      "to start without it (recomputing everything until it answers)")


def verify_tenants(pool, routes: dict[str, str], cfg: dict[str, Any], engine: str) -> None:
    """Start-up check of a "node" pool's tenants: each tenant's credential (``routes``: tenant ->
    what the pool is passed) is verified by the shard, one call each, so that a credential of
    another pool secret or a tenant the pool does not serve stops the engine at start with the fix
    (not a 401 on every request). A pool started ``degraded`` that does not answer is not asked."""
    from kvpool.errors import Unauthorized, UnknownTenant
    from kvpool.node import messages as m

    client = getattr(getattr(pool, "part", None), "client", None)
    if client is None:
        return
    where = cfg.get("credentials_file") or DEFAULT_CREDENTIALS
    for tenant, pool_as in routes.items():
        try:
            client.call(m.Lookup(pool_as, [], False))
        except Unauthorized as e:
            client.close()
            raise Unauthorized(f"{engine}: the pool does not take tenant {tenant!r}'s credential ({e.message}); "
                               f"issue it from this pool's secret: run `kvpool connect vllm --tenant {tenant}` on this "
                               f"node (it writes {where}), or point credentials_file at the pool's credentials") from None
        except UnknownTenant as e:
            client.close()
            e.message = (f"{engine}: tenant {tenant!r} is not one of the pool's tenants: start the pool serving it "
                         f"(`kvpool up --tenant {tenant}`, or the chart's tenants), or drop it from the connector's "
                         "tenants")
            raise e from None
        except Unavailable:
            if cfg.get("degraded"):
                log.warning("kvpool: %s: tenant %r's credential not verified (the pool does not answer; "
                            "\"degraded\": true)", engine, tenant)
                continue
            client.close()
            raise
