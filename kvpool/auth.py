"""Who is calling: credentials the pool can verify, not names.

The operator holds one **pool secret** (a Kubernetes Secret, or ``kvpool auth init``) and issues
from it a credential per tenant::

    kvp1.<role>.<tenant>.<namespace>.<mac>

- ``role`` is ``tenant`` (read and write its own namespace), ``operator`` (also: write the shared
  namespace, quotas, listings, drills, acting in ``tenant``'s account) or ``pool`` (the pool's
  own processes: shards and the controller register and publish).
- ``namespace`` is ``HMAC(secret, tenant)``: the salt of every key the tenant derives. Knowing the
  tenant id and the prompt is not enough to compute its keys; the credential is.
- ``mac`` is ``HMAC(secret, role, tenant, namespace)``: nobody without the secret can mint one.

A pool with a secret (**secured**) takes a credential wherever a tenant is named and answers a bare
name or a forged credential with 401. A pool without one (**open**: the embedded single-process
default) takes bare names and trusts its process, which can read the pool's memory anyway.

Besides the credential, chunks live in a **scope** per owner: the store's address of a chunk is
``xxh3_128(scope tag || key)``, where the tag is the authenticated tenant's (or the shared
namespace's). Another tenant's chunk under the same key is simply another address: it can never
be read, skipped over, evicted or overwritten through a tenant's own keys.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import threading
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from kvpool.errors import BadRequest, Forbidden, Unauthorized
from kvpool.keys import ChunkKey

PREFIX = "kvp1"
ROLES = ("tenant", "operator", "pool")
SECRET_ENV = "KVPOOL_SECRET"
SECRET_FILE_ENV = "KVPOOL_SECRET_FILE"
CREDENTIAL_ENV = "KVPOOL_CREDENTIAL"
_MAC_BYTES = 16
_NS_BYTES = 16
_MIN_SECRET = 16
SHARED_TAG = b"kvpool/scope/shared"


class Principal(NamedTuple):
    """An authenticated caller: the tenant whose account it acts in, and its role."""

    tenant: str
    role: str = "tenant"

    @property
    def operator(self) -> bool:
        return self.role in ("operator", "pool")


def _hmac(key: bytes, *parts: str | bytes) -> bytes:
    msg = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(key, msg, hashlib.sha256).digest()


def new_secret() -> str:
    """A fresh pool secret, as text (hex, 256 bits)."""
    return secrets.token_hex(32)


def is_credential(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX + ".")


def parse(credential: str) -> tuple[str, str, bytes, bytes]:
    """(role, tenant, namespace, mac) of a credential's text, or 401 when it is not one."""
    if not isinstance(credential, str):
        raise Unauthorized("not a kvpool credential: ask the operator for one (kvpool auth issue TENANT)")
    return _parse(credential)


@functools.lru_cache(maxsize=4096)  # NOTE: engines parse their few credentials on every call: ~1 us each
def _parse(credential: str) -> tuple[str, str, bytes, bytes]:
    head = credential.split(".", 2)
    tail = head[2].rsplit(".", 2) if len(head) == 3 else []
    if len(tail) != 3 or head[0] != PREFIX or head[1] not in ROLES or not tail[0]:
        raise Unauthorized("not a kvpool credential: ask the operator for one (kvpool auth issue TENANT)")
    try:
        ns, mac = bytes.fromhex(tail[1]), bytes.fromhex(tail[2])
    except ValueError:
        raise Unauthorized("malformed kvpool credential: ask the operator for a new one") from None
    return head[1], tail[0], ns, mac


def claimed_tenant(credential: str) -> str:
    """The tenant a credential names, unverified (a client has no secret to check it with; the
    shards do). A bare name on an open pool is its own."""
    return parse(credential)[1] if is_credential(credential) else credential


def default_credential(env: dict | None = None) -> str:
    """What the pool's tools present when none is given: ``$KVPOOL_CREDENTIAL``, else the pool's
    own credential when this process holds the secret (operators, the pool's processes)."""
    env = os.environ if env is None else env
    return env.get(CREDENTIAL_ENV) or Authority.from_env(env).pool_credential()


def namespace_salt(credential: str) -> bytes:
    """The key salt a credential's holder derives its keys from (no secret needed: it is in the
    credential, and only there)."""
    _, _, ns, _ = parse(credential)
    return b"kvp1/ns/" + ns


def payload_key(credential: str) -> bytes:
    """The 32-byte key a tenant seals its payloads with (kvpool.seal): from the credential's
    namespace, so the tenant and its operator have it and the pool's processes never do."""
    _, tenant, ns, _ = parse(credential)
    return _hmac(ns, "kvpool/payload-key", tenant)


def shard_proof(credential: str, nonce: bytes) -> str:
    """What a shard answers to a client's fresh ``nonce`` to prove it holds the pool secret that
    issued ``credential``, before the client sends it (kvpool.node.connection): the shard issues
    the credential again from the secret, the client holds it, nobody else can make this."""
    return _hmac(credential.encode(), "kvpool/shard-proof", nonce).hex()


def request_secret(credential: str) -> str:
    """What an engine's API user sends with a request (vLLM's ``cache_salt``, SGLang's extra info)
    to be served as the credential's tenant. It derives from the credential's namespace, so it
    cannot be guessed from the tenant id, and it is no credential: it cannot act on the pool."""
    _, tenant, ns, _ = parse(credential)
    return "kvr1." + _hmac(ns, "kvpool/request", tenant)[:16].hex()


class Authority:
    """Issues and verifies credentials with the pool secret; ``Authority(None)`` is an open pool.

    ``verify`` is on every call's path: a credential verified once is remembered (a dict lookup
    after that; a forged one is never remembered)."""

    def __init__(self, secret: bytes | str | None) -> None:
        if isinstance(secret, str):
            secret = secret.strip().encode()
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < _MIN_SECRET):
            raise BadRequest(f"a pool secret has at least {_MIN_SECRET} bytes: make one with `kvpool auth init`")
        self._secret = secret
        self._known: dict[str, Principal] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Authority":
        """The secret in ``$KVPOOL_SECRET_FILE`` (a mounted Kubernetes Secret) or ``$KVPOOL_SECRET``;
        open without either."""
        env = os.environ if env is None else env
        path = env.get(SECRET_FILE_ENV)
        if path:
            from kvpool.private import read_private

            try:
                return cls(read_private(path, "the pool secret", binary=True).strip())
            except OSError as e:
                raise BadRequest(f"{SECRET_FILE_ENV}={path}: cannot read the pool secret ({e.strerror})") from None
        return cls(env.get(SECRET_ENV) or None)

    @property
    def secured(self) -> bool:
        return self._secret is not None

    def prove(self, *parts: str) -> str:
        """A proof that the caller holds the pool secret, bound to ``parts`` (a shard answering a
        controller's challenge: an actor under a shard's name without the secret cannot make it)."""
        return _hmac(self._secret, "kvpool/proof", *parts).hex() if self._secret is not None else ""

    def prove_to(self, role: str, tenant: str, nonce: bytes) -> str:
        """:func:`shard_proof` for the credential this secret issues to ``tenant`` in ``role`` ("" on an
        open pool, which has nothing to prove)."""
        return shard_proof(self.issue(tenant, role), nonce) if self._secret is not None else ""

    def proven(self, proof: object, *parts: str) -> bool:
        return self._secret is None or (isinstance(proof, str) and hmac.compare_digest(proof, self.prove(*parts)))

    def same_secret(self, other: "Authority") -> bool:
        return hmac.compare_digest(self._secret or b"", other._secret or b"") and self.secured == other.secured

    def secret_file_env(self, path: str | None = None) -> dict[str, str]:
        """The environment that tells a pool process (shard, controller) where to read this secret:
        a file's path, never the secret (Ray keeps an actor's environment in its actor table).
        ``path``: a file every node has (a mounted Secret); else a private copy (0600 in a 0700
        folder under ``~/.kvpool``, named by the secret's hash) that the processes of a pool on
        this machine read."""
        if self._secret is None:
            return {}
        if path is None:
            folder = os.path.expanduser(os.path.join("~", ".kvpool", "pool-secrets"))
            os.makedirs(folder, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)
            path = os.path.join(folder, hashlib.sha256(self._secret).hexdigest()[:24])
            if not os.path.exists(path):
                tmp = f"{path}.{os.getpid()}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(self._secret)
                os.replace(tmp, path)
        return {SECRET_FILE_ENV: os.path.abspath(path)}

    # ------------------------------------------------------------------ issuing
    def _ns(self, tenant: str) -> bytes:
        return _hmac(self._secret, "kvpool/namespace", tenant)[:_NS_BYTES]

    def issue(self, tenant: str, role: str = "tenant") -> str:
        """A credential for ``tenant`` in ``role``; an open pool's is the bare name."""
        if role not in ROLES:
            raise BadRequest(f"role must be one of {ROLES}, got {role!r}")
        if not isinstance(tenant, str) or not tenant:
            raise BadRequest(f"a credential names a tenant id, got {tenant!r}")
        if self._secret is None:
            return tenant
        ns = self._ns(tenant)
        mac = _hmac(self._secret, "kvpool/credential", role, tenant, ns)[:_MAC_BYTES]
        return f"{PREFIX}.{role}.{tenant}.{ns.hex()}.{mac.hex()}"

    def pool_credential(self) -> str:
        """What the pool's own processes present to each other (registering shards, publishing)."""
        return self.issue("kvpool", "pool")

    # ------------------------------------------------------------------ verifying
    def verify(self, credential: str) -> Principal:
        """The caller behind ``credential``, or 401. An open pool takes a bare tenant id (and
        trusts its process: every caller may act as operator)."""
        p = self._known.get(credential) if isinstance(credential, str) else None
        if p is not None:
            return p
        if self._secret is None:
            if is_credential(credential):
                raise Unauthorized("this pool is open (no pool secret): pass the tenant id, not a credential")
            if not isinstance(credential, str):
                raise BadRequest(f"a tenant id is a string, got {type(credential).__name__}")
            return Principal(credential, "operator")
        if not is_credential(credential):
            raise Unauthorized(
                f"this pool is secured: pass the tenant's credential, not {_shown(credential)} "
                "(the operator issues it: kvpool auth issue TENANT)")
        role, tenant, ns, mac = parse(credential)
        want = _hmac(self._secret, "kvpool/credential", role, tenant, ns)[:_MAC_BYTES]
        if not hmac.compare_digest(mac, want) or not hmac.compare_digest(ns, self._ns(tenant)):
            raise Unauthorized(f"credential for {tenant!r} does not verify against this pool's secret")
        p = Principal(tenant, role)
        with self._lock:
            if len(self._known) > 100_000:  # bounded: a flood of valid credentials cannot grow it forever
                self._known.clear()
            self._known[credential] = p
        return p

    def tenant_of(self, credential: str) -> str:
        return self.verify(credential).tenant

    def require(self, credential: str, what: str, role: str = "operator") -> Principal:
        """The caller, who must be an operator (or, with ``role="pool"``, one of the pool's own
        processes), else 403."""
        p = self.verify(credential)
        if self._secret is None:
            return p  # an open pool trusts its callers
        if role == "pool" and p.role != "pool" or role == "operator" and not p.operator:
            raise Forbidden(f"{what} needs a{'n' if role == 'operator' else ''} {role} credential; "
                            f"{p.tenant!r} presented a {p.role} one")
        return p


def _shown(value: object) -> str:
    return repr(value) if isinstance(value, str) and len(value) <= 64 else type(value).__name__


# ---------------------------------------------------------------------- scopes
def scope_tag(tenant: str | None) -> bytes:
    """The scope of a tenant's own chunks (``None``: the shared namespace)."""
    return SHARED_TAG if tenant is None else b"kvpool/scope/tenant\0" + tenant.encode()


def scoped(keys: Sequence[bytes], tag: bytes) -> list[ChunkKey]:
    """The store's addresses of ``keys`` in scope ``tag``."""
    digest = xxhash.xxh3_128_digest
    make = bytes.__new__  # NOTE: skips ChunkKey's length check; a 128-bit digest is 16 bytes
    return [make(ChunkKey, digest(tag + k)) for k in keys]
