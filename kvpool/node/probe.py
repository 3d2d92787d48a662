"""Does this node's shard answer? What an engine asks once at start (kvpool.connectors.pools), so
that a wrong ``run_dir``/``pool``/``shard`` or a pool that is not running is a start-up error that
names what did not answer, not an engine that silently recomputes everything."""

from __future__ import annotations

import json
import logging
import os
import time

from kvpool.errors import BadRequest, KvPoolError
from kvpool.node import messages as m

log = logging.getLogger("kvpool.node")
WAIT_LOG_S = 5.0  # how often a start that waits for its pool says so


def why_down(client) -> str | None:
    """None when ``client``'s (a NodeClient) shard answers a ``hello`` within the client's
    ``timeout_s``; else what did not answer: no node file in the run dir, or the socket a node
    file names."""
    files = [p for p in client.node_files() if os.path.exists(p)]
    if not files:
        name = f"kvpool-{client.pool}-{client.shard or '*'}.node"
        return (f"no shard of pool {client.pool!r} runs on this node: no {name} in run_dir {client.directory} "
                "(the shard writes it when `kvpool up` starts it; set run_dir / $KVPOOL_RUN_DIR to the shard's)")
    client._next_try = 0.0  # look now, not after the client's retry interval
    try:
        client.call(m.Hello())
        return None
    except BadRequest:
        raise  # several shards answer: the operator must name one
    except KvPoolError as e:
        if client.untrusted:  # found, but not this user's: say why it was not used
            return client.untrusted
        sockets = []
        for path in files:
            try:
                with open(path) as f:
                    sockets.append(json.load(f)["socket"])
            except (OSError, ValueError, KeyError):
                sockets.append(f"(unreadable node file {path})")
        return (f"the shard's socket {', '.join(sockets)} (named by {', '.join(files)}) did not answer a ping within "
                f"{client.timeout_s:g} s ({e.message}): the shard is down or stale")


def wait_until_up(client, start_timeout_s: float) -> str | None:
    """Asks :func:`why_down` until the shard answers or ``start_timeout_s`` passed (a pool that is
    starting); logs a line every few seconds while it waits. The last reason, or None."""
    deadline = time.monotonic() + start_timeout_s
    said = time.monotonic()
    while True:
        why = why_down(client)
        now = time.monotonic()
        if why is None or now >= deadline:
            return why
        if now - said >= WAIT_LOG_S:
            said = now
            log.warning("kvpool: waiting for pool %r (%.0f s left of start_timeout_s=%g): %s", client.pool,
                        deadline - now, start_timeout_s, why)
        time.sleep(min(0.25, max(deadline - now, 0.0)))
