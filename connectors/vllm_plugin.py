"""kvpool's vLLM plugin (entry point ``vllm.general_plugins``): notes a checkpoint's files just
before vLLM loads them.

vLLM builds its KV connectors after it has loaded the model, and they never see the weights. So
that the connector's files fingerprint can only name what vLLM holds, every vLLM process runs
this plugin before it loads a model: vLLM's model loaders are wrapped so that, on entry, they
record the identities of the checkpoint's files (:func:`kvpool.connectors.weights.note_loading`,
one ``stat`` per file). The connector then refuses to start if any of them changed since.

NOTE: the wrapper only records; it never changes what vLLM loads, and any failure of its own is
swallowed (vLLM loads as if the plugin were absent, and the connector falls back to checking the
files against the process's start).
"""

from __future__ import annotations

import functools
import logging
import threading

from kvpool.connectors.weights import note_loading

log = logging.getLogger("kvpool.connectors.vllm")
_MARK = "_kvpool_notes_loading"
_depth = threading.local()  # a loader that calls its base class's load_model is noted once


def register() -> None:
    """vLLM calls this once per process, before any model is loaded."""
    try:
        from vllm.model_executor import model_loader
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except Exception as e:  # noqa: BLE001 - another vLLM: the connector checks against the process start
        log.debug("kvpool: vLLM's model loaders not found (%s); checkpoints are checked against process start", e)
        return
    loaders = {BaseModelLoader, *getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).values()}
    for cls in loaders:
        fn = cls.__dict__.get("load_model")
        if fn is not None and not getattr(fn, _MARK, False):
            cls.load_model = _noting(fn)


def _noting(load_model):
    @functools.wraps(load_model)
    def wrapper(self, *args, **kwargs):
        outer = getattr(_depth, "n", 0) == 0
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            if outer:
                try:
                    config = kwargs.get("model_config") or (args[1] if len(args) > 1 else None) or getattr(
                        kwargs.get("vllm_config") or (args[0] if args else None), "model_config", None)
                    note_loading(config.model, getattr(config, "revision", None))
                except Exception as e:  # noqa: BLE001 - never in the way of vLLM's own loading
                    log.debug("kvpool: could not note the checkpoint before loading (%s)", e)
            return load_model(self, *args, **kwargs)
        finally:
            _depth.n -= 1

    setattr(wrapper, _MARK, True)
    return wrapper
