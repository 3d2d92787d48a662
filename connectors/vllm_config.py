"""The vLLM connector's ``kv_connector_extra_config``: the pool's settings
(:mod:`kvpool.connectors.pools`) and the connector's own, split and checked without vLLM (the
router keys requests with the same settings: :mod:`kvpool.connectors.route`)."""

from __future__ import annotations

from typing import Any

from kvpool.connectors.pools import NO_COMPRESS, check_config, check_keys
from kvpool.errors import BadRequest

# Settings of the connector itself, taken out of kv_connector_extra_config before the rest goes
# to open_pool.
CONNECTOR_KEYS = {
    "model_id",  # the pool's name for the model (default: vLLM's model name or path)
    "model_revision",  # default: vLLM's revision, else "main"
    "model_weights",  # your name for the weights (default: a fingerprint of the checkpoint's files)
    "breakeven_margin",  # > 1 favours recomputing on ties (BreakEven.margin)
}


def split_config(extra: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pool config, connector settings) out of kv_connector_extra_config; an unknown key is a
    BadRequest naming the key it likely meant and every known one. The pool is this node's
    (``backend`` ``"node"``) unless the config says ``"local"``: so the config a user writes once
    names nothing but what differs (``{}``: tenant ``default``, its credential where `kvpool
    connect` writes it, the shard found in the run dir)."""
    extra = dict(extra or {})
    try:
        check_keys(extra, CONNECTOR_KEYS, "kv_connector_extra_config keys")
    except BadRequest as e:
        raise BadRequest(f"KVPoolConnector: {e.message}") from None
    extra.setdefault("backend", "node")
    own = {k: extra.pop(k) for k in list(extra) if k in CONNECTOR_KEYS}
    if "compress" in extra:
        raise BadRequest(NO_COMPRESS.format(engine="vLLM"))
    check_config(extra)
    return extra, own
