"""Eviction policies, chosen by name. Adding one is one module and one line in ``_MODULES``.

Every policy is prefix-aware through the shared ``Residency``: a chunk whose suffix is resident
is never dropped before it, and leased or pinned chunks are never evicted.
"""

from __future__ import annotations

import importlib

from kvpool.errors import BadRequest
from kvpool.policies.base import NO_PARENT, Access, Policy, Residency

_MODULES = (
    "kvpool.policies.lru",
    "kvpool.policies.request",
    "kvpool.policies.s3fifo",
    "kvpool.policies.adaptive",
    "kvpool.policies.tiered",
    "kvpool.policies.importance",
    "kvpool.policies.density",
)


def registry() -> dict[str, type[Policy]]:
    out: dict[str, type[Policy]] = {}
    for mod in _MODULES:
        m = importlib.import_module(mod)
        for obj in vars(m).values():
            if isinstance(obj, type) and issubclass(obj, Policy) and obj.name:
                out[obj.name] = obj
    return out


DEFAULT_POLICY = "density"

# Not a policy of one tier but a way to build the cache: HBM -> DRAM -> disk, each tier with its
# own policy (lru unless told), demoting before dropping and promoting on a hit.
TIERED_MEMORY = "tiered-memory"
TIERED_MEMORY_SPLIT = (0.125, 0.375, 0.5)  # shares of the capacity: HBM, DRAM, disk


def policy_names() -> list[str]:
    """Every name `kvpool sim --policy` accepts, the tiered-memory layout included."""
    return sorted(registry()) + [TIERED_MEMORY]


def describe_policies() -> str:
    """One line per policy, ``name: what it evicts first`` (for ``--help``)."""
    return "; ".join(f"{name}: {cls.description}" for name, cls in sorted(registry().items()))


def policy_class(name: str) -> type[Policy]:
    reg = registry()
    if name == "default":
        name = DEFAULT_POLICY
    try:
        return reg[name]
    except KeyError:
        raise BadRequest(f"unknown eviction policy {name!r}; choose one of {sorted(reg)} or 'default'") from None


def make_policy(name: str, capacity: int, residency: Residency, **params) -> Policy:
    return policy_class(name)(capacity, residency, **params)


__all__ = [
    "NO_PARENT", "TIERED_MEMORY", "TIERED_MEMORY_SPLIT", "Access", "DEFAULT_POLICY", "Policy", "Residency",
    "describe_policies", "make_policy", "policy_class", "policy_names", "registry",
]
