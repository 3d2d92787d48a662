"""How tenants are configured when a pool starts or a node joins."""

import pytest


def test_a_joining_shard_keeps_the_quotas_the_operator_set():
    from kvpool.cluster.shard import tenants_to_register

    config = [{"id": "a"}, {"id": "b", "quota_bytes": 10}, {"id": "c"}, {"id": "d", "priority": "high"}]
    assert [t["id"] for t in tenants_to_register(config, known={"a", "b", "d"})] == ["b", "c", "d"]
    assert tenants_to_register(config, known=set()) == config


def test_up_parses_tenants_with_quotas_and_priorities():
    from kvpool.cli import parse_tenant
    from kvpool.errors import BadRequest

    assert parse_tenant("acme:40GiB:high") == {"id": "acme", "quota_bytes": 40 << 30, "priority": "high"}
    assert parse_tenant("b") == {"id": "b"} and parse_tenant("c::low") == {"id": "c", "priority": "low"}
    with pytest.raises(BadRequest, match="id\\[:quota"):
        parse_tenant("a:1:2:3")
