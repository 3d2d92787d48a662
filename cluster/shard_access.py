"""Who a shard's caller is and where its keys lie: plain functions over a ShardActor instance.

The actor's methods call them, and so does the node server in the same process
(cluster/node_server.py). NOTE: not methods: Ray wraps every method of an actor class (its
tracing hooks), which cost ~30 us a call on the node path's hot loop even when called in-process.
"""

from __future__ import annotations

from kvpool.auth import Principal, scope_tag, scoped
from kvpool.errors import BadRequest, Forbidden
from kvpool.keys import ChunkKey


def as_keys(raw) -> list[ChunkKey]:
    return [k if isinstance(k, ChunkKey) else ChunkKey(bytes(k)) for k in raw]


def who(shard, credential: str) -> Principal:
    """The verified caller (401 without a credential of this pool's secret; 404 for a tenant this
    shard does not serve)."""
    p = shard.auth.verify(credential)
    shard.store.tenants.index(p.tenant)
    return p


def where(p: Principal, raw, shared: bool) -> list[ChunkKey]:
    """The store's addresses of a caller's keys: its own scope, or the shared one."""
    return scoped(as_keys(raw), scope_tag(None if shared else p.tenant))


def writer(shard, credential: str, keys, shared: object, parent=None) -> tuple[Principal, list[ChunkKey], ChunkKey | None]:
    """The verified writer, the addresses it writes and its parent's (only an operator writes the
    shared namespace)."""
    p = who(shard, credential)
    if not isinstance(shared, bool):
        raise BadRequest(f"shared must be True or False, got {shared!r}")
    if shared and not p.operator:
        raise Forbidden(f"only an operator writes the shared namespace; {p.tenant!r} presented a {p.role} credential")
    return p, where(p, keys, shared), None if parent is None else where(p, [parent], shared)[0]


def joined_request(shard, request_id: int | None, tenant: str):
    """The request in flight a write joins (its chunks stay leased until it ends); None for a
    request this shard does not know (expired, begun before a restart) or another tenant's: the
    write goes on, unleased."""
    entry = shard._requests.get(request_id) if request_id is not None else None
    return None if entry is None or entry[0].cancelled or entry[0].tenant != tenant else entry[0]
