"""The vLLM connector's ``kv_connector_extra_config``: the pool's settings
(:mod:`kvpool.connectors.pools`) and the connector's own, split and checked without vLLM (the
router keys requests with the same settings: :mod:`kvpool.connectors.route`)."""

from __future__ import annotations

from typing import Any

from kvpool.connectors.pools import KNOWN_KEYS, NO_COMPRESS, check_config, unknown_keys
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
    """(pool config, connector settings) out of kv_connector_extra_config; unknown keys are a
    BadRequest naming both lists."""
    extra = dict(extra or {})
    unknown = set(extra) - KNOWN_KEYS - CONNECTOR_KEYS
    if unknown:
        raise BadRequest("KVPoolConnector: " + unknown_keys(unknown, KNOWN_KEYS | CONNECTOR_KEYS,
                                                            "kv_connector_extra_config keys"))
    own = {k: extra.pop(k) for k in list(extra) if k in CONNECTOR_KEYS}
    if "compress" in extra:
        raise BadRequest(NO_COMPRESS.format(engine="vLLM"))
    check_config(extra)
    return extra, own
