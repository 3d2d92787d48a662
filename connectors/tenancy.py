"""Which tenant an engine serves a request as: from a secret the request carries, never from a
name it gives.

An engine's API users reach it directly (vLLM's OpenAI server, SGLang's); anything a request says
is the user's word. So a request names its tenant by a **request secret** (vLLM's ``cache_salt``,
SGLang's ``extra_info["kvpool_secret"]``), which the connector looks up in a map built here from
its config (:mod:`kvpool.connectors.pools`):

- a tenant's request secret is its ``request_secret`` when the config gives one, else
  :func:`kvpool.auth.request_secret` of its credential (``kvr1.<hex>``, which only the holder of
  the credential, or of the pool secret, can compute), when it has one;
- its credential is its ``credential``, else its entry in ``credentials_file`` (for a "node" pool
  without one, ``~/.kvpool/credentials.json`` when it exists: where `kvpool connect` writes), else
  ``$KVPOOL_CREDENTIAL`` when that names it; a secured local pool (``secret_file``,
  ``$KVPOOL_SECRET_FILE``, ``$KVPOOL_SECRET``) issues the others here. On a secured pool every
  configured tenant needs one, and the pool is passed the credential; on an open pool, the id.

A request is then served as:

- no secret: the config's ``tenant`` (the engine's default tenant);
- a secret in the map: that tenant;
- any other secret: **no tenant**, the request is not cached by the pool at all (no load, no
  save; counted ``rejected_credential``, logged without the secret): a guessed or stale secret
  neither reads a tenant's prefixes nor fills anyone's quota;
- a tenant *name* the request gives (vLLM's ``kv_transfer_params["kvpool_tenant"]``, SGLang's
  ``extra_info["tenant"]``, the old way) is ignored (counted ``ignored_tenant_name``, logged once):
  the request goes on as if it named none.

On an open pool without explicit ``request_secret`` s no tenant has a request secret, so requests
reach the default tenant only (said in a log line at start).

NOTE: the map is keyed by the secret's SHA-256, so a lookup costs one hash and one dict probe
whatever the secret, and no secret is kept or logged as text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from typing import Any, NamedTuple

from kvpool.auth import CREDENTIAL_ENV, Authority, claimed_tenant, is_credential, request_secret
from kvpool.connect_cli import DEFAULT_CREDENTIALS
from kvpool.connectors.pools import check_config, pool_authority
from kvpool.errors import BadRequest, KvPoolError

log = logging.getLogger("kvpool.connectors.tenancy")

MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 128  # vLLM's limit for a cache_salt
_FORBIDDEN_CHARS = ("@", "/", "\\", "\0")  # vLLM refuses them in a cache_salt
_WARN_EVERY_S = 60.0


class Route(NamedTuple):
    """Where a request goes: its tenant's id (logs, counters) and what the pool is passed as the
    tenant (the credential on a secured pool, the id on an open one)."""

    tenant: str
    pool_as: str


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


class Tenancy:
    """The request-secret -> tenant map of one connector (see the module docstring).

    ``fallback`` is the default tenant when the config has no ``tenant`` (vLLM: ``"default"``;
    SGLang: the first of ``tenants``); ``engine`` names the connector in log lines."""

    def __init__(self, config: dict[str, Any], *, fallback: str | None = None, engine: str = "kvpool",
                 env: dict[str, str] | None = None) -> None:
        cfg = check_config(config)
        self.engine = engine
        entries = {t if isinstance(t, str) else t["id"]: ({} if isinstance(t, str) else t) for t in cfg["tenants"]}
        ids = list(entries)
        default = cfg.get("tenant") or fallback or (ids[0] if ids else "default")
        if default not in entries:
            raise BadRequest(f"{engine}: tenant {default!r} is not one of the pool's tenants {ids}; add it to "
                             "the config's tenants")
        authority = pool_authority(cfg)
        creds = self._credentials(cfg, entries, authority, os.environ if env is None else env)
        self.secured = authority.secured or bool(creds)
        # NOTE: a "node" pool is asked at start for every tenant (connectors.pool_start), which names
        # each missing credential's fix with what the pool says; only where it is not asked (a pool in
        # the process, or started degraded) is a missing one refused here
        if self.secured and (cfg["backend"] != "node" or cfg.get("degraded")):
            missing = [t for t in ids if t not in creds]
            if missing:
                raise BadRequest(f"{engine}: the pool is secured but tenants {missing} have no credential: add them "
                                 "to credentials_file or give each a 'credential' (kvpool auth issue TENANT)")
        self.routes = {t: Route(t, creds.get(t, t)) for t in ids}
        self.default = self.routes[default]
        self._by_secret: dict[bytes, Route] = {}
        for t, entry in entries.items():
            secret = entry.get("request_secret")
            if secret is not None:
                _check_secret(t, secret, ids)
            elif is_credential(creds.get(t)):
                secret = request_secret(creds[t])
            if secret is None:
                continue
            d = _digest(secret)
            if d in self._by_secret:
                raise BadRequest(f"{engine}: tenants {self._by_secret[d].tenant!r} and {t!r} have the same request "
                                 "secret; give each its own")
            self._by_secret[d] = self.routes[t]
        self.reachable = sorted(r.tenant for r in self._by_secret.values())
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._named_logged = False
        self._rejected_logged = 0.0
        self._announce(ids)

    def pool_routes(self) -> dict[str, str]:
        """tenant id -> what the pool is passed as that tenant (to verify them at start)."""
        return {t: r.pool_as for t, r in self.routes.items()}

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _credentials(cfg: dict, entries: dict[str, dict], authority: Authority, env: dict) -> dict[str, str]:
        """tenant id -> credential, each checked to name its tenant (and to verify, where the
        pool's secret is here); issued here for the rest on a secured local pool."""
        given: dict[str, tuple[str, str]] = {}  # tenant -> (credential, where it came from)
        env_cred = env.get(CREDENTIAL_ENV)
        if env_cred and (authority.secured or cfg["backend"] != "local"):
            t = claimed_tenant(env_cred) if is_credential(env_cred) else None
            if t in entries:
                given[t] = (env_cred, f"${CREDENTIAL_ENV}")
        path = cfg.get("credentials_file")
        if not path and cfg["backend"] == "node" and os.path.exists(os.path.expanduser(DEFAULT_CREDENTIALS)):
            path = os.path.expanduser(DEFAULT_CREDENTIALS)  # where `kvpool connect` writes them
        if path:
            for t, c in _read_credentials(path).items():
                if t in entries:  # a Secret may hold every tenant's; this engine serves some
                    given[t] = (c, path)
        for t, entry in entries.items():
            if "credential" in entry:
                given[t] = (entry["credential"], f"tenants[{t!r}]")
        if given and cfg["backend"] == "local" and not authority.secured:
            raise BadRequest("credentials are given for a local pool that has no pool secret: set secret_file "
                             "(or $KVPOOL_SECRET_FILE) to the secret they were issued with, or drop them")
        out = {}
        for t, (c, where) in given.items():
            try:
                named = claimed_tenant(c) if is_credential(c) else None
                if named == t and authority.secured:
                    authority.verify(c)
            except KvPoolError as e:
                raise BadRequest(f"credential for tenant {t!r} from {where}: {e}") from None
            if named != t:
                raise BadRequest(f"the credential for tenant {t!r} from {where} is "
                                 f"{'for ' + repr(named) if named else 'not a kvpool credential'}")
            out[t] = c
        if authority.secured:
            for t in entries:
                out.setdefault(t, authority.issue(t))
        return out

    def _announce(self, ids: list[str]) -> None:
        kind = "secured" if self.secured else "open"
        if self.reachable:
            log.info("%s: %s pool; requests without a request secret are served as tenant %r, requests with one "
                     "as its tenant (%s); other secrets are not cached", self.engine, kind, self.default.tenant,
                     ", ".join(self.reachable))
        else:
            log.info("%s: %s pool with no request secrets: every request is served as tenant %r (tenants %s "
                     "are reachable only with a request_secret or a credential in the config)", self.engine, kind,
                     self.default.tenant, [t for t in ids if t != self.default.tenant])

    # ------------------------------------------------------------------ per request
    def route(self, secret: object, named: object = None, request: str = "") -> Route | None:
        """The tenant a request with ``secret`` (None or "" for none) is served as, or None: not
        cached. ``named``: a tenant name the request gave itself, ignored (counted)."""
        if named is not None and named != "":
            self._count("ignored_tenant_name")
            if not self._named_logged:
                self._named_logged = True
                log.warning("%s: request %s names a tenant itself; that is ignored (a request is served as the "
                            "tenant of its request secret, else as %r). Logged once.", self.engine, request,
                            self.default.tenant)
        r = self.of_secret(secret)
        if r is None:
            n = self._count("rejected_credential")
            now = time.monotonic()
            if now - self._rejected_logged >= _WARN_EVERY_S:
                self._rejected_logged = now
                log.warning("%s: request %s carries a request secret that is no tenant's: not cached (%d such "
                            "requests so far)", self.engine, request, n)
        return r

    def of_secret(self, secret: object) -> Route | None:
        """The tenant of a request secret (None or "": the default tenant; anyone else's: None),
        without counting or logging it (a router reading vLLM's KV events sees every request's)."""
        if secret is None or secret == "":
            return self.default
        return self._by_secret.get(_digest(secret)) if isinstance(secret, str) else None

    def _count(self, name: str) -> int:
        with self._lock:
            n = self._counts[name] = self._counts.get(name, 0) + 1
        return n

    def stats(self) -> dict[str, int]:
        """Counters: ``rejected_credential``, ``ignored_tenant_name`` (present once counted)."""
        with self._lock:
            return dict(self._counts)


def _check_secret(tenant: str, secret: str, ids: list[str]) -> None:
    """An explicit request secret: long enough not to be guessed, usable as vLLM's cache_salt, and
    no tenant's id. Never shown in the error."""
    if not (MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS) or any(c in secret for c in _FORBIDDEN_CHARS):
        raise BadRequest(f"tenant {tenant!r}: request_secret must be {MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} "
                         f"characters without {' '.join(repr(c) for c in _FORBIDDEN_CHARS)} (make one with "
                         "`python -c 'import secrets; print(secrets.token_hex(16))'`)")
    if secret in ids:
        raise BadRequest(f"tenant {tenant!r}: request_secret is a tenant id; pick a secret nobody can guess")


def _read_credentials(path: str) -> dict[str, str]:
    """``{tenant: credential}`` from a JSON file; errors name the file, never a credential."""
    from kvpool.private import read_private

    try:
        text = read_private(path, "credentials_file")  # a file others can read: refused, naming the chmod
    except OSError as e:
        raise BadRequest(f"credentials_file {path}: cannot read it ({e.strerror}): `kvpool connect vllm|sglang "
                         f"--credentials-file {path}` on the pool's node writes it") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise BadRequest(f"credentials_file {path}: not JSON (it holds {{\"tenant\": \"kvp1...\"}})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                             for k, v in data.items()):
        raise BadRequest(f"credentials_file {path}: must be a JSON object of tenant id -> credential string")
    return {k: v.strip() for k, v in data.items()}
