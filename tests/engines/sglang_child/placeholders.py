"""Placeholder modules for ``torchvision`` and ``gguf`` when they are not installed: a pytest plugin
of the SGLang child process only (``-p sglang_child.placeholders``), so they are in place before
collection, before any SGLang import.

NOTE: ``sglang.srt.mem_cache.memory_pool`` imports SGLang's whole model-config registry, whose image
processors import ``torchvision`` and whose GGUF loader imports ``gguf``; neither is on the KV path
and the engines virtualenv has neither (see ``tests/engines/test_sglang.py``). A placeholder
``torchvision`` would mislead transformers in a shared process (it checks for it), so this module
must never be imported by the parent pytest process; an installed module is never replaced.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

NAMES = ("torchvision", "gguf")


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0"

        def attr(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(name, (), {})

        mod.__getattr__ = attr
        return mod

    def exec_module(self, module):
        pass


def _install(names) -> frozenset[str]:
    """A placeholder for each of ``names`` that is not installed; the names it covered."""
    missing = frozenset(n for n in names if importlib.util.find_spec(n) is None)
    if missing:
        sys.meta_path.insert(0, _Finder(missing))
    return missing


SHIMMED = _install(NAMES)


def pytest_report_header(config):
    return f"placeholder modules (not installed here): {', '.join(sorted(SHIMMED)) or 'none'}"
