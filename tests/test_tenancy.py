"""connectors/tenancy.py: the map from what a request carries (a request secret) to the tenant an
engine serves it as, built from the connector config, on open and secured pools."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvpool.auth import Authority, new_secret, request_secret
from kvpool.connectors.pools import check_config, close_local_pools, open_pool, pool_authority, pool_tenants
from kvpool.connectors.tenancy import Route, Tenancy
from kvpool.errors import BadRequest, Unauthorized
from kvpool.spec import KVSpec

ACME_SECRET = "acme-0123456789abcdef"
GLOBEX_SECRET = "globex-fedcba9876543210"
SPEC = KVSpec("test/tenancy", 1, 1, 4, dtype="float32", block_size=4, chunk_tokens=4)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in ("KVPOOL_SECRET", "KVPOOL_SECRET_FILE", "KVPOOL_CREDENTIAL"):
        monkeypatch.delenv(k, raising=False)
    yield
    close_local_pools()


def config(pool: str, **kw) -> dict:
    return {"backend": "local", "pool": pool, "dram_mib": 1, "chunk_tokens": 4, **kw}


def secret_file(tmp_path, secret: str | None = None) -> tuple[str, Authority]:
    secret = secret or new_secret()
    path = tmp_path / "pool-secret"
    path.write_text(secret + "\n")
    path.chmod(0o600)  # kvpool refuses a secret file others can read
    return str(path), Authority(secret)


def test_open_pool_without_request_secrets_serves_the_default_tenant_only(caplog):
    caplog.set_level(logging.INFO, logger="kvpool.connectors.tenancy")
    t = Tenancy(config("ten-open", tenants=["default", "acme"]), engine="test")
    assert not t.secured and t.reachable == []
    assert "every request is served as tenant 'default'" in caplog.text and "['acme']" in caplog.text
    assert t.route(None) == t.route("") == Route("default", "default")
    assert t.route("acme") is None and t.route(ACME_SECRET) is None  # a name is no secret
    assert t.stats() == {"rejected_credential": 2}


def test_request_secrets_route_to_their_tenants_and_anything_else_is_not_cached(caplog):
    cfg = config("ten-secrets", tenant="default", tenants=[
        "default", {"id": "acme", "request_secret": ACME_SECRET, "quota_bytes": 1 << 20},
        {"id": "globex", "request_secret": GLOBEX_SECRET}])
    caplog.set_level(logging.INFO, logger="kvpool.connectors.tenancy")
    t = Tenancy(cfg, engine="test")
    assert t.reachable == ["acme", "globex"] and not t.secured
    assert t.route(ACME_SECRET) == Route("acme", "acme")  # an open pool is passed the id
    assert t.route(GLOBEX_SECRET) == Route("globex", "globex")
    assert t.route(None) == Route("default", "default")
    for wrong in ("acme", ACME_SECRET + "x", ACME_SECRET.upper(), 42, b"bytes"):
        assert t.route(wrong, request="r1") is None
    # a tenant name the request gives is ignored (counted, logged once): the secret decides
    assert t.route(None, named="acme", request="r2") == t.default
    assert t.route(GLOBEX_SECRET, named="acme") == Route("globex", "globex")
    assert t.stats() == {"rejected_credential": 5, "ignored_tenant_name": 2}
    assert caplog.text.count("names a tenant itself") == 1
    assert caplog.text.count("no tenant's: not cached") == 1  # rate-limited
    for s in (ACME_SECRET, GLOBEX_SECRET):
        assert s not in caplog.text
    # the pool registers the tenants without their routing keys
    tenants = pool_tenants(check_config(cfg))
    assert [x.id for x in tenants] == ["default", "acme", "globex"] and tenants[1].quota_bytes == 1 << 20


@pytest.mark.parametrize(("tenants", "match"), [
    ([{"id": "acme", "request_secret": "short"}], "16-128 characters"),
    ([{"id": "acme", "request_secret": "a/b" + "x" * 20}], "16-128 characters"),
    ([{"id": "acme", "request_secret": ACME_SECRET}, {"id": "globex", "request_secret": ACME_SECRET}],
     "the same request secret"),
    ([{"id": "acme", "request_secret": "x" * 20}, {"id": "x" * 20}], "is a tenant id"),
    ([{"id": "acme", "request_secret": 12345678901234567}], "request_secret is a non-empty string"),
    ([{"id": "acme", "secret": ACME_SECRET}], "unknown settings"),
    ([{"request_secret": ACME_SECRET}], "dict with an 'id'"),
    ("acme", "a list of tenant ids"),
])
def test_bad_tenant_entries_are_refused_without_showing_the_secret(tenants, match):
    with pytest.raises(BadRequest, match=match) as e:
        Tenancy(config("ten-bad", tenants=tenants, tenant="acme"))
    assert ACME_SECRET not in str(e.value)


def test_the_default_tenant_must_be_configured():
    with pytest.raises(BadRequest, match="'mallory' is not one of the pool's tenants"):
        Tenancy(config("ten-default", tenants=["acme"], tenant="mallory"))
    assert Tenancy(config("ten-default", tenants=["acme", "b"])).default.tenant == "acme"  # no tenant: the first
    assert Tenancy(config("ten-default", tenants=["acme", "b"]), fallback="b").default.tenant == "b"


def test_a_secured_local_pool_issues_credentials_and_derives_request_secrets(tmp_path):
    path, auth = secret_file(tmp_path)
    cfg = config("ten-secured", secret_file=path, tenant="default", tenants=["default", "acme", "globex"])
    t = Tenancy(cfg)
    assert t.secured and t.reachable == ["acme", "default", "globex"]
    acme = t.route(request_secret(auth.issue("acme")))  # what the operator hands acme's API users
    assert acme.tenant == "acme" and acme.pool_as == auth.issue("acme")
    assert t.default.pool_as == auth.issue("default")
    assert t.route(request_secret(Authority(new_secret()).issue("acme"))) is None  # another pool's
    # the pool open_pool gives takes exactly those credentials, and refuses bare names
    pool = open_pool(SPEC, cfg)
    assert pool.auth.secured
    tokens = list(range(8))
    keys = pool.keys(acme.pool_as, tokens)
    assert pool.save(acme.pool_as, keys, [torch.ones(SPEC.chunk_shape)] * 2) == 2
    assert pool.lookup(acme.pool_as, keys) == 8
    globex = t.route(request_secret(auth.issue("globex")))
    assert pool.lookup(globex.pool_as, pool.keys(globex.pool_as, tokens)) == 0
    assert pool.lookup(globex.pool_as, keys) == 0  # acme's own keys, asked by globex: its own scope
    with pytest.raises(Unauthorized):
        pool.lookup("acme", keys)


def test_given_credentials_are_checked_and_explicit_secrets_win(tmp_path):
    path, auth = secret_file(tmp_path)
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({"acme": auth.issue("acme"), "globex": auth.issue("globex"),
                                 "other": auth.issue("other")}))
    creds.chmod(0o600)
    cfg = config("ten-creds", secret_file=path, credentials_file=str(creds),
                 tenants=["default", "acme", {"id": "globex", "request_secret": GLOBEX_SECRET}])
    t = Tenancy(cfg)
    assert t.route(request_secret(auth.issue("acme"))).pool_as == auth.issue("acme")
    assert t.route(GLOBEX_SECRET) == Route("globex", auth.issue("globex"))
    assert t.route(request_secret(auth.issue("globex"))) is None  # the explicit secret replaces the derived one
    forged = Authority(new_secret()).issue("acme")
    with pytest.raises(BadRequest, match="does not verify") as e:
        Tenancy({**cfg, "tenants": ["default", {"id": "acme", "credential": forged}]})
    assert forged not in str(e.value)
    with pytest.raises(BadRequest, match="is for 'globex'"):
        Tenancy({**cfg, "tenants": ["default", {"id": "acme", "credential": auth.issue("globex")}]})
    with pytest.raises(BadRequest, match="not a kvpool credential"):
        Tenancy({**cfg, "tenants": ["default", {"id": "acme", "credential": "acme"}]})


def test_credentials_files_that_are_missing_or_malformed_say_so(tmp_path):
    path, auth = secret_file(tmp_path)
    base = config("ten-files", secret_file=path, tenants=["default"])
    with pytest.raises(BadRequest, match="cannot read it"):
        Tenancy({**base, "credentials_file": str(tmp_path / "nope.json")})
    bad = tmp_path / "bad.json"
    for text, match in (("{", "not JSON"), ('["kvp1.x"]', "JSON object"), ('{"default": 1}', "JSON object")):
        bad.write_text(text)
        bad.chmod(0o600)
        with pytest.raises(BadRequest, match=match):
            Tenancy({**base, "credentials_file": str(bad)})


def test_credentials_for_an_open_local_pool_are_refused(tmp_path):
    cred = Authority(new_secret()).issue("acme")
    with pytest.raises(BadRequest, match="no pool secret"):
        Tenancy(config("ten-nosecret", tenants=[{"id": "acme", "credential": cred}]))


def test_a_cluster_pool_takes_credentials_from_the_config(tmp_path):
    auth = Authority(new_secret())  # the cluster's; the engine never holds it
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({"acme": auth.issue("acme")}))
    creds.chmod(0o600)
    cfg = {"backend": "node", "tenants": ["acme", "globex"], "tenant": "acme", "credentials_file": str(creds)}
    with pytest.raises(BadRequest, match=r"tenants \['globex'\] have no credential"):
        Tenancy({**cfg, "degraded": True})  # not asked of the pool at start: refused here
    # asked of the pool at start (connectors.pool_start names the fix): passed on as the bare id
    assert Tenancy(cfg).pool_routes() == {"acme": auth.issue("acme"), "globex": "globex"}
    t = Tenancy({**cfg, "tenants": ["acme", {"id": "globex", "credential": auth.issue("globex")}]})
    assert t.secured and t.default.pool_as == auth.issue("acme")
    assert t.route(request_secret(auth.issue("globex"))).tenant == "globex"
    # $KVPOOL_CREDENTIAL gives the tenant it names its credential
    t = Tenancy({"backend": "node", "tenants": ["acme"]}, env={"KVPOOL_CREDENTIAL": auth.issue("acme")})
    assert t.default == Route("acme", auth.issue("acme"))
    assert not Tenancy({"backend": "node", "tenants": ["acme"]}, env={}).secured
    with pytest.raises(BadRequest, match="secret_file secures a local pool"):
        check_config({"backend": "node", "secret_file": "/x"})


def test_the_environment_secures_a_local_pool_and_every_opener_shares_its_secret(tmp_path, monkeypatch):
    secret = new_secret()
    monkeypatch.setenv("KVPOOL_SECRET", secret)
    cfg = config("ten-env", tenants=["default"])
    t = Tenancy(cfg)
    assert t.secured and t.default.pool_as == Authority(secret).issue("default")
    assert open_pool(SPEC, cfg).auth.secured
    other, _ = secret_file(tmp_path)
    with pytest.raises(BadRequest, match="already open with another pool secret"):
        pool_authority({**cfg, "secret_file": other})
    monkeypatch.delenv("KVPOOL_SECRET")
    with pytest.raises(BadRequest, match="already open with another pool secret"):
        open_pool(SPEC, cfg)
    close_local_pools()
    assert not open_pool(SPEC, cfg).auth.secured  # a fresh pool of that name, open
