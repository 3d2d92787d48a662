"""Bad input on the command line, generated: sizes that are not sizes, tenant names that are not
names, priorities that are not classes, URLs that are not Redis URLs, wrong argument counts.
Each ends with exit code 2 and a message naming the fix on stderr (or argparse's usage), and
leaves the index exactly as it was (every key of a Redis of the test's own, byte for byte)."""

from __future__ import annotations

import contextlib
import io
import re
from fractions import Fraction

import pytest
from conftest import OwnRedis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import BadRequest
from kvpool.cli import main, parse_tenant
from kvpool.index.redis_index import RedisIndex
from kvpool.sizing import _SIZE_UNITS, parse_size

BAD = settings(max_examples=60, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
UNITS = sorted(_SIZE_UNITS)


@pytest.fixture(scope="module", autouse=True)
def operator_env():
    """`kvpool tenants` acts only for an operator: this process holds a pool secret."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPOOL_SECRET", "bad-input-cli-test-secret-0123456789")
    mp.delenv("KVPOOL_CREDENTIAL", raising=False)
    mp.delenv("KVPOOL_SECRET_FILE", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    r = OwnRedis(tmp_path_factory.mktemp("redis-bad-cli"))
    idx = RedisIndex(r.url)
    idx.add_tenant("acme", 5000, "high")  # the state every bad call must leave alone
    idx.close()
    yield r
    r.kill()


def redis_state(url):
    idx = RedisIndex(url)
    try:
        r = idx._w
        return sorted((k, r.type(k), r.dump(k)) for k in r.scan_iter(match="*"))
    finally:
        idx.close()


def run(*argv):
    """``kvpool argv...`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse and usage errors
            rc = e.code if isinstance(e.code, int) else (print(e.code, file=err) or 1)
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ sizes


@BAD
@given(n=st.integers(0, 2**64), unit=st.sampled_from(UNITS), case=st.sampled_from([str.lower, str.upper, str]),
       pad=st.sampled_from(["", " ", "  "]))
def test_whole_sizes_parse_exactly_at_any_magnitude(n, unit, case, pad):
    assert parse_size(f"{pad}{n}{pad}{case(unit)}{pad}") == n * _SIZE_UNITS[unit]


@BAD
@given(whole=st.integers(0, 10**6), frac=st.from_regex(r"[0-9]{1,6}", fullmatch=True), unit=st.sampled_from(UNITS))
def test_decimal_sizes_are_exact_or_refused(whole, frac, unit):
    exact = (whole + Fraction(int(frac), 10 ** len(frac))) * _SIZE_UNITS[unit]
    text = f"{whole}.{frac}{unit}"
    if exact.denominator == 1:
        assert parse_size(text) == exact  # no float rounding: 0.1KB is 100, not 100.00000000000001
    else:
        with pytest.raises(BadRequest, match="not a whole number of bytes: use a smaller unit"):
            parse_size(text)


@BAD
@given(text=st.one_of(
    st.text(max_size=12),
    st.from_regex(r"-[0-9]{1,5}(GiB|MB)?", fullmatch=True),  # negative
    st.sampled_from(["nan", "NaN GiB", "inf", "1e9", "1_000", "0x10", "1.5.5", "10 XB", "GiB", "", " ", "1,5KB"]),
    st.from_regex(r"[0-9]{31,40}", fullmatch=True),  # longer than any sane size
))
def test_anything_else_is_not_a_size(text):
    if re.fullmatch(r"\s*\d{1,30}(\.\d{1,30})?\s*[a-zA-Z]*\s*", text):
        unit = re.sub(r"[\s\d.]", "", text).lower()
        if unit in _SIZE_UNITS:
            return  # it is a size after all (whole or refused as fractional above)
    with pytest.raises(BadRequest, match="not a number of bytes like 1073741824, 10GiB or 500MB"):
        parse_size(text)


# ------------------------------------------------------------------ kvpool tenants

bad_tenant = st.one_of(
    st.text(min_size=1, max_size=16).filter(lambda s: not (NAME.fullmatch(s) or s.startswith("-") or "\0" in s)),
    st.text(alphabet="abc", min_size=129, max_size=200),  # over-long
)


@BAD
@given(tenant=bad_tenant, size=st.sampled_from(["10GiB", "1", "0"]))
def test_set_quota_of_a_bad_tenant_name_is_refused(server, tenant, size):
    before = redis_state(server.url)
    rc, out, err = run("tenants", "set-quota", tenant, size, "--redis", server.url)
    assert rc == 2 and out == "" and "is not a valid name: 1-128 characters" in err
    assert redis_state(server.url) == before


@BAD
@given(size=st.one_of(st.sampled_from(["-1", "lots", "1.5", "0.5B", "nan", "1e9", "1 XB", ""]),
                      st.from_regex(r"[0-9]{31,35}", fullmatch=True)))
def test_set_quota_with_a_bad_size_is_refused(server, size):
    before = redis_state(server.url)
    rc, out, err = run("tenants", "set-quota", "acme", size, "--redis", server.url)
    assert rc == 2 and out == "" and re.search("10GiB or 500MB|whole number of bytes", err)
    assert redis_state(server.url) == before


@BAD
@given(priority=st.text(max_size=10).filter(lambda p: p not in ("low", "normal", "high") and not p.startswith("-")),
       tenant=st.sampled_from(["acme", "ghost"]))
def test_set_priority_outside_the_classes_is_refused(server, priority, tenant):
    before = redis_state(server.url)
    rc, out, err = run("tenants", "set-priority", tenant, priority, "--redis", server.url)
    assert rc == 2 and out == "" and "priority must be one of ('low', 'normal', 'high')" in err
    assert redis_state(server.url) == before


@BAD
@given(tenant=st.from_regex(r"[a-z][a-z0-9_-]{0,30}", fullmatch=True).filter(lambda t: t != "acme"),
       action=st.sampled_from(["usage", "set-priority"]))
def test_unknown_tenants_are_404_and_change_nothing(server, tenant, action):
    before = redis_state(server.url)
    extra = ["low"] if action == "set-priority" else []
    rc, out, err = run("tenants", action, tenant, *extra, "--redis", server.url)
    assert rc == 2 and out == "" and f"[404] unknown tenant '{tenant}': register it first" in err
    assert redis_state(server.url) == before


@BAD
@given(action=st.sampled_from(["list", "usage", "set-quota", "set-priority"]),
       n=st.integers(0, 4), word=st.from_regex(r"[a-z]{1,6}", fullmatch=True))
def test_wrong_argument_counts_print_the_usage(server, action, n, word):
    wanted = {"list": 0, "usage": 1, "set-quota": 2, "set-priority": 2}[action]
    if n == wanted:
        return
    before = redis_state(server.url)
    rc, out, err = run("tenants", action, *[word] * n, "--redis", server.url)
    assert rc == 1 and out == "" and f"usage: kvpool tenants {action}" in err
    assert redis_state(server.url) == before


@BAD
@given(url=st.one_of(
    st.text(max_size=20).filter(lambda u: not u.startswith(("redis://", "rediss://", "unix://", "-"))),
    st.from_regex(r"redis://127\.0\.0\.1:[a-z]{1,6}/0", fullmatch=True),  # a port that is not a number
    st.sampled_from(["http://127.0.0.1:6379/0", "redis:/x", "REDIS://h/0", "redis://u:secret@h:notaport/0"]),
))
def test_a_bad_index_url_is_refused_without_leaking_a_password(url):
    rc, out, err = run("tenants", "list", "--redis", url)
    if url == "":  # empty: as if no URL was given (and none is in the environment here)
        assert rc == 2 and "--redis URL" in err
        return
    assert rc == 2 and out == "" and re.search("must start with redis://|is malformed .*use redis://", err), err
    assert "secret" not in err


def test_quotas_over_unlimited_and_unknown_tenants_are_refused(server):
    before = redis_state(server.url)
    rc, out, err = run("tenants", "set-quota", "acme", "9" * 30 + "TiB", "--redis", server.url)
    assert rc == 2 and out == "" and "[400]" in err and "2**62" in err
    rc, out, err = run("tenants", "set-quota", "big", "1GiB", "--redis", server.url)
    assert rc == 2 and out == "" and "[404] unknown tenant 'big'" in err and "kvpool up --tenant big" in err
    assert redis_state(server.url) == before


def test_an_unknown_action_is_an_argparse_error(server):
    rc, out, err = run("tenants", "delete", "acme", "--redis", server.url)
    assert rc == 2 and "invalid choice: 'delete'" in err


# ------------------------------------------------------------------ kvpool up --tenant id[:quota[:priority]]


@BAD
@given(tenant=st.one_of(bad_tenant.filter(lambda t: ":" not in t), st.just("")),
       quota=st.sampled_from(["", "10GiB"]), priority=st.sampled_from(["", "high"]))
def test_up_tenant_with_a_bad_id_is_refused(tenant, quota, priority):
    spec = ":".join([tenant, quota, priority]).rstrip(":")
    with pytest.raises(BadRequest, match="is not a valid name|write id\\[:quota\\[:priority\\]\\]"):
        parse_tenant(spec)


@BAD
@given(quota=st.sampled_from(["lots", "-1", "1.5", "1G", "nan"]), priority=st.sampled_from(["", "high"]))
def test_up_tenant_with_a_bad_quota_is_refused(quota, priority):
    with pytest.raises(BadRequest, match="10GiB or 500MB|whole number of bytes"):
        parse_tenant(f"acme:{quota}:{priority}")


@BAD
@given(priority=st.text(min_size=1, max_size=8).filter(lambda p: p not in ("low", "normal", "high") and ":" not in p))
def test_up_tenant_with_a_bad_priority_is_refused_before_ray_starts(priority):
    with pytest.raises(BadRequest, match="priority must be one of"):
        parse_tenant(f"acme:1GiB:{priority}")


def test_up_refuses_a_bad_tenant_before_touching_ray():
    rc, out, err = run("up", "--tenant", "acme:1GiB:urgent", "--ray-address", "127.0.0.1:1")
    assert rc == 2 and out == "" and "priority must be one of" in err
