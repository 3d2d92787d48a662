"""RedisIndex: the index contract on a Redis server, for a cluster of shards.

- Connection by URL: ``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, ACL users.
- Every call has a timeout. Writes retry with exponential backoff, then raise ``Unavailable``
  (503). Reads (lookup, get) never raise: on any failure they answer a miss, and for ``backoff``
  seconds after one they answer a miss without trying (a breaker), so a dead Redis costs a
  request at most one timeout, not one per call.
- Every multi-key step is one Lua script (kvpool.index.redis_lua): publish+charge and
  remove+refund are atomic, so racing writers never overrun a quota.
- Redis ACL users per role (kvpool.index.redis_acl): a write the URL's user may not make is a 403
  ``Forbidden`` naming the role it needs; a read it may not make is a miss. The read path (lookup,
  get) is plain GET/MGET of chunk entries, so the read-only ``engine`` user serves it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvpool.errors import BadRequest, Forbidden, QuotaExceeded, Unavailable, UnknownTenant
from kvpool.index import base as checks
from kvpool.index.base import MISS, Event, Index, IndexEntry, PrefixHit, ReconcileResult, TenantInfo
from kvpool.index.redis_keys import Keys
from kvpool.index.redis_lua import PUBLISH, REMOVE, SETTLE
from kvpool.keys import KEY_BYTES, ChunkKey
from kvpool.tenants import UNLIMITED

log = logging.getLogger("kvpool.index")
_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")  # NOTE: not .port, which raises on a bad port
    netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _noperm(e: Exception) -> bool:
    """A refusal by the Redis ACL: NOPERM from a command, or from a redis.call inside a script."""
    text = str(e)  # NOTE: Redis 7.0 words a script's refusal without the NOPERM code
    return isinstance(e, redis.exceptions.NoPermissionError) or any(
        w in text for w in ("NOPERM", "no permissions", "can't access at least one of the keys"))


# The role (kvpool.index.redis_acl) whose user may make each write; named in a 403.
_ROLE_OF = {what: "shard" for what in ("publish", "remove", "register_shard", "heartbeat", "register a tenant",
                                        "shards", "purge", "shard_keys", "epoch", "reconcile")}


class RedisIndex(Index):
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "kvp", timeout_s: float = 1.0,
                 read_timeout_s: float = 0.25, backoff_s: float = 0.5, max_events: int = 100_000) -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            shown = redact(url) if isinstance(url, str) else url
            raise BadRequest(f"index URL {shown!r} must start with redis://, rediss:// or unix://")
        checks.check_name("index prefix", prefix)
        for name, v in (("timeout_s", timeout_s), ("read_timeout_s", read_timeout_s), ("backoff_s", backoff_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
                raise BadRequest(f"{name} must be a finite number of seconds > 0, got {v!r}")
        self.url = redact(url)
        self.keys = Keys(prefix)
        self._prefix = prefix
        self._maxlen = str(checks.check_max_events(max_events))
        retry = Retry(ExponentialBackoff(cap=timeout_s, base=0.05), retries=3)
        try:
            self._w = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=retry, retry_on_error=list(_ERRORS))
            self._r = redis.Redis.from_url(url, socket_timeout=read_timeout_s,
                                           socket_connect_timeout=read_timeout_s,
                                           retry=Retry(ExponentialBackoff(), retries=0))
        except ValueError as e:  # a port or db that is not a number, and the like
            raise BadRequest(
                f"index URL {self.url!r} is malformed ({e}): use redis://[user:password@]host:port/db"
            ) from None
        self._publish = self._w.register_script(PUBLISH)
        self._remove = self._w.register_script(REMOVE)
        self._settle = self._w.register_script(SETTLE)
        self._backoff = backoff_s
        self._down_until = 0.0
        self._names: dict[bytes, str] = {}
        self.read_errors = 0

    # ---------------------------------------------------------------- plumbing
    def _write(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except _ERRORS as e:
            raise Unavailable(f"index at {self.url} did not answer ({what}): {type(e).__name__}; "
                              "the write was not applied, retry later") from None
        except redis.exceptions.ResponseError as e:
            if not _noperm(e):
                raise
            raise Forbidden(f"index at {self.url}: this URL's Redis user may not {what} (NOPERM): use the "
                            f"{_ROLE_OF.get(what, 'operator')} user's URL (roles: kvpool.index.redis_acl)") from None

    def _read(self, fn, *args):
        """A read that never raises: (result, None) or (None, error text)."""
        now = time.monotonic()
        if now < self._down_until:
            return None, "index unavailable (backing off)"
        try:
            return fn(*args), None
        except redis.exceptions.ResponseError as e:
            if not _noperm(e):
                raise
            return None, "index refused the read: this URL's Redis user may not read chunk entries (NOPERM)"
        except _ERRORS as e:
            self.read_errors += 1
            self._down_until = now + self._backoff
            log.warning("index at %s: read failed (%s); answering misses for %.1fs", self.url, type(e).__name__,
                        self._backoff)
            return None, f"index unavailable: {type(e).__name__}"

    def ping(self) -> bool:
        ok, _ = self._read(self._r.ping)
        return bool(ok)

    def check(self, timeout_s: float = 3.0) -> None:
        """Raises Unavailable (503) naming the URL unless the server answers a PING in ``timeout_s``
        (before a pool starts on it: its actors would otherwise die with an untyped error)."""
        import redis as _redis

        url_shown = self.url
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._r.ping()
                return
            except _ERRORS as e:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"the index at {url_shown} does not answer ({type(e).__name__}): start Redis "
                                      "there or pass the right URL") from None
                time.sleep(0.1)
            except _redis.exceptions.ResponseError as e:  # AUTH and the like: it answers
                if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                    raise Unavailable(f"the index at {url_shown} refused this URL's credentials ({e})") from None
                return

    # ---------------------------------------------------------------- tenants
    def add_tenant(self, tenant: str, quota: int = UNLIMITED, priority: str = "normal") -> None:
        """Creates the tenant if it is new (HSETNX: what a shard's user may do), then updates a
        known tenant's quota and priority when they differ (HSET: only an operator's user may)."""
        checks.check_name("tenant", tenant)
        quota, priority = checks.check_quota(quota), checks.check_priority(priority)
        key = self.keys.tenant(tenant)
        pipe = self._w.pipeline(transaction=True)
        pipe.hsetnx(key, "quota", quota)
        pipe.hsetnx(key, "priority", priority)
        pipe.incrby(self.keys.usage(tenant), 0)
        pipe.sadd(self.keys.tenants, tenant)
        new_quota, new_priority, *_ = self._write("register a tenant", pipe.execute)
        if new_quota and new_priority:
            return
        q, p = self._write("tenant", self._w.hmget, key, "quota", "priority")
        if (int(q or UNLIMITED), (p or b"normal").decode()) != (quota, priority):
            self._write("set_quota", self._w.hset, key, mapping={"quota": quota, "priority": priority})

    def _require_tenant(self, tenant: str) -> None:
        if not self._write("tenant", self._w.exists, self.keys.tenant(tenant)):
            raise UnknownTenant(tenant)

    def set_quota(self, tenant: str, quota: int) -> None:
        checks.check_name("tenant", tenant)
        quota = checks.check_quota(quota)
        self._require_tenant(tenant)
        self._write("set_quota", self._w.hset, self.keys.tenant(tenant), "quota", quota)

    def set_priority(self, tenant: str, priority: str) -> None:
        checks.check_name("tenant", tenant)
        priority = checks.check_priority(priority)
        self._require_tenant(tenant)
        self._write("set_priority", self._w.hset, self.keys.tenant(tenant), "priority", priority)

    def tenants(self) -> list[TenantInfo]:
        ids = sorted(t.decode() for t in self._write("tenants", self._w.smembers, self.keys.tenants))
        pipe = self._w.pipeline(transaction=False)
        for t in ids:
            pipe.hmget(self.keys.tenant(t), "quota", "priority")
            pipe.get(self.keys.usage(t))
        rows = self._write("tenants", pipe.execute)
        return [TenantInfo(t, int(u or 0), int(q or UNLIMITED), (p or b"normal").decode())
                for t, (q, p), u in zip(ids, rows[0::2], rows[1::2])]

    def usage(self, tenant: str) -> int:
        checks.check_name("tenant", tenant)
        self._require_tenant(tenant)
        return int(self._write("usage", self._w.get, self.keys.usage(tenant)) or 0)

    # ---------------------------------------------------------------- chunks
    def publish(self, entries: Sequence[IndexEntry]) -> list[bool]:
        entries = checks.check_entries(entries)
        if not entries:
            return []
        argv: list[object] = [self._prefix, self._maxlen]
        for e in entries:
            argv += [bytes(e.key), e.encode(), e.tenant, e.nbytes, e.shard]
        res = self._write("publish", self._publish, args=argv)
        code = int(res[0])
        if code == -1:
            raise QuotaExceeded(res[1].decode(), int(float(res[2])), int(float(res[3])), int(float(res[4])))
        if code == -2:
            raise BadRequest(f"unknown shard {res[1].decode()!r}: register it before publishing")
        if code == -3:
            raise UnknownTenant(res[1].decode())
        return [bool(x) for x in res[1:]]

    def remove(self, keys: Sequence[ChunkKey], shard: str | None = None) -> int:
        keys = checks.check_keys(keys)
        if shard is not None:
            checks.check_name("shard id", shard)
        if not keys:
            return 0
        argv = [self._prefix, self._maxlen, shard or "", *(bytes(k) for k in keys)]
        return int(self._write("remove", self._remove, args=argv))

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixHit:
        try:
            keys = checks.check_lookup_keys(keys)
        except BadRequest as e:
            return PrefixHit(0, error=str(e))
        if not keys:
            return MISS
        chunk = self.keys.chunk
        raw, err = self._read(self._r.mget, [chunk(k) for k in keys])
        if raw is None:
            return PrefixHit(0, error=err)
        shards, tiers = [], []
        names = self._names  # b"shard" -> "shard": a pool has few shards and tiers; decode each once
        for v in raw:
            if v is None:
                break
            parts = v.split(b"\0", 2)
            if len(parts) != 3:
                break  # a malformed entry is a miss (get() says why)
            s, t = parts[0], parts[1]
            shard, tier = names.get(s), names.get(t)
            if shard is None or tier is None:
                try:
                    shard, tier = names.setdefault(s, s.decode()), names.setdefault(t, t.decode())
                except UnicodeDecodeError:
                    break
            shards.append(shard)
            tiers.append(tier)
        return PrefixHit(len(shards), tuple(shards), tuple(tiers)) if shards else MISS

    def get(self, key: ChunkKey) -> IndexEntry | None:
        (key,) = checks.check_keys([key])
        raw, _ = self._read(self._r.get, self.keys.chunk(key))
        if raw is None:
            return None
        try:
            return IndexEntry.decode(key, raw)
        except BadRequest as e:  # a read never raises: a corrupt entry is a miss
            log.warning("index at %s: %s", self.url, e.message)
            return None

    # ---------------------------------------------------------------- membership
    def register_shard(self, shard: str, address: str = "", ttl_s: float = 10.0) -> None:
        checks.check_name("shard id", shard)
        address, ttl_s = checks.check_address(address), checks.check_ttl(ttl_s)
        pipe = self._w.pipeline(transaction=True)
        pipe.hset(self.keys.shards, shard, address)
        pipe.set(self.keys.heartbeat(shard), 1, px=max(1, int(ttl_s * 1000)))
        self._write("register_shard", pipe.execute)

    def heartbeat(self, shard: str, ttl_s: float = 10.0) -> None:
        checks.check_name("shard id", shard)
        ttl_s = checks.check_ttl(ttl_s)
        if not self._write("heartbeat", self._w.hexists, self.keys.shards, shard):
            raise BadRequest(f"unknown shard {shard!r}: register it first")
        self._write("heartbeat", self._w.set, self.keys.heartbeat(shard), 1, px=max(1, int(ttl_s * 1000)))

    def shards(self) -> dict[str, bool]:
        ids = sorted(s.decode() for s in self._write("shards", self._w.hkeys, self.keys.shards))
        if not ids:
            return {}
        alive = self._write("shards", self._w.mget, [self.keys.heartbeat(s) for s in ids])
        return {s: a is not None for s, a in zip(ids, alive)}

    def purge_dead(self) -> dict[str, int]:
        return {shard: self.forget_shard(shard) for shard, alive in self.shards().items() if not alive}

    def forget_shard(self, shard: str, batch: int = 512) -> int:
        checks.check_name("shard id", shard)
        n = 0
        members = list(self._write("purge", self._w.smembers, self.keys.shard_set(shard)))
        for i in range(0, len(members), batch):
            argv = [self._prefix, self._maxlen, shard, *members[i : i + batch]]
            n += int(self._write("purge", self._remove, args=argv))
        pipe = self._w.pipeline(transaction=True)
        pipe.hdel(self.keys.shards, shard)
        pipe.delete(self.keys.shard_set(shard), self.keys.heartbeat(shard))
        pipe.delete(self.keys.shard_usage(shard), self.keys.shard_charges(shard))  # NOTE: another ACL selector
        self._write("purge", pipe.execute)
        log.info("index: forgot shard %s (%d entries)", shard, n)
        return n

    def reconcile(self, shard: str, held: Sequence[IndexEntry]) -> ReconcileResult:
        """Checks the shard's store against the chunk entries present, not against its own key
        set, and settles its tenants' usage from what is indexed (kvpool.index.redis_reconcile)."""
        from kvpool.index.redis_reconcile import reconcile

        return reconcile(self, shard, held)

    def epoch(self) -> str | None:
        v = self._write("epoch", self._w.get, self.keys.epoch)
        return None if v is None else v.decode()

    def set_epoch(self, token: str) -> None:
        self._write("epoch", self._w.set, self.keys.epoch, token)

    def shard_keys(self, shard: str) -> set[ChunkKey]:
        checks.check_name("shard id", shard)
        members = self._write("shard_keys", self._w.smembers, self.keys.shard_set(shard))
        return {ChunkKey(k) for k in members if len(k) == KEY_BYTES}  # NOTE: anything else is not a chunk key

    # ---------------------------------------------------------------- events
    def events(self, after: str = "0-0", count: int = 1000) -> list[Event]:
        after, count = checks.check_event_query(after, count)
        rows = self._write("events", self._w.xrange, self.keys.events, min=f"({after}", count=count)
        out = []
        for eid, f in rows:
            out.append(Event(eid.decode(), f[b"kind"].decode(), ChunkKey(f[b"key"]), f[b"shard"].decode(),
                             f[b"tenant"].decode()))
        return out

    def flush(self) -> None:
        """Deletes every key of this pool's prefix (tests, and `kvpool down --purge`)."""
        for k in self._write("flush", lambda: list(self._w.scan_iter(match=f"{self._prefix}:*", count=1000))):
            self._write("flush", self._w.delete, k)

    def close(self) -> None:
        self._w.close()
        self._r.close()
