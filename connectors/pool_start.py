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
from kvpool.errors import KvPoolError, Unauthorized, Unavailable, UnknownTenant

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
    the engine at start naming the fix (not a 401 on every request). Every tenant is asked: one
    start names each tenant's problem and fix. ``cfg``: the connector's pool config as written;
    ``connect``: the engine's name for `kvpool connect`. A pool started ``degraded`` that does not
    answer is not asked."""
    client = getattr(getattr(pool, "part", None), "client", None) or getattr(pool, "client", None)
    if client is None or not hasattr(client, "check"):
        return
    problems: list[KvPoolError] = []
    for tenant, pool_as in routes.items():
        try:
            problem = _tenant_problem(client, tenant, pool_as, cfg, connect)
        except Unavailable:
            if cfg.get("degraded"):
                log.warning("kvpool: %s: the tenants' credentials not verified (the pool does not answer; "
                            "\"degraded\": true)", engine)
                return
            client.close()
            raise
        if problem is not None:
            problems.append(problem)
    if not problems:
        return
    client.close()
    first = problems[0]
    if len(problems) == 1:
        first.message = f"{engine}: {first.message}"
    else:
        first.message = (f"{engine}: {len(problems)} of its tenants cannot use the pool:\n" +
                         "\n".join(f"  - {p.message}" for p in problems))
    first.args = (first.message,)
    raise first


def _tenant_problem(client, tenant: str, pool_as: str, cfg: dict[str, Any], connect: str) -> KvPoolError | None:
    """What stops ``tenant`` from using the pool, as an error whose message names the fix; None when
    the pool takes its credential and serves it."""
    from kvpool.auth import is_credential

    where = cfg.get("credentials_file") or DEFAULT_CREDENTIALS
    try:
        said = client.check(pool_as)
    except Unauthorized as e:
        if not is_credential(pool_as):  # a secured pool, and no credential found for it anywhere
            return Unauthorized(f"the pool is secured and tenant {tenant!r} has no credential (none in {where}"
                                f"{'' if os.path.exists(os.path.expanduser(where)) else ': no such file'}): run "
                                f"`kvpool connect {connect} --tenant {tenant}` on this node (it writes {where}), or "
                                f"set credentials_file to a file of the pool's credentials")
        why = "it was issued from another pool secret than the running pool's. " if client.secured else ""
        return Unauthorized(f"the pool does not take the credential of tenant {tenant!r} ({e.message}): {why}Run "
                            f"`kvpool connect {connect} --tenant {tenant}` on this node (it issues it from the pool's "
                            f"secret into {where}), or point credentials_file at credentials of this pool's secret")
    if said.get("served"):
        return None
    err = UnknownTenant(tenant)
    served = said.get("tenants") or []
    drop = ("drop it from the connector's \"tenants\"" if "tenants" in cfg else
            f"name the engine's tenants in its config (it names none, so it serves {tenant!r}): "
            f"\"tenants\": {json.dumps(served[:1] or ['NAME'])}")
    err.message = (f"tenant {tenant!r} is not one of the pool's tenants {served}: start the pool serving it "
                   f"(`kvpool up --tenant {tenant}`, with the others), or {drop}")
    return err
