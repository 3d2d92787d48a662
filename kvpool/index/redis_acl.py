"""Redis ACL users per role for the index, in one place (the Helm chart's users file is generated
from here: ``python -m kvpool.index.redis_acl --template``, checked by tests/test_redis_acl.py).

| role | who | may |
|---|---|---|
| ``operator`` | ``kvpool tenants``, the chart's `kvpool up` Job | everything under the pool's prefix (quotas, priorities, events, flush) but Redis's dangerous admin commands |
| ``shard`` | the pool's own processes: shards, controller | the Lua scripts of publish/remove (charge and refund usage, events), register/heartbeat/purge shards, reconcile, read every index key, create a tenant that does not exist yet; never write a quota or priority |
| ``engine`` | engines (the client's lookups) | read chunk entries (GET/MGET): no quota, usage or membership writes, no events, no listing of keys |

Every write is bound to its keys with ACL selectors (Redis 7): a shard's ``SET`` reaches chunk
entries and heartbeats, never a tenant's quota; ``HSETNX`` reaches tenants (create-only: an
existing quota cannot change). The scripts run with the caller's ACL, so loading one grants nothing.
Key scheme: kvpool.index.redis_keys.

``check_locked`` is what ``kvpool up --redis`` asks first: a Redis that anyone reaching its port may
write without a password is refused (``--insecure-redis`` runs on it, with a warning). ``python -m
kvpool.index.redis_acl --apply URL --lock-default`` makes the users on a running Redis.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
from urllib.parse import urlsplit, urlunsplit

from kvpool.index.base import check_name

ROLES = ("operator", "shard", "engine")
USERS = {"operator": "kvpool-operator", "shard": "kvpool-shard", "engine": "kvpool-engine"}
# NOTE: what redis-py sends on connecting (SELECT for a db other than 0, HELLO for RESP3); AUTH
# needs no permission. CLIENT SETINFO (Redis >= 7.2) is left out: redis-py ignores its refusal.
_CONNECT = ["+ping", "+hello", "+select"]
_READS = ["+get", "+mget", "+exists", "+hexists", "+hget", "+hmget", "+hkeys", "+hgetall", "+smembers"]


def rules(role: str, prefix: str = "kvp") -> list[str]:
    """The ACL rules of ``role`` for the pool keyed under ``prefix``, one ACL SETUSER argument each
    (a selector is one argument, in parentheses). No user name, state or password."""
    check_name("index prefix", prefix)
    if any(c in prefix for c in "*?[]\\"):  # NOTE: check_name allows none of these today; a pattern must stay literal
        raise ValueError(f"index prefix {prefix!r} has a glob character")
    p = prefix
    base = ["resetkeys", "resetchannels", "-@all", *_CONNECT]
    if role == "operator":
        return ["resetkeys", "resetchannels", f"~{p}:*", "+@all", "-@dangerous"]
    if role == "engine":
        return [*base, "+get", "+mget", f"%R~{p}:c:*"]
    if role == "shard":
        return [*base, *_READS, "+multi", "+exec", "+discard", "+evalsha", "+script|load", f"%R~{p}:*",
                # chunk entries, the shards' key sets, heartbeats (publish, remove, purge, heartbeat)
                f"(~{p}:c:* ~{p}:s:* ~{p}:hb:* +set +del +sadd +srem)",
                f"(%W~{p}:shards +hset +hdel)",  # membership
                f"(~{p}:u:* +incrby)",  # usage: charged and refunded, never the quota beside it
                f"(~{p}:su:* ~{p}:sv:* +hincrby +hset +hdel +del)",  # each shard's part of it (reconcile settles it)
                f"(%W~{p}:t:* +hsetnx)",  # a new tenant (create-only)
                f"(%W~{p}:tenants +sadd)",
                f"(%W~{p}:events +xadd)",
                f"(%W~{p}:epoch +set)"]  # the controller's token (kvpool.index.base.Index.epoch)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def setuser_args(role: str, password: str, prefix: str = "kvp", user: str | None = None) -> list[str]:
    """``ACL SETUSER`` arguments (the user's name first) that make ``role``'s user from scratch."""
    return [user or USERS[role], "reset", "on", f">{password}", *rules(role, prefix)]


def password_hash(password: str) -> str:
    """What an ACL file holds instead of a password (``#`` + SHA-256, Redis's own form)."""
    return hashlib.sha256(password.encode()).hexdigest()


def _line(user: str, secret: str, role_rules: list[str]) -> str:
    return " ".join(["user", user, "on", f"#{secret}", *role_rules])


def aclfile(passwords: dict[str, str], prefix: str = "kvp", admin_password: str | None = None) -> str:
    """An ACL file (``redis-server --aclfile``) with a user per role of ``passwords`` and, given
    ``admin_password``, the ``default`` user as the administrator; without it ``default`` is off."""
    lines = [_line("default", password_hash(admin_password), ["~*", "&*", "+@all"]) if admin_password
             else "user default off resetkeys -@all"]
    lines += [_line(USERS[r], password_hash(passwords[r]), rules(r, prefix)) for r in ROLES if r in passwords]
    return "\n".join(lines) + "\n"


def template(prefix: str = "kvp") -> str:
    """The ACL file with ``@@<ROLE>_SHA256@@`` (and ``@@DEFAULT_SHA256@@``) where the password
    hashes go: the Helm chart fills them in from its Secret when Redis starts."""
    lines = [_line("default", "@@DEFAULT_SHA256@@", ["~*", "&*", "+@all"])]
    lines += [_line(USERS[r], f"@@{r.upper()}_SHA256@@", rules(r, prefix)) for r in ROLES]
    return "\n".join(lines) + "\n"


def _anonymous(url: str) -> str:
    """``url`` without its user and password: what anyone who reaches the server connects as."""
    parts = urlsplit(url)
    hostport = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))


LOCK = ("give it the ACL users of kvpool's roles and the default user a password (`python -m kvpool.index.redis_acl "
        "--apply URL --lock-default` does both and prints each role's URL; the Helm chart's Redis has them), then "
        "pass the shard user's URL")


def check_locked(url: str, insecure: bool = False, prefix: str = "kvp", timeout_s: float = 3.0) -> bool:
    """Whether the Redis at ``url`` is locked: a connection without user or password (anyone who
    reaches the port) may not touch the pool's keys. An open one is a BadRequest naming the fix,
    or with ``insecure`` a loud warning on stderr; False then. Unreachable: Unavailable (503)."""
    import redis

    from kvpool.errors import BadRequest, Unavailable
    from kvpool.index.redis_index import redact

    check_name("index prefix", prefix)
    shown = redact(url)
    try:
        r = redis.Redis.from_url(_anonymous(url), socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    except ValueError as e:
        raise BadRequest(f"index URL {shown!r} is malformed ({e}): use redis://[user:password@]host:port/db") from None
    probe = secrets.token_hex(8)
    opened = []  # what an anonymous connection may do to the pool's keys
    try:
        for what, key in (("delete chunk entries", f"{prefix}:c:{probe}"), ("delete quotas", f"{prefix}:t:{probe}"),
                          ("rewrite usage", f"{prefix}:u:{probe}")):
            try:
                r.delete(key)  # a key nobody uses: a write that changes nothing
                opened.append(what)
            except redis.exceptions.ResponseError as e:
                text = str(e)
                if "NOAUTH" in text or "WRONGPASS" in text or "uthentication required" in text:
                    return True  # every command needs a password
                if "NOPERM" not in text and "no permissions" not in text:
                    raise
    except redis.exceptions.AuthenticationError:
        return True  # NOAUTH: every command needs a password
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        raise Unavailable(f"the index at {shown} does not answer ({type(e).__name__}): start Redis there or pass the "
                          "right URL") from None
    finally:
        r.close()
    if not opened:
        return True
    said = (f"the Redis at {shown} is open: anyone who reaches it, without a password, may "
            f"{', '.join(opened)} (and so turn any tenant's hits into misses or its writes into 429s)")
    if not insecure:
        raise BadRequest(f"{said}: {LOCK}; or pass --insecure-redis to run on it anyway")
    print(f"kvpool: WARNING: {said}; running on it anyway (--insecure-redis). To lock it, {LOCK}.", file=sys.stderr)
    return False


def apply(url: str, prefix: str = "kvp", lock_default: bool = False) -> dict[str, str]:
    """Makes the user of every role on the Redis at ``url`` (an administrator's URL) with a new
    password; each role's URL (``"default"``: the administrator's, when ``lock_default`` gave the
    default user a new password, which locks the server: check_locked then holds)."""
    import redis

    parts = urlsplit(url)
    hostport = parts.netloc.rpartition("@")[2]

    def url_of(user: str, password: str) -> str:
        return urlunsplit((parts.scheme, f"{user}:{password}@{hostport}", parts.path, parts.query, parts.fragment))

    r = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        out = {}
        for role in ROLES:
            password = secrets.token_urlsafe(24)
            r.execute_command("ACL", "SETUSER", *setuser_args(role, password, prefix))
            out[role] = url_of(USERS[role], password)
        if lock_default:
            password = secrets.token_urlsafe(24)
            r.execute_command("ACL", "SETUSER", "default", "on", "resetpass", f">{password}")
            out["default"] = url_of("default", password)
        return out
    finally:
        r.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpool.index.redis_acl",
                                 description="The Redis ACL users of kvpool's index roles (operator, shard, engine).")
    ap.add_argument("--prefix", default="kvp", help="the pool's key prefix (default kvp)")
    ap.add_argument("--template", action="store_true",
                    help="an ACL file with @@ROLE_SHA256@@ placeholders (the Helm chart's files/redis-users.acl)")
    ap.add_argument("--apply", metavar="URL", help="make the users on the Redis at URL (an administrator's) with new "
                    "passwords and print each role's URL")
    ap.add_argument("--lock-default", action="store_true",
                    help="with --apply: also give Redis's default user a new password (printed), so that nobody "
                    "without one gets in")
    args = ap.parse_args(argv)
    if args.apply:
        urls = apply(args.apply, args.prefix, args.lock_default)
        for role, url in urls.items():
            print(f"{role}: {url}")
        print("# shard: `kvpool up --redis` (the pool's own processes); operator: `kvpool tenants --redis`; engine: "
              "lookups. Keep them across restarts: ACL SAVE (with an aclfile) or CONFIG REWRITE.", file=sys.stderr)
        if not args.lock_default:
            print("# the default user is unchanged: pass --lock-default, or give it a password yourself", file=sys.stderr)
        return 0
    if args.template:
        sys.stdout.write(template(args.prefix))
        return 0
    for role in ROLES:
        print(f"# {role}\nACL SETUSER {USERS[role]} reset on >PASSWORD " + " ".join(
            f"'{r}'" if " " in r else r for r in rules(role, args.prefix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
