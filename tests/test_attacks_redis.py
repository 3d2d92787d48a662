"""Attacks on the pool through its Redis, on real redis-servers of the tests' own: an open Redis
under `kvpool up`, `kvpool tenants` without an operator credential, index entries deleted behind
the pool's back, a forged usage counter. Each attack fails: the open Redis is refused (unless
--insecure-redis, loudly), the commands are 401/403 naming the fix, the next reconcile republishes
the deleted entries and sets the counter back to what is indexed."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import redis
from conftest import make_keys
from test_redis_acl import AclRedis

from kvpool.auth import Authority
from kvpool.cli import main
from kvpool.errors import BadRequest, QuotaExceeded
from kvpool.index import IndexEntry
from kvpool.index import redis_acl as acl
from kvpool.index.redis_index import RedisIndex
from kvpool.keys import ChunkKey

SECRET = "attacks-redis-test-secret-0123456789"


def _entries(keys, shard="node-1", tenant="alice", nbytes=1000):
    return [IndexEntry(k, shard, "dram", nbytes, tenant, 7) for k in keys]


def _indexed_bytes(raw: redis.Redis, tenant: str) -> int:
    """What the index really lists for ``tenant``, read entry by entry."""
    total = 0
    for k in raw.scan_iter(match="kvp:c:*"):
        e = IndexEntry.decode(ChunkKey(k[len(b"kvp:c:"):]), raw.get(k))
        total += e.nbytes if e.tenant == tenant else 0
    return total


@pytest.fixture
def pool_index(own_redis):
    """A pool's index: alice (quota 6000 B) with 5 chunks of 1000 B on node-1, bob's 2 on node-2."""
    idx = RedisIndex(own_redis.url, timeout_s=2.0, read_timeout_s=2.0)
    idx.add_tenant("alice", 6000)
    idx.add_tenant("bob")
    idx.register_shard("node-1", ttl_s=60)
    idx.register_shard("node-2", ttl_s=60)
    keys = make_keys(7, seed=11)
    alice, bob = _entries(keys[:5]), _entries(keys[5:], shard="node-2", tenant="bob", nbytes=700)
    idx.publish(alice)
    idx.publish(bob)
    raw = redis.Redis.from_url(own_redis.url, socket_timeout=2.0)
    yield idx, raw, alice, bob
    raw.close()
    idx.close()


# ------------------------------------------------------------------ an open Redis under `kvpool up`


def test_an_open_redis_is_refused_unless_insecure_redis_says_so(own_redis, capsys):
    with pytest.raises(BadRequest) as e:
        acl.check_locked(own_redis.url)
    assert "is open" in e.value.message and "--insecure-redis" in e.value.message
    assert "redis_acl --apply" in e.value.message  # the fix: the ACL users of kvpool's roles
    # a user and a password in the URL change nothing while the default user needs none
    with pytest.raises(BadRequest, match="is open"):
        acl.check_locked(own_redis.url.replace("redis://", "redis://default:anything@"))
    assert acl.check_locked(own_redis.url, insecure=True) is False
    assert "WARNING" in capsys.readouterr().err
    urls = acl.apply(own_redis.url, lock_default=True)  # the users of every role, the default user locked
    assert acl.check_locked(urls["shard"]) is True and acl.check_locked(own_redis.url) is True
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(own_redis.url, socket_timeout=2.0).set("kvp:u:alice", 10**9)
    shard = RedisIndex(urls["shard"])
    shard.register_shard("node-1")  # the shard user is a working pool user
    assert shard.shards() == {"node-1": True}
    shard.close()


def test_the_charts_redis_is_locked(tmp_path):
    users = AclRedis(tmp_path)  # the chart's users file: the default user has the admin's password
    try:
        assert all(acl.check_locked(users.url(role)) for role in acl.ROLES)
    finally:
        users.server.kill()


def test_kvpool_up_refuses_an_open_redis_before_it_starts_ray(own_redis, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "KVPOOL_SECRET": "", "KVPOOL_SECRET_FILE": "", "RAY_ADDRESS": ""}
    # NOTE: a Ray address nothing answers on: were Ray reached first, this would be another error, late
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "up", "--redis", own_redis.url, "--ray-address",
                        "127.0.0.1:1", "--secret-file", str(tmp_path / "secret")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert "is open" in r.stderr and "--insecure-redis" in r.stderr and "redis_acl --apply" in r.stderr
    assert "Ray" not in r.stderr.split("is open")[0]


# ------------------------------------------------------------------ `kvpool tenants` without an operator


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


COMMANDS = [("set-quota", "alice", "0"), ("set-priority", "alice", "low"), ("list",), ("usage", "alice")]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_tenants_commands_need_an_operator_credential_on_redis(pool_index, own_redis, tmp_path, monkeypatch, command):
    idx, raw, _, _ = pool_index
    before = sorted((k, raw.dump(k)) for k in raw.scan_iter(match="kvp:t:*"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kvpool/secret
    for var in ("KVPOOL_SECRET", "KVPOOL_SECRET_FILE", "KVPOOL_CREDENTIAL"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = _run("tenants", *command, "--redis", own_redis.url)  # no credential, no secret
    assert (rc, out) == (2, "") and "[401]" in err and "kvpool auth issue NAME --role operator" in err, err
    monkeypatch.setenv("KVPOOL_SECRET", SECRET)
    pool = Authority(SECRET)
    for credential, status in ((pool.issue("mallory"), "[403]"),  # a tenant's own credential
                               (Authority("another-pools-secret-0123456789").issue("mallory", "operator"), "[401]"),
                               ("mallory", "[401]")):  # a bare name
        rc, out, err = _run("tenants", *command, "--redis", own_redis.url, "--credential", credential)
        assert (rc, out) == (2, "") and status in err and "--role operator" in err, err
    monkeypatch.setenv("KVPOOL_CREDENTIAL", pool.issue("mallory"))  # the same, from the environment
    rc, _, err = _run("tenants", *command, "--redis", own_redis.url)
    assert rc == 2 and "[403]" in err
    assert sorted((k, raw.dump(k)) for k in raw.scan_iter(match="kvp:t:*")) == before  # nothing changed
    rc, _, err = _run("tenants", *command, "--redis", own_redis.url, "--credential", pool.issue("ops", "operator"))
    assert rc == 0, err
    monkeypatch.delenv("KVPOOL_CREDENTIAL")
    assert _run("tenants", *command, "--redis", own_redis.url)[0] == 0  # the pool secret's holder is the pool


# ------------------------------------------------------------------ entries deleted behind the pool's back


def test_entries_deleted_from_redis_are_republished_by_the_next_reconcile(pool_index):
    idx, raw, alice, bob = pool_index
    keys = [e.key for e in alice]
    assert idx.lookup(keys).count == 5
    raw.delete(*(idx.keys.chunk(k) for k in keys[:3]))  # the key set of node-1 still lists them
    assert idx.lookup(keys).count == 0  # her hits are misses
    r = idx.reconcile("node-1", alice)
    # all 3 come back, within her quota (6000 B; the 3000 B the deleted entries held were not refunded)
    assert (r.published, r.removed, r.refused) == (3, 0, ())
    assert idx.lookup(keys).count == 5 and idx.usage("alice") == 5000 == _indexed_bytes(raw, "alice")
    raw.srem(idx.keys.shard_set("node-1"), bytes(keys[4]))  # an entry its shard's key set lost
    raw.delete(idx.keys.chunk(keys[3]))
    assert idx.reconcile("node-1", alice).published == 1
    assert idx.shard_keys("node-1") == set(keys)  # listed again: purge finds it
    raw.set(idx.keys.chunk(keys[0]), b"garbage")  # a value that is no entry
    assert idx.reconcile("node-1", alice).published == 1
    assert idx.get(keys[0]) == IndexEntry(keys[0], "node-1", "dram", 1000, "alice", 7, idx.get(keys[0]).created)
    assert idx.usage("alice") == 5000 and idx.reconcile("node-1", alice).published == 0  # idempotent
    assert idx.forget_shard("node-1") == 5 and idx.usage("alice") == 0


# ------------------------------------------------------------------ a forged usage counter


def test_a_forged_usage_counter_heals_at_the_next_reconcile(pool_index):
    idx, raw, alice, bob = pool_index
    more = _entries(make_keys(2, seed=12))[:1]
    raw.incrby(idx.keys.usage("alice"), 1)  # one INCRBY: her next write is a 429
    with pytest.raises(QuotaExceeded):
        idx.publish(more)
    idx.reconcile("node-1", alice)
    assert idx.usage("alice") == 5000 and idx.publish(more) == [True]  # healed: she writes again
    alice = alice + more
    for forged in (2**62, -(2**62), 10**15 + 7):  # beyond what a double holds exactly, and below zero
        raw.incrby(idx.keys.usage("alice"), forged)
        raw.incrby(idx.keys.usage("bob"), forged)
        idx.reconcile("node-1", alice)  # any shard's reconcile heals every tenant's total
        assert (idx.usage("alice"), idx.usage("bob")) == (6000, 1400)
    raw.hincrby(idx.keys.shard_usage("node-2"), "bob", 10**9)  # a shard's own part, forged
    idx.reconcile("node-2", bob)
    assert idx.usage("bob") == 1400
    idx.add_tenant("carol", 1000)  # nothing stored anywhere
    raw.incrby(idx.keys.usage("carol"), 1000)
    idx.reconcile("node-2", bob)
    assert idx.usage("carol") == 0
    assert idx.remove([alice[0].key]) == 1 and idx.usage("alice") == 5000  # refunds still exact

