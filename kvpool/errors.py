"""Typed errors of the pool, each with an HTTP-style status.

Conventions (shared by every layer):
- a miss is ``None``, never an exception;
- a full pool or an exhausted quota is a typed error with a status (507, 429) that callers can
  turn into back-pressure;
- bad input is a ``BadRequest`` (also a ``ValueError``) whose message names the fix;
- a caller breaking the contract is a ``RuntimeError``; internal invariants are ``assert``s.
"""

from __future__ import annotations


class KvPoolError(Exception):
    """Base of every error the pool raises on purpose."""

    status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.status}] {self.message}"

    def __reduce__(self):
        # NOTE: subclasses take their own constructor arguments, so the default pickling (calling
        # the class with ``args``) fails for them, and a 429 raised in a shard reached the client
        # as a deserialization error: rebuild from the fields instead.
        return _rebuild, (type(self), self.__dict__.copy())


def _rebuild(cls: type[KvPoolError], fields: dict) -> KvPoolError:
    err = cls.__new__(cls)
    Exception.__init__(err, fields.get("message", ""))
    err.__dict__.update(fields)
    return err


class BadRequest(KvPoolError, ValueError):
    """The input is malformed; the message says what to change."""

    status = 400


class LayoutMismatch(BadRequest):
    """A payload's dtype, shape or size does not match the KV spec it is stored under."""

    status = 400


class UnknownTenant(KvPoolError, KeyError):
    """The tenant was never registered."""

    status = 404

    def __init__(self, tenant: str) -> None:
        super().__init__(
            f"unknown tenant {tenant!r}: register it first (TenantRegistry.add or `kvpool tenants`)"
        )
        self.tenant = tenant


class Unauthorized(KvPoolError):
    """No verifiable credential: a bare name or a forged credential on a secured pool; the message
    says where a credential comes from."""

    status = 401


class Forbidden(KvPoolError):
    """The caller may not do this (a drill on a production shard, ...); the message says how it
    is allowed."""

    status = 403


class ChunkTooLarge(BadRequest):
    """A payload is larger than one page of the store."""

    status = 413


class QuotaExceeded(KvPoolError):
    """A tenant's write would take its usage past its byte quota."""

    status = 429

    def __init__(self, tenant: str, usage: int, limit: int, requested: int) -> None:
        super().__init__(
            f"tenant {tenant!r} is over quota: usage {usage} B + {requested} B requested "
            f"> limit {limit} B; free some of its chunks or raise its quota"
        )
        self.tenant = tenant
        self.usage = usage
        self.limit = limit
        self.requested = requested


class RequestCancelled(KvPoolError):
    """The pool cancelled this request to free memory: nothing else could be evicted, and it was
    the lowest-priority request in flight. Retry later or recompute without the pool."""

    status = 429

    def __init__(self, request_id: int, tenant: str, priority: int) -> None:
        super().__init__(
            f"request {request_id} of tenant {tenant!r} (priority {priority}) was cancelled to free pool "
            "memory: it was the lowest-priority request in flight; retry later"
        )
        self.request_id = request_id
        self.tenant = tenant
        self.priority = priority


class ReservationGone(KvPoolError):
    """A write's reservation is no longer there (committed, aborted, expired, or its shard
    restarted): nothing was written, a failed write rather than the caller's bad input."""

    status = 410


class PoolFull(KvPoolError):
    """No page can be freed: every resident chunk is leased (being read or in flight)."""

    status = 507


class Unavailable(KvPoolError):
    """A remote part of the pool (a shard, the index) did not answer in time."""

    status = 503


class LimitExceeded(KvPoolError):
    """A cap on what one tenant may hold besides its byte quota (staging files on a node, engines
    reporting) is reached; the message names the cap and how to raise it."""

    status = 429


class StagingFull(KvPoolError):
    """The node's run dir has no room for another staging file; the message says how much room
    it has, what each engine's file takes and how to give it more."""

    status = 507
