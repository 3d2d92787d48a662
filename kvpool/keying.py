"""One key maker for both pools: a tenant's (or the shared) namespace for a spec, and the chunk
keys of a prompt in it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.errors import BadRequest
from kvpool.keys import ChunkKey, Namespace, SharedKey, chunk_keys
from kvpool.spec import KVSpec
from kvpool.tenants import SHARED_SALT


class KeyMaker:
    """``salt_of(tenant)`` gives a tenant's salt from its credential (and raises Unauthorized or
    UnknownTenant for one the pool does not serve); the spec's fingerprint is computed once.
    Shared keys are :class:`SharedKey` s, so a pool addresses them in the shared scope."""

    __slots__ = ("spec", "_salt_of", "_fingerprint")

    def __init__(self, spec: KVSpec, salt_of: Callable[[str], bytes]) -> None:
        self.spec = spec
        self._salt_of = salt_of
        self._fingerprint = spec.fingerprint()

    def namespace(self, tenant: str, *, shared: bool = False, adapter_id: str = "",
                  extra_keys: Sequence[str | bytes] = ()) -> Namespace:
        if not isinstance(shared, bool):
            raise BadRequest(f"shared must be True or False, got {shared!r}")
        if isinstance(extra_keys, (str, bytes)):
            raise BadRequest(f"extra_keys is a sequence of str or bytes: wrap one key in a list, [{extra_keys!r}]")
        salt = self._salt_of(tenant)  # the caller is checked for shared keys too
        if shared:
            salt = SHARED_SALT
        return Namespace(salt, self._fingerprint, adapter_id, tuple(extra_keys))

    def keys(self, tenant: str, tokens: object, *, shared: bool = False, adapter_id: str = "",
             extra_keys: Sequence[str | bytes] = ()) -> list[ChunkKey]:
        ns = self.namespace(tenant, shared=shared, adapter_id=adapter_id, extra_keys=extra_keys)
        return chunk_keys(tokens, ns, self.spec.chunk_tokens, kind=SharedKey if shared else ChunkKey)
