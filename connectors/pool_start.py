"""What a connector checks at start about its "node" pool, so that a pool it cannot use stops the
engine with the fix instead of an engine that serves without the pool: that the node's shard
answers (or, with ``"degraded": true``, a warning), and that the pool takes each tenant's
credential."""

from __future__ import annotations

import json
import logging
import os
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


def verify_tenants(pool, routes: dict[str, str], cfg: dict[str, Any], engine: str, connect: str = "vllm") -> None:
    """Start-up check of a "node" pool's tenants: the shard checks each tenant's credential
    (``routes``: tenant -> what the pool is passed) as every operation checks it, one call each, so
    that a missing credential, one of another pool secret or a tenant the pool does not serve stops
    the engine at start naming the fix (not a 401 on every request). ``cfg``: the connector's pool
    config as written; ``connect``: the engine's name for `kvpool connect`. A pool started
    ``degraded`` that does not answer is not asked."""
    from kvpool.auth import is_credential
    from kvpool.errors import Unauthorized, UnknownTenant

    client = getattr(getattr(pool, "part", None), "client", None)
    if client is None:
        return
    where = cfg.get("credentials_file") or DEFAULT_CREDENTIALS
    for tenant, pool_as in routes.items():
        try:
            said = client.check(pool_as)
        except Unauthorized as e:
            secured = client.secured
            client.close()
            if not is_credential(pool_as):  # a secured pool, and no credential found for it anywhere
                raise Unauthorized(f"{engine}: the pool is secured and tenant {tenant!r} has no credential (none in "
                                   f"{where}{'' if os.path.exists(os.path.expanduser(where)) else ': no such file'}): "
                                   f"run `kvpool connect {connect} --tenant {tenant}` on this node (it writes "
                                   f"{where}), or set credentials_file to a file of the pool's credentials") from None
            why = "it was issued from another pool secret than the running pool's. " if secured else ""
            raise Unauthorized(f"{engine}: the pool does not take the credential of tenant {tenant!r} ({e.message}): {why}"
                               f"Run `kvpool connect "
                               f"{connect} --tenant {tenant}` on this node (it issues it from the pool's secret into "
                               f"{where}), or point credentials_file at credentials of this pool's secret") from None
        except Unavailable:
            if cfg.get("degraded"):
                log.warning("kvpool: %s: tenant %r's credential not verified (the pool does not answer; "
                            "\"degraded\": true)", engine, tenant)
                continue
            client.close()
            raise
        if not said.get("served"):
            client.close()
            err = UnknownTenant(tenant)
            served = said.get("tenants") or []
            drop = ("drop it from the connector's \"tenants\"" if "tenants" in cfg else
                    f"name the engine's tenants in its config (it names none, so it serves {tenant!r}): "
                    f"\"tenants\": {json.dumps(served[:1] or ['NAME'])}")
            err.message = (f"{engine}: tenant {tenant!r} is not one of the pool's tenants {served}: start the pool "
                           f"serving it (`kvpool up --tenant {tenant}`, with the others), or {drop}")
            raise err
