"""RedisIndex against real Redis servers: racing processes, a Redis killed and restarted, ACL
users and passwords."""

import logging
import multiprocessing as mp
import threading
import time
import uuid

import numpy as np
import pytest
from conftest import OwnRedis, make_keys, payload, wait_for

from kvpool import Tenant, TenantRegistry, Unavailable
from kvpool.errors import KvPoolError
from kvpool.index import IndexEntry
from kvpool.index.redis_index import RedisIndex, redact
from kvpool.store import ChunkStore, StoreConfig

KEYS = make_keys(64, seed=99)


def _size(i):
    return 100 + i


def _hammer(url, prefix, seed, rounds, out):
    idx = RedisIndex(url, prefix=prefix, timeout_s=5.0)
    rng = np.random.default_rng(seed)
    refused = 0
    for _ in range(rounds):
        picks = rng.choice(len(KEYS), size=int(rng.integers(1, 5)), replace=False)
        if rng.random() < 0.6:
            try:
                idx.publish([IndexEntry(KEYS[i], "s1", "dram", _size(i), "a", i) for i in picks])
            except KvPoolError as e:
                assert e.status == 429
                refused += 1
        else:
            idx.remove([KEYS[i] for i in picks])
    out.put(refused)


def test_racing_processes_never_overrun_the_quota_and_usage_stays_exact(redis_url):
    prefix = f"kvpt{uuid.uuid4().hex[:12]}"
    idx = RedisIndex(redis_url, prefix=prefix)
    quota = sum(_size(i) for i in range(20))
    idx.add_tenant("a", quota)
    idx.register_shard("s1", ttl_s=120)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(redis_url, prefix, s, 300, out)) for s in range(4)]
    try:
        for p in procs:
            p.start()
        refused = sum(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        resident = idx.shard_keys("s1")
        usage = idx.usage("a")
        assert usage == sum(idx.get(k).nbytes for k in resident)
        assert usage <= quota
        assert refused > 0  # the quota was actually contended
    finally:
        idx.flush()


def test_redis_killed_mid_traffic_means_fast_misses_then_reconcile_restores(own_redis):
    idx = RedisIndex(own_redis.url, timeout_s=0.5, read_timeout_s=0.2, backoff_s=0.3)
    reg = TenantRegistry([Tenant("a")])
    store = ChunkStore(StoreConfig(1024, 8), reg)
    keys = make_keys(5)
    store.put_many(keys, [payload(i) for i in range(5)], "a")
    idx.add_tenant("a")
    idx.register_shard("node-1", ttl_s=60)
    idx.publish(store.index_entries("node-1"))
    before = idx.lookup(keys)
    assert before.count == 5

    latencies, errors, results = [], [], []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                results.append(idx.lookup(keys).count)
            except Exception as e:  # noqa: BLE001 - the point: nothing may escape
                errors.append(e)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.005)

    t = threading.Thread(target=reader)
    t.start()
    try:
        wait_for(lambda: len(results) >= 3, 10, interval_s=0.01, what="the reader's first lookups")
        failed = idx.read_errors
        own_redis.kill()
        # Lookups through the outage: the first failed read opens the breaker, and two more fail
        # after it has let them through again (backoff_s=0.3).
        wait_for(lambda: idx.read_errors >= failed + 3, 10, interval_s=0.05,
                 what="three failed reads of the dead index")
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive(), "the reader hung"
    assert errors == []
    assert max(latencies) < 0.6  # bounded by the read timeout, never a hang
    assert results[-1] == 0  # misses while the index is down
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as e:
        idx.publish([IndexEntry(make_keys(1, seed=7)[0], "node-1", "dram", 10, "a", 1)])
    assert time.monotonic() - t0 < 10 and e.value.status == 503

    own_redis.start()  # back, with an empty dataset
    # past the read breaker: a ping answered by the server, not a miss from the breaker
    wait_for(idx.ping, 10, interval_s=0.05, what="the restarted index to answer a ping")
    hit = idx.lookup(keys)
    assert hit.count == 0 and hit.error is None  # the empty server's answer, not the breaker's
    idx.add_tenant("a")  # tenants come from the pool's config
    idx.register_shard("node-1", ttl_s=60)
    r = idx.reconcile("node-1", store.index_entries("node-1"))
    assert r.published == 5
    assert idx.lookup(keys) == before
    assert idx.usage("a") == 5000


def test_acl_user_and_password(tmp_path, caplog):
    server = OwnRedis(tmp_path, "--requirepass", "admin-secret")
    try:
        import redis

        admin = redis.Redis(port=server.port, password="admin-secret")
        admin.execute_command("ACL", "SETUSER", "kvpool", "on", ">pool-secret-123", "~kvp*", "+@all", "-flushall")
        good = RedisIndex(f"redis://kvpool:pool-secret-123@127.0.0.1:{server.port}/0")
        good.add_tenant("a")
        assert [t.id for t in good.tenants()] == ["a"]
        assert "pool-secret-123" not in good.url and "***" in good.url
        caplog.set_level(logging.DEBUG)
        bad = RedisIndex(f"redis://kvpool:wrong-pw-456@127.0.0.1:{server.port}/0", timeout_s=0.3)
        with pytest.raises(Unavailable) as e:
            bad.add_tenant("b")
        assert "wrong-pw-456" not in str(e.value)
        assert bad.lookup(make_keys(1)).count == 0
        assert "wrong-pw-456" not in caplog.text and "pool-secret-123" not in caplog.text
        # the ACL confines the user to its prefix
        other = RedisIndex(f"redis://kvpool:pool-secret-123@127.0.0.1:{server.port}/0", prefix="other")
        with pytest.raises(Exception, match="NOPERM|permission"):
            other._w.set("other:x", 1)
    finally:
        server.kill()


def test_redact_hides_passwords_only():
    assert redact("redis://u:p4ss@h:1/0") == "redis://u:***@h:1/0"
    assert redact("rediss://:p4ss@h/0") == "rediss://:***@h/0"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_tls_connection_with_rediss(tmp_path):
    import shutil
    import subprocess

    from conftest import IN_CI, free_port, redis_reachable

    if shutil.which("openssl") is None:
        if IN_CI:
            pytest.fail("openssl is not on PATH")
        pytest.skip("openssl is not on PATH")
    d = str(tmp_path)
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, cwd=d)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvpool-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "1", "-extfile", "san.ext", "-out", "server.crt")
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--tls-cert-file", f"{d}/server.crt", "--tls-key-file", f"{d}/server.key", "--tls-ca-cert-file",
         f"{d}/ca.crt", "--tls-auth-clients", "no", "--dir", d],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: redis_reachable(port=port), 10, interval_s=0.02,
                 what=f"the TLS redis-server to accept connections on port {port}")
        idx = RedisIndex(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={d}/ca.crt")
        idx.add_tenant("a")
        idx.register_shard("s1")
        k = make_keys(1)[0]
        idx.publish([IndexEntry(k, "s1", "dram", 10, "a", 1)])
        assert idx.lookup([k]).count == 1
        plain = RedisIndex(f"redis://127.0.0.1:{port}/0", timeout_s=0.3, read_timeout_s=0.3)
        with pytest.raises(Unavailable):  # a plain-text client cannot talk to the TLS port
            plain.add_tenant("b")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_usage_never_falls_below_what_is_indexed_while_publishes_race_reconciles(own_redis):
    """A reconcile reads what is indexed in batches while its shard keeps publishing, then sets
    the shard's part of usage from it: what the scan missed is never taken off the counter (the
    quota would stop holding), and once writes stop the counter is exact."""
    import redis

    idx = RedisIndex(own_redis.url, timeout_s=2.0)
    idx.add_tenant("dave")
    idx.register_shard("node-1", ttl_s=60)
    held = [IndexEntry(k, "node-1", "dram", 10, "dave", 7) for k in make_keys(1500, seed=13)]
    raw = redis.Redis.from_url(own_redis.url, socket_timeout=2.0)

    def indexed() -> int:
        values = raw.mget([idx.keys.chunk(e.key) for e in held])
        return sum(IndexEntry.decode(e.key, v).nbytes for e, v in zip(held, values) if v is not None)

    def writer():
        w = RedisIndex(own_redis.url, timeout_s=2.0)
        for i in range(0, len(held), 5):
            w.publish(held[i : i + 5])
        w.close()

    t = threading.Thread(target=writer)
    t.start()
    rounds = 0
    while t.is_alive():
        before = indexed()
        idx.reconcile("node-1", held)  # the store holds them all; the index gets them a few at a time
        assert idx.usage("dave") >= before  # only publishes ran meanwhile: never below what was indexed
        rounds += 1
    t.join(timeout=60)
    assert rounds >= 1 and idx.usage("dave") == indexed() == 15000
    idx.reconcile("node-1", held)
    assert idx.usage("dave") == 15000
    raw.close()
    idx.close()
