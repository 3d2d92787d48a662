"""Redis ACL users per role (kvpool.index.redis_acl) on a real redis-server started with the ACL
file: the engine's user only looks up, the shard's user publishes and heartbeats but never writes
a quota, the operator's user does everything; and the chart's users file is the one generated here."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import redis
from conftest import OwnRedis, make_keys

from kvpool.errors import Forbidden, QuotaExceeded
from kvpool.index import IndexEntry
from kvpool.index import redis_acl as acl
from kvpool.index.redis_index import RedisIndex

CHART_USERS = Path(__file__).resolve().parents[1] / "helm" / "kvpool" / "files" / "redis-users.acl"
NOPERM = pytest.raises(redis.exceptions.NoPermissionError)


class AclRedis:
    """A redis-server of the test's own, its users from an ACL file of every role."""

    def __init__(self, tmp_path, aclfile_text: str | None = None, passwords: dict | None = None):
        self.passwords = passwords or {r: secrets.token_urlsafe(24) for r in acl.ROLES}
        self.admin = secrets.token_urlsafe(24)
        path = tmp_path / "users.acl"
        path.write_text(aclfile_text or acl.aclfile(self.passwords, admin_password=self.admin))
        self.server = OwnRedis(tmp_path, "--aclfile", str(path))

    def url(self, role: str) -> str:
        return f"redis://{acl.USERS[role]}:{self.passwords[role]}@127.0.0.1:{self.server.port}/0"

    def index(self, role: str) -> RedisIndex:
        return RedisIndex(self.url(role), timeout_s=2.0, read_timeout_s=2.0)

    def raw(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(role), socket_timeout=2.0)


@pytest.fixture
def users(tmp_path):
    r = AclRedis(tmp_path)
    yield r
    r.server.kill()


def _entries(keys, shard="node-1", tenant="a", nbytes=100):
    return [IndexEntry(k, shard, "dram", nbytes, tenant, 7) for k in keys]


def _pool(users) -> tuple[RedisIndex, RedisIndex, RedisIndex, list]:
    """An operator's tenant with a quota, a shard that joined and published 3 chunks."""
    op, shard, engine = users.index("operator"), users.index("shard"), users.index("engine")
    op.add_tenant("a", 1000, "high")
    shard.add_tenant("a", 1000, "high")  # a shard joining with the same config writes nothing
    shard.register_shard("node-1", "10.0.0.1", ttl_s=60)
    keys = make_keys(4, seed=3)
    assert shard.publish(_entries(keys[:3])) == [True, True, True]
    return op, shard, engine, keys


def test_the_engine_user_looks_up_and_nothing_else(users):
    op, shard, engine, keys = _pool(users)
    hit = engine.lookup(keys)
    assert (hit.count, hit.shards, hit.error) == (3, ("node-1",) * 3, None)
    assert engine.get(keys[0]).tenant == "a" and engine.get(keys[3]) is None
    for write in (lambda: engine.set_quota("a", 1), lambda: engine.set_priority("a", "low"),
                  lambda: engine.add_tenant("b"), lambda: engine.publish(_entries(keys[3:])),
                  lambda: engine.remove(keys[:1]), lambda: engine.invalidate(keys[0], "node-1"),
                  lambda: engine.register_shard("evil"), lambda: engine.heartbeat("node-1"),
                  engine.events, engine.tenants, lambda: engine.usage("a"), engine.flush):
        with pytest.raises(Forbidden) as e:
            write()
        assert e.value.status == 403 and "NOPERM" in e.value.message and users.passwords["engine"] not in str(e.value)
    raw = users.raw("engine")
    with NOPERM:
        raw.incrby("kvp:u:a", -10**9)  # usage
    with NOPERM:
        raw.hset("kvp:t:a", "quota", 1)  # quota
    with NOPERM:
        raw.get("kvp:u:a")  # reads only chunk entries
    with NOPERM:
        raw.xread({"kvp:events": "0-0"})
    with NOPERM:
        raw.xrange("kvp:events")
    with NOPERM:
        raw.scan(0)
    with NOPERM:
        raw.keys("*")
    with NOPERM:
        raw.set(b"kvp:c:" + bytes(keys[3]), b"node-1\0dram\0forged")
    with NOPERM:
        raw.evalsha("0" * 40, 0)
    assert op.usage("a") == 300 and engine.lookup(keys).count == 3  # nothing changed


def test_the_shard_user_publishes_and_heartbeats_but_sets_no_quota(users):
    op, shard, engine, keys = _pool(users)
    shard.heartbeat("node-1", ttl_s=60)
    assert shard.shards() == {"node-1": True}
    assert [(t.id, t.usage, t.quota, t.priority) for t in shard.tenants()] == [("a", 300, 1000, "high")]
    with pytest.raises(QuotaExceeded):  # the quota the operator set holds for the shard
        shard.publish(_entries(keys[3:], nbytes=800))
    assert shard.remove(keys[:1], shard="node-1") == 1 and op.usage("a") == 200
    r = shard.reconcile("node-1", _entries(keys[1:]))
    assert (r.published, r.removed) == (1, 0) and op.usage("a") == 300
    shard.add_tenant("b")  # a tenant the index does not know yet: create-only
    assert {t.id: t.quota for t in op.tenants()}["b"] == 2**62
    for write in (lambda: shard.set_quota("a", 10**12), lambda: shard.set_priority("a", "low"),
                  lambda: shard.add_tenant("a", 10**12), shard.events, shard.flush):
        with pytest.raises(Forbidden, match="NOPERM"):
            write()
    raw = users.raw("shard")
    with NOPERM:
        raw.hset("kvp:t:a", "quota", 10**12)
    with NOPERM:
        raw.hincrby("kvp:t:a", "quota", 10**12)
    with NOPERM:
        raw.set("kvp:t:a", "x")  # nor replace the tenant's hash
    with NOPERM:
        raw.delete("kvp:t:a")
    with NOPERM:
        raw.set("kvp:u:a", 0)  # usage only moves by charges and refunds
    with NOPERM:
        raw.xrange("kvp:events")
    with NOPERM:
        raw.scan(0)
    with NOPERM:
        raw.set("other:c:x", 1)  # another pool's prefix
    with NOPERM:  # a script runs with the caller's ACL: loading one grants nothing
        raw.eval("return redis.call('HSET', KEYS[1], 'quota', 1)", 1, "kvp:t:a")
    declared = raw.script_load("return redis.call('HSET', KEYS[1], 'quota', 1)")
    hidden = raw.script_load("return redis.call('HSET', 'kvp:t:a', 'quota', 1)")
    for sha, keys in ((declared, (1, "kvp:t:a")), (hidden, (0,))):  # the key declared, or not
        with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|no permissions|can't access"):
            raw.evalsha(sha, *keys)
    assert [(t.id, t.quota, t.priority) for t in op.tenants()][0] == ("a", 1000, "high")
    # a dead shard is purged by the controller (the shard's user too)
    shard.register_shard("node-2", ttl_s=0.05)
    shard.publish(_entries(make_keys(1, seed=9), shard="node-2"))
    users.raw("operator").delete("kvp:hb:node-2")
    assert shard.purge_dead() == {"node-2": 1} and op.usage("a") == 300


def test_the_operator_user_does_everything_in_its_prefix(users):
    op, shard, engine, keys = _pool(users)
    op.set_quota("a", 5000)
    op.set_priority("a", "low")
    op.add_tenant("c", 10, "normal")
    assert [(t.id, t.quota, t.priority) for t in op.tenants()] == [("a", 5000, "low"), ("c", 10, "normal")]
    assert [e.kind for e in op.events()] == ["stored"] * 3
    assert op.remove(keys) == 3 and op.usage("a") == 0
    raw = users.raw("operator")
    with NOPERM:
        raw.set("other:x", 1)
    with NOPERM:
        raw.flushall()
    with NOPERM:
        raw.config_get("*")
    op.flush()
    assert raw.exists("kvp:t:a", "kvp:u:a", "kvp:tenants") == 0


def test_a_wrong_password_or_an_unknown_user_gets_nothing(users):
    url = users.url("engine").replace(users.passwords["engine"], "not-the-password")
    idx = RedisIndex(url, timeout_s=0.3, read_timeout_s=0.3)
    assert idx.lookup(make_keys(1)).count == 0
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=users.server.port, username="kvpool-engine", password="nope").ping()
    with pytest.raises(redis.exceptions.AuthenticationError):  # no password: the default user is the admin's
        redis.Redis(port=users.server.port).ping()


def test_rules_are_per_prefix_and_refuse_what_would_be_a_pattern():
    assert "%R~pool2:c:*" in acl.rules("engine", "pool2")
    assert all("kvp:" not in r for r in acl.rules("shard", "pool2"))
    with pytest.raises(ValueError, match="role must be one of"):
        acl.rules("admin")
    with pytest.raises(Exception, match="not a valid name"):
        acl.rules("engine", "kvp*")
    assert acl.setuser_args("engine", "pw")[:4] == ["kvpool-engine", "reset", "on", ">pw"]
    assert acl.main(["--prefix", "p2"]) == 0


def test_the_charts_users_file_is_the_generated_one():
    """Regenerate with: .venv/bin/python -m kvpool.index.redis_acl --template > helm/kvpool/files/redis-users.acl"""
    assert CHART_USERS.read_text() == acl.template("kvp")


def test_the_template_with_hashes_filled_in_is_the_aclfile(tmp_path):
    pw = {r: f"{r}-pw" for r in acl.ROLES}
    text = acl.template()
    for r, p in [*pw.items(), ("default", "adm")]:
        text = text.replace(f"@@{r.upper()}_SHA256@@", acl.password_hash(p))
    assert text == acl.aclfile(pw, admin_password="adm")
    users = AclRedis(tmp_path, text, pw)
    try:
        _pool(users)
        assert users.index("engine").lookup(make_keys(4, seed=3)).count == 3
    finally:
        users.server.kill()


def test_the_charts_redis_users_on_a_real_redis(tmp_path):
    """The chart end to end: its Redis Secret's passwords, its users file filled in by its own
    script as the Redis pod does, and each component's index URL as its pod spells it."""
    import base64
    import os
    import subprocess

    from test_helm import NAMESPACE, one, render

    docs = render("default")
    secret = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", "-redis")["data"].items()}
    users = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", "-redis-users")["data"].items()}
    (redis_c,) = one(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: secret[e["valueFrom"]["secretKeyRef"]["key"]] for e in redis_c["env"]}
    for name in ("users.sh", "users.acl.in"):
        (tmp_path / name).write_text(users[name])
    out = tmp_path / "users.acl"
    r = subprocess.run(["sh", str(tmp_path / "users.sh"), str(tmp_path / "users.acl.in"), str(out)],
                       env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o777 == 0o600 and not any(pw in out.read_text() for pw in secret.values())
    server = OwnRedis(tmp_path, "--aclfile", str(out))
    try:
        host = f"rel-kvpool-redis.{NAMESPACE}.svc.cluster.local:6379"

        def url_of(spec: dict, var: str) -> str:  # as Kubernetes expands $(VAR), on this test's server
            (c,) = spec["containers"]
            env = {e["name"]: e for e in c["env"]}
            url = env[var]["value"]
            for name, e in env.items():
                if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]:
                    url = url.replace(f"$({name})", secret.get(e["valueFrom"]["secretKeyRef"]["key"], ""))
            return url.replace(host, f"127.0.0.1:{server.port}")

        job = one(docs, "Job")["spec"]["template"]["spec"]
        head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
        op = RedisIndex(url_of(job, "KVPOOL_REDIS_URL"))
        pool_url = url_of(job, "KVPOOL_POOL_REDIS_URL")
        assert pool_url == url_of(head, "KVPOOL_REDIS_URL")  # what `kvpool up` hands the actors is the pods' own
        shard = RedisIndex(pool_url)
        engine = RedisIndex(f"redis://kvpool-engine:{secret['engine-password']}@127.0.0.1:{server.port}/0")
        op.add_tenant("default", 10_000)
        shard.register_shard("node-1")
        keys = make_keys(2, seed=5)
        shard.publish(_entries(keys, tenant="default"))
        assert engine.lookup(keys).count == 2
        with pytest.raises(Forbidden):
            shard.set_quota("default", 10**12)
        with pytest.raises(Forbidden):
            engine.publish(_entries(make_keys(1, seed=6), tenant="default"))
        admin = redis.Redis(port=server.port, password=secret["redis-password"])  # the readiness probe's user
        assert admin.ping() and admin.acl_whoami() == "default"
    finally:
        server.kill()
