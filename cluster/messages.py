"""What a client and a shard say to each other: small frozen dataclasses, one per call and reply.

Every message carries the wire version it was written in; a shard refuses a request of another
version, and a client a reply of another, each with an error that says which side to upgrade
(instead of a positional argument landing in the wrong parameter). Bump ``WIRE_VERSION`` when a
message's fields change meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.errors import BadRequest

WIRE_VERSION = 2  # 2: credentials instead of tenant ids; reads say which scope (shared)


class WireMismatch(BadRequest):
    """A client and a shard of different wire versions."""


def check_version(msg: object, side: str) -> None:
    """Raises WireMismatch unless ``msg`` is one of ours in this wire version (``side``: who reads it)."""
    version = getattr(msg, "version", None)
    if version != WIRE_VERSION:
        raise WireMismatch(f"{side} speaks kvpool wire version {WIRE_VERSION} but got a {type(msg).__name__} of "
                           f"version {version!r}: run the same kvpool release on the clients and the shards")


@dataclass(frozen=True, slots=True)
class Write:
    """Chunks of one prompt a tenant writes to one shard: through shared memory (``Reserve``, then
    ``Commit``) or with the bytes (``Put``). ``first_position`` is the first chunk's index in its
    prompt; ``request_id`` the shard's id of the request in flight that leases what is written.
    ``credential``: the writer's (kvpool.auth; a tenant id on an open pool)."""

    keys: list[bytes]
    credential: str
    shared: bool = False
    first_position: int = 0
    request_id: int | None = None
    parent: bytes | None = None
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class Reserve:
    write: Write
    sizes: list[int]
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a chunk's bytes go or lie in the shard's shared-memory slab (and, for a read, the
    checksum the reader verifies)."""

    key: bytes
    offset: int
    nbytes: int
    checksum: int = 0


@dataclass(frozen=True, slots=True)
class Reserved:
    hold_id: int
    places: list[Placement] = field(default_factory=list)
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class Commit:
    hold_id: int
    keys: list[bytes]
    checksums: list[int]
    credential: str = ""
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class Put:
    write: Write
    payloads: list
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class Get:
    """Chunks read from a shard on another node; the bytes come back in ``Got``. ``shared``: the
    keys are the shared namespace's (else the caller's own)."""

    keys: list[bytes]
    credential: str
    shared: bool = False
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class Got:
    """The leading run of the asked chunks the shard holds, each verified. ``corrupt``: the run
    ended at a chunk that failed its checksum, which the shard drops and unlists itself (else a
    shorter run means the index listed a chunk the shard does not hold)."""

    arrays: list
    corrupt: bool = False
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class LeaseReads:
    keys: list[bytes]
    credential: str
    leading: bool = True
    shared: bool = False
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class Leased:
    """A read lease: a placement per key (None where a chunk is not here, when not ``leading``)."""

    hold_id: int
    places: list[Placement | None] = field(default_factory=list)
    version: int = WIRE_VERSION
