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
"""

from __future__ import annotations

import argparse
import hashlib
import sys

from kvpool.index.base import check_name

ROLES = ("operator", "shard", "engine")
USERS = {"operator": "kvpool-operator", "shard": "kvpool-shard", "engine": "kvpool-engine"}
# NOTE: what redis-py sends on connecting (SELECT for a db other than 0, HELLO for RESP3); AUTH
# needs no permission. CLIENT SETINFO (Redis >= 7.2) is left out: redis-py ignores its refusal.
_CONNECT = ["+ping", "+hello", "+select"]
_READS = ["+get", "+mget", "+exists", "+hexists", "+hget", "+hmget", "+hkeys", "+smembers"]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpool.index.redis_acl",
                                 description="The Redis ACL users of kvpool's index roles (operator, shard, engine).")
    ap.add_argument("--prefix", default="kvp", help="the pool's key prefix (default kvp)")
    ap.add_argument("--template", action="store_true",
                    help="an ACL file with @@ROLE_SHA256@@ placeholders (the Helm chart's files/redis-users.acl)")
    args = ap.parse_args(argv)
    if args.template:
        sys.stdout.write(template(args.prefix))
        return 0
    for role in ROLES:
        print(f"# {role}\nACL SETUSER {USERS[role]} reset on >PASSWORD " + " ".join(
            f"'{r}'" if " " in r else r for r in rules(role, args.prefix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
