"""What engines and shards say to a shard: one frozen dataclass per operation, each carrying its
wire version, with its encode and decode beside it (the frame around them: kvpool.node.wire).

A request frame's header is ``[op, version, fields, timeout_s, lens]``: the operation's name, the
wire version it was written in, its fields in declaration order, how long the caller waits, and
the byte lengths of the raw payloads that follow it. ``decode`` checks every field's type and size
before the shard acts on any (a key is 16 bytes, a list holds at most ``MAX_KEYS`` entries, a
credential is a string), so a malformed or hostile frame is a 400 that allocates nothing; a frame
of another version is refused with the side to upgrade. The engines' operations arrive on the
node's Unix socket, the ``Peer*`` ones (another shard, with the pool's own credential) on the peer
port. Replies are ``[ok, result, lens]``: the result each class's docstring names, or a typed error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kvpool.errors import BadRequest

WIRE_VERSION = 5  # bump when an operation's fields or results change meaning
MAX_KEYS = 2048  # chunks in one call
MAX_TEXT = 4096  # a credential, a tenant or shard name, a path


class WireMismatch(BadRequest):
    """An engine and a shard (or two shards) of different kvpool releases."""


# ------------------------------------------------------------------ field checks
def _text(v, name):
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise BadRequest(f"{name} must be a string of at most {MAX_TEXT} characters")
    return v


def _opt_text(v, name):
    return None if v is None else _text(v, name)


def _flag(v, name):
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be True or False, got {v!r:.40}")
    return v


def _count(v, name):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BadRequest(f"{name} must be a non-negative int, got {v!r:.40}")
    return v


def _opt_count(v, name):
    return None if v is None else _count(v, name)


def _keys(v, name):
    if not isinstance(v, list) or len(v) > MAX_KEYS or not all(isinstance(k, bytes) and len(k) == 16 for k in v):
        raise BadRequest(f"{name} must be a list of at most {MAX_KEYS} 16-byte chunk keys")
    return v


def _counts(v, name):
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        raise BadRequest(f"{name} must be a list of at most {MAX_KEYS} ints")
    return [_count(x, name) for x in v]


def _checksums(v, name):
    if not isinstance(v, list) or len(v) > MAX_KEYS or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64 for x in v):
        raise BadRequest(f"{name} must be a list of at most {MAX_KEYS} xxh3-64 checksums")
    return v


def _shards(v, name):
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        raise BadRequest(f"{name} must be a list of at most {MAX_KEYS} shard ids")
    return [_text(x, name) for x in v]


def _requests(v, name):
    if not isinstance(v, dict) or len(v) > 1024:
        raise BadRequest(f"{name} must map shard ids to request ids")
    return {_text(k, name): _count(x, name) for k, x in v.items()}


MAX_FIGURES = 64  # in one engine's report
MAX_FIGURE_TEXT = 256  # a figure's name or text value, an engine's name


def _figures(v, name):
    """An engine's report: a few named figures, each a number, a flag, a short text or None."""
    ok = isinstance(v, dict) and len(v) <= MAX_FIGURES and all(
        isinstance(k, str) and len(k) <= MAX_FIGURE_TEXT and (
            x is None or isinstance(x, (bool, int, float)) or isinstance(x, str) and len(x) <= MAX_FIGURE_TEXT)
        for k, x in v.items())
    if not ok:
        raise BadRequest(f"{name} must be a dict of at most {MAX_FIGURES} figures, each named in at most "
                         f"{MAX_FIGURE_TEXT} characters and a number, True/False, None or a text of at most "
                         f"{MAX_FIGURE_TEXT} characters")
    return v


def _engine_name(v, name):
    if not isinstance(v, str) or not v or len(v) > MAX_FIGURE_TEXT:
        raise BadRequest(f"{name} must be an engine's name of 1 to {MAX_FIGURE_TEXT} characters")
    return v


class Message:
    """A request: ``OP`` names it on the wire, ``CHECKS`` checks each field as it is decoded."""

    OP: ClassVar[str]
    CHECKS: ClassVar[dict]
    PAYLOADS: ClassVar[bool] = False  # raw payloads follow the header (one per key)

    def encode(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def decode(cls, version: object, values: object) -> "Message":
        if version != WIRE_VERSION:
            raise WireMismatch(f"this shard speaks kvpool wire version {WIRE_VERSION} but got {cls.OP} of version "
                               f"{version!r}: run the same kvpool release in the engines and the shards")
        fields = dataclasses.fields(cls)
        if not isinstance(values, list) or len(values) > len(fields):
            raise BadRequest(f"{cls.OP} takes at most {len(fields)} fields")
        given = {f.name: cls.CHECKS[f.name](v, f"{cls.OP}.{f.name}") for f, v in zip(fields, values)}
        try:
            return cls(**given)
        except TypeError:
            raise BadRequest(f"{cls.OP} needs {[f.name for f in fields]}") from None


OPS: dict[str, type[Message]] = {}


def op(wire_name: str, /, **checks):
    """Declares a message class: its name on the wire and its fields' checks."""
    def register(cls):
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.OP, cls.CHECKS = wire_name, checks
        missing = {f.name for f in dataclasses.fields(cls)} ^ set(checks)
        assert not missing, f"{wire_name}: checks and fields differ on {missing}"
        OPS[wire_name] = cls
        return cls
    return register


_READ = dict(credential=_text, keys=_keys, shared=_flag)
_WRITE = dict(credential=_text, keys=_keys, shared=_flag, first_position=_count, request_id=_opt_count)


# ------------------------------------------------------------------ an engine to its node's shard
@op("hello")
class Hello(Message):
    """-> the node file's info (kvpool.node.paths)."""


def _nonce(v, name):
    if not isinstance(v, bytes) or not 16 <= len(v) <= 64:
        raise BadRequest(f"{name} must be 16 to 64 random bytes")
    return v


@op("prove", role=_text, tenant=_text, nonce=_nonce)
class Prove(Message):
    """Before a client sends a credential of ``role`` for ``tenant``: -> ``{"proof"}``,
    :func:`kvpool.auth.shard_proof` over the client's fresh ``nonce`` (kvpool.node.trust)."""

    role: str
    tenant: str
    nonce: bytes


@op("check", credential=_text)
class Check(Message):
    """A credential checked as every operation checks it (401: not issued from this pool's secret),
    once, when an engine starts -> ``{"tenant", "served"}``: whether this shard serves its tenant,
    and when it does not, ``"tenants"``: the ones it does (told only to a caller whose credential
    verifies: one that only the pool secret's holder can issue)."""

    credential: str


@op("lookup", **_READ)
class Lookup(Message):
    """The leading run of ``keys`` the pool holds for the caller -> ``{"count", "shards", "error"}``."""

    credential: str
    keys: list
    shared: bool = False


@op("get", **_READ, shards=_shards)
class Get(Message):
    """The leading run of ``keys``, from wherever they are (``shards``: where the caller's lookup
    found them) -> ``{"count", "staged"?}`` and the chunks (or their places in the staging file)."""

    credential: str
    keys: list
    shared: bool = False
    shards: list | None = None


@op("begin", **_READ, priority=_opt_text)
class Begin(Message):
    """A request starts: its cached leading run is leased on every shard holding some ->
    ``{"requests": {shard: request id}, "count"}``."""

    credential: str
    keys: list
    shared: bool = False
    priority: str | None = None


@op("end", credential=_text, requests=_requests)
class End(Message):
    """The request ends on its shards (its leases go) -> None."""

    credential: str
    requests: dict


@op("pin", **_READ)
class Pin(Message):
    """Pins the leading run on the shards holding it (warm-up; an operator's) -> how many."""

    credential: str
    keys: list
    shared: bool = False


@op("verify", **_READ)
class Verify(Message):
    """Chunks the caller found failing their checksum in this node's slab: the shard checks each
    itself and drops those that fail (a caller cannot make it drop a good one) -> how many it dropped."""

    credential: str
    keys: list
    shared: bool = False


@op("touch", **_READ)
class Touch(Message):
    """Chunks the caller read from this node's slab itself: counted as hits and told to the
    eviction policy, as reads through the shard are -> how many it holds."""

    credential: str
    keys: list
    shared: bool = False


@op("report", credential=_text, name=_engine_name, figures=_figures)
class Report(Message):
    """An engine's measured figures, for `kvpool stats`, sent with any credential the engine holds
    (its name is shown with that credential's tenant) -> None."""

    credential: str
    name: str
    figures: dict


@op("stats", pool=_flag)
class Stats(Message):
    """-> this shard's stats; ``pool``: the whole pool's, as `kvpool stats` shows them
    (cluster.pool_stats.summarize), gathered by this shard."""

    pool: bool = False


@op("stage", credential=_text)
class Stage(Message):
    """This connection's staging file, made on first ask and charged to the credential's tenant
    (its cap on this node: 429; a run dir without room: 507) -> ``{"path", "nbytes"}``."""

    credential: str


@op("reserve", **_WRITE, sizes=_counts)
class Reserve(Message):
    """Pages of this node's slab for a write -> ``{"hold", "places": [[key, offset, nbytes]]}``, or
    ``{"full": True}`` when this node would evict to take them (send them with ``Put``)."""

    credential: str
    keys: list
    shared: bool = False
    first_position: int = 0
    request_id: int | None = None
    sizes: list = dataclasses.field(default_factory=list)


@op("put_staged", **_WRITE, sizes=_counts, offsets=_counts)
class PutStaged(Message):
    """Small chunks from this connection's staging file, stored in one call -> how many, or
    ``{"full": True}``."""

    credential: str
    keys: list
    shared: bool = False
    first_position: int = 0
    request_id: int | None = None
    sizes: list = dataclasses.field(default_factory=list)
    offsets: list = dataclasses.field(default_factory=list)


@op("commit", credential=_text, hold=_count, keys=_keys, checksums=_checksums)
class Commit(Message):
    """The copies of a reservation are done -> how many chunks are stored (410: it is gone)."""

    credential: str
    hold: int
    keys: list
    checksums: list


@op("abort", credential=_text, hold=_count)
class Abort(Message):
    """A reservation given back -> None."""

    credential: str
    hold: int


@op("put", **_WRITE)
class Put(Message):
    """Chunks sent with the call (the payloads), stored where the pool has room -> how many."""

    PAYLOADS = True
    credential: str
    keys: list
    shared: bool = False
    first_position: int = 0
    request_id: int | None = None


# ------------------------------------------------------------------ a shard to another (the peer port)
_PEER = dict(pool=_text)


@op("peer_get", **_PEER, **_READ)
class PeerGet(Message):
    """A tenant's chunks held here, for another shard -> ``{"checksums"}`` and the chunks."""

    pool: str
    credential: str
    keys: list
    shared: bool = False


@op("peer_put", **_PEER, **_WRITE)
class PeerPut(Message):
    """Chunks another shard could not take (the payloads) -> how many are stored."""

    PAYLOADS = True
    pool: str
    credential: str
    keys: list
    shared: bool = False
    first_position: int = 0
    request_id: int | None = None


@op("peer_begin", **_PEER, **_READ, priority=_opt_text)
class PeerBegin(Message):
    """Leases a tenant's chunks held here for a request another shard began -> the request id."""

    pool: str
    credential: str
    keys: list
    shared: bool = False
    priority: str | None = None


@op("peer_end", **_PEER, credential=_text, request_id=_count)
class PeerEnd(Message):
    """Ends a request begun with ``PeerBegin`` -> whether it was known."""

    pool: str
    credential: str
    request_id: int


@op("peer_pin", **_PEER, **_READ)
class PeerPin(Message):
    """Pins a tenant's chunks held here (an operator's warm-up through another shard) -> how many."""

    pool: str
    credential: str
    keys: list
    shared: bool = False


ENGINE_OPS = frozenset(n for n in OPS if not n.startswith("peer_"))
PEER_OPS = frozenset(n for n in OPS if n.startswith("peer_"))
