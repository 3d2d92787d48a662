import json
import subprocess
import sys

import pytest

from kvpool import BadRequest
from kvpool.bench import index as bench_index
from kvpool.index.redis_index import RedisIndex
from kvpool.sizing import parse_size

SECRET = "index-cli-test-secret-0123456789"  # `kvpool tenants` acts for an operator: the pool secret's holder


def kvpool(*args, env=None, check=True):
    import os

    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True,
                          timeout=120, check=check,
                          env={**os.environ, "KVPOOL_SECRET": SECRET, "KVPOOL_SECRET_FILE": "", "KVPOOL_CREDENTIAL": "",
                               **(env or {})})


def test_tenants_cli_round_trip(own_redis):
    url = own_redis.url
    r = kvpool("tenants", "set-quota", "acme", "10GiB", "--redis", url, check=False)
    assert r.returncode == 2 and "[404] unknown tenant 'acme'" in r.stderr and "kvpool up --tenant acme" in r.stderr
    idx = RedisIndex(url)
    idx.add_tenant("acme")
    idx.add_tenant("tiny")
    idx.close()
    out = kvpool("tenants", "set-quota", "acme", "10GiB", "--redis", url).stdout
    assert out.strip() == f"acme: quota {10 * 2**30} B"
    r = kvpool("tenants", "set-quota", "acme", f"{2**62 + 1}", "--redis", url, check=False)
    assert r.returncode == 2 and "[400]" in r.stderr and "2**62" in r.stderr
    kvpool("tenants", "set-quota", "tiny", "500MB", "--redis", url)
    kvpool("tenants", "set-priority", "acme", "high", "--redis", url)
    rows = json.loads(kvpool("tenants", "list", "--json", "--redis", url).stdout)
    assert rows == [
        {"tenant": "acme", "usage": 0, "quota": 10 * 2**30, "priority": "high"},
        {"tenant": "tiny", "usage": 0, "quota": 500 * 10**6, "priority": "normal"},
    ]
    assert kvpool("tenants", "usage", "acme", env={"KVPOOL_REDIS_URL": url}).stdout.strip() == "0"
    table = kvpool("tenants", "list", "--redis", url).stdout
    assert "acme" in table and "high" in table


def test_tenants_cli_errors_name_the_fix(own_redis):
    r = kvpool("tenants", "list", check=False, env={"KVPOOL_REDIS_URL": ""})
    assert r.returncode == 2 and "--redis URL" in r.stderr
    r = kvpool("tenants", "usage", "ghost", "--redis", own_redis.url, check=False)
    assert r.returncode == 2 and "unknown tenant 'ghost'" in r.stderr
    r = kvpool("tenants", "set-priority", "ghost", "urgent", "--redis", own_redis.url, check=False)
    assert r.returncode == 2 and "priority must be one of" in r.stderr
    r = kvpool("tenants", "set-quota", "x", "lots", "--redis", own_redis.url, check=False)
    assert r.returncode == 2 and "10GiB" in r.stderr


def test_parse_size():
    assert parse_size("1024") == 1024 and parse_size("2KiB") == 2048 and parse_size("1.5 GB") == 1_500_000_000
    with pytest.raises(BadRequest):
        parse_size("-5")


def test_bench_index_reports_lookup_beside_its_mget_floor(redis_url):
    r = bench_index.run(redis_url, prompt_chunks=64, reps=50, publish_chunks=2000, progress=False)
    for k in ("lookup_p50_ms", "lookup_p99_ms", "mget_p50_ms", "publish_per_s"):
        assert r[k] > 0
    assert r["lookup_p50_ms"] >= r["mget_p50_ms"] * 0.5  # the floor is a floor, loosely (noise)
