"""Attacks on a secured node's socket through the operations that took no credential: ``stage``
(a connection's staging file in the node's run dir: 32 connections pinned 256 MiB of tmpfs) and
``report`` (an engine's figures for `kvpool stats`: a spoofed "degraded" engine, 200 MiB of
reports). Both verify the caller's credential before anything is made or kept now; a tenant's
staging files on a node and its engines reporting are capped (429); a report's size is capped
(400). And the failure that was silent: a run dir without room for a second engine's staging file
made its puts and gets return 0; now the shard answers a typed 507 naming the fix, which the
engine logs once and counts, and goes on writing and reading without a staging file.

One pool for the module, its run dir a small tmpfs of its own where the machine lets the test
mount one (else a folder, and the full-run-dir test is skipped)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time

import pytest
from conftest import cluster_pool, make_keys, payload, wait_for

from kvpool.auth import Authority, new_secret
from kvpool.cluster.node_caps import MAX_ENGINES_PER_TENANT, STAGE_TENANT_MIB
from kvpool.errors import BadRequest, LimitExceeded, StagingFull, Unauthorized
from kvpool.node import messages as m
from kvpool.node import wire
from kvpool.node.staging import STAGE_BYTES, SUFFIX

NS = "kvpool-node-attacks-stage"
PAGE = 16 << 10
SECRET = new_secret()
AUTH = Authority(SECRET)
ALICE, BOB = AUTH.issue("alice"), AUTH.issue("bob")
FORGED = Authority(new_secret()).issue("alice")
PER_TENANT = STAGE_TENANT_MIB << 20  # the default cap: 8 staging files of 8 MiB
ROOM_MIB = STAGE_TENANT_MIB + 2 * (STAGE_BYTES >> 20) + 2  # alice's cap, one of bob's, the slab: not two of bob's


def _mount_tmpfs(path: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={ROOM_MIB}m,mode=0700", "tmpfs", path],
                       capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.fixture(scope="module")
def pool():
    run = tempfile.mkdtemp(prefix="kvpool-stage-")
    small = _mount_tmpfs(run)
    try:
        with cluster_pool(run, 1, NS, store={"page_bytes": PAGE, "dram_pages": 32},
                          tenants=[{"id": "alice"}, {"id": "bob"}], ttl_s=2.0, secret=SECRET) as cp:
            c = cp.client()
            yield {"run": run, "small": small, "client": c, "cp": cp}
            c.close()
    finally:
        if small:
            subprocess.run(["umount", "-l", run], capture_output=True, timeout=30)
        shutil.rmtree(run, ignore_errors=True)


def stagings(run: str) -> set[str]:
    return {n for n in os.listdir(run) if n.endswith(SUFFIX)}


def channel(c) -> wire.Channel:
    return c._dial(c._attached().info["socket"], time.monotonic() + 5)


def ask(ch: wire.Channel, op: str, fields: list):
    """One raw request: (ok, result or the typed error)."""
    ch.send([op, m.WIRE_VERSION, fields, 5.0, []], deadline=time.monotonic() + 5)
    ok, r, _ = ch.recv_header(deadline=time.monotonic() + 5)
    return ok, r if ok else wire.decode_error(r)


def staging_stats(c) -> dict:
    return c.shard_stats()["staging"]


def test_stage_needs_the_callers_credential_and_makes_nothing_without_one(pool):
    c, run = pool["client"], pool["run"]
    before = stagings(run)
    ch = channel(c)
    for fields, err in (([], BadRequest), ([""], Unauthorized), (["alice"], Unauthorized), ([FORGED], Unauthorized)):
        ok, e = ask(ch, "stage", fields)
        assert not ok and isinstance(e, err), (fields, e)
        assert stagings(run) == before  # nothing made in the run dir
    ok, r = ask(ch, "stage", [ALICE])
    assert ok and os.path.basename(r["path"]) in stagings(run) - before
    assert os.stat(r["path"]).st_mode & 0o777 == 0o600
    assert staging_stats(c)["by_tenant"].get("alice") == r["nbytes"]  # charged to its tenant
    ch.close()
    wait_for(lambda: stagings(run) == before and "alice" not in staging_stats(c)["by_tenant"], 5,
             what="the staging file removed and its charge given back with its connection")


def test_a_tenants_staging_files_on_a_node_are_capped(pool):
    c = pool["client"]
    held, refused = [], None
    try:
        for _ in range(PER_TENANT // STAGE_BYTES + 1):
            ch = channel(c)
            held.append(ch)
            ok, r = ask(ch, "stage", [ALICE])
            if not ok:
                refused = r
                break
        assert isinstance(refused, LimitExceeded) and refused.status == 429, refused
        assert len(held) == PER_TENANT // STAGE_BYTES + 1  # refused only past the cap
        assert "KVPOOL_STAGE_MIB_PER_TENANT" in str(refused)  # how to raise it
        st = staging_stats(c)
        assert st["by_tenant"]["alice"] == PER_TENANT and st["refused_cap"] >= 1
        held.append(channel(c))
        ok, r = ask(held[-1], "stage", [BOB])  # another tenant is not held up by alice's
        assert ok, r
    finally:
        for ch in held:
            ch.close()
    wait_for(lambda: not staging_stats(c)["by_tenant"], 5, what="every charge given back")
    assert c.put(ALICE, make_keys(2, seed=5), [payload(i, PAGE) for i in range(2)]) == 2  # and alice writes on


def _reports(pool) -> dict:
    import ray

    from kvpool.cluster.controller import CONTROLLER

    return ray.get(ray.get_actor(CONTROLLER, namespace=NS).reports.remote(), timeout=10)


def test_report_needs_a_credential_and_is_kept_with_its_tenant(pool):
    c = pool["client"]
    ch = channel(c)
    spoof = {"degraded": True, "loads": 0, "recomputes": 10**9}
    for fields, err in ((["vllm alice pid 1", spoof], BadRequest), (["", "vllm alice pid 1", spoof], Unauthorized),
                        (["alice", "vllm alice pid 1", spoof], Unauthorized),
                        ([FORGED, "vllm alice pid 1", spoof], Unauthorized)):
        ok, e = ask(ch, "report", fields)
        assert not ok and isinstance(e, err), (fields, e)
    ok, _ = ask(ch, "report", [ALICE, "vllm alice pid 1", {"loads": 3, "recomputes": 1, "every_s": 60.0}])
    assert ok
    wait_for(lambda: "vllm alice pid 1" in _reports(pool), 10, what="alice's report at the controller")
    # bob, a tenant of the pool, reports under alice's engine's name: kept apart, never over hers
    ok, _ = ask(ch, "report", [BOB, "vllm alice pid 1", {**spoof, "every_s": 60.0}])
    assert ok
    wait_for(lambda: "vllm alice pid 1 [bob]" in _reports(pool), 10, what="bob's report")
    got = _reports(pool)
    assert got["vllm alice pid 1"]["tenant"] == "alice" and not got["vllm alice pid 1"].get("degraded")
    assert got["vllm alice pid 1 [bob]"]["tenant"] == "bob"
    ch.close()
    # the engine's client sends its reports with the credential the shard last accepted from it
    c.report("engine of the client", {"loads": 1})
    wait_for(lambda: _reports(pool).get("engine of the client", {}).get("tenant") == "alice", 10,
             what="the client's report")


def test_oversize_reports_and_too_many_engines_are_refused(pool):
    c = pool["client"]
    ch = channel(c)
    for name, figures in (("big", {f"f{i}": i for i in range(1000)}), ("big", {"x": "y" * 100_000}),
                          ("big", {"x" * 10_000: 1}), ("n" * 10_000, {"loads": 1}), ("big", {"x": [1] * 1000}),
                          ("big", {"x": {"nested": 1}}), ("", {"loads": 1})):
        ok, e = ask(ch, "report", [ALICE, name, figures])
        assert not ok and isinstance(e, BadRequest), (name[:20], str(figures)[:40], e)
    refused = None
    for i in range(MAX_ENGINES_PER_TENANT + 1):
        ok, r = ask(ch, "report", [BOB, f"bob engine {i}", {"loads": i}])
        if not ok:
            refused = (i, r)
            break
    assert refused is not None and refused[0] >= MAX_ENGINES_PER_TENANT - 2, refused  # bob sent one before
    assert isinstance(refused[1], LimitExceeded) and refused[1].status == 429
    ok, _ = ask(ch, "report", [BOB, "bob engine 0", {"goodbye": True}])  # a goodbye frees its place
    assert ok
    ok, r = ask(ch, "report", [BOB, "bob engine new", {"loads": 1}])
    assert ok, r
    ok, r = ask(ch, "report", [ALICE, "alice engine", {"loads": 1}])  # another tenant's cap is its own
    assert ok, r
    ch.close()


def test_a_full_run_dir_is_a_typed_error_the_engine_logs_once_counts_and_serves_on(pool, caplog):
    if not pool["small"]:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "needs a tmpfs of the test's own (mount, as root) for a run dir that fills")
    c, run = pool["client"], pool["run"]
    held, full = [], None
    try:
        for who in (ALICE, BOB):
            for _ in range(PER_TENANT // STAGE_BYTES + 1):
                ch = channel(c)
                held.append(ch)
                ok, r = ask(ch, "stage", [who])
                if not ok:
                    if isinstance(r, StagingFull):
                        full = r
                    break
            if full is not None:
                break
        assert isinstance(full, StagingFull) and full.status == 507, full
        assert run in str(full) and "MiB free" in str(full) and "more room" in str(full)  # the fix
        caplog.set_level(logging.WARNING, logger="kvpool.node")
        engine = pool["cp"].client()  # a second engine on the node, now
        try:
            keys = make_keys(3, seed=40)
            assert engine.put(BOB, keys, [payload(i, PAGE) for i in range(3)]) == 3  # stored all the same
            assert [bytes(a) for a in engine.get(BOB, keys)] == [bytes(payload(i, PAGE)) for i in range(3)]
            for ch in (channel(engine), channel(engine)):  # more connections refused: counted, not logged again
                assert engine._stage(ch, time.monotonic() + 5, BOB) is None
                ch.close()
            assert engine.put(BOB, make_keys(2, seed=41), [payload(i, PAGE) for i in range(2)]) == 2
            assert engine.counts["stage_refused"] >= 3 and engine.counts["put_failed"] == 0
            logged = [r for r in caplog.records if "staging file" in r.getMessage()]
            assert len(logged) == 1 and "more room" in logged[0].getMessage(), [r.getMessage() for r in logged]
        finally:
            engine.close()
        st = staging_stats(c)
        assert st["refused_full"] >= 3 and "more room" in st["last_refused"]
        from kvpool.cluster.stats_view import format_stats

        shown = format_stats({"version": 1, "shards": {pool["cp"].head: c.shard_stats()}})
        assert "STAGING REFUSED" in shown and "more room" in shown  # what `kvpool stats` prints
    finally:
        for ch in held:
            ch.close()


def test_the_controller_takes_reports_only_from_the_pools_own_processes(pool):
    """Over Ray, past the shards: a report straight to the controller with no credential, a forged
    one or a tenant's is refused and kept nowhere (a spoofed "degraded" engine under alice's name);
    the pool's own with an oversize report is a 400. The shards' forwarding still arrives (above)."""
    import ray

    from kvpool.cluster.controller import CONTROLLER
    from kvpool.errors import Forbidden

    ctl = ray.get_actor(CONTROLLER, namespace=NS)
    spoof = {"degraded": True, "loads": 0, "recomputes": 10**9, "tenant": "alice"}
    for kwargs, err in (({}, Unauthorized), ({"credential": FORGED}, Unauthorized), ({"credential": ALICE}, Forbidden)):
        with pytest.raises(err):  # today: kept, shown as alice's engine
            ray.get(ctl.report.remote("spoofed engine", spoof, **kwargs), timeout=10)
    with pytest.raises(BadRequest):
        ray.get(ctl.report.remote("big", {"x": "y" * 100_000}, credential=AUTH.pool_credential()), timeout=10)
    got = _reports(pool)
    assert "spoofed engine" not in got and "big" not in got, sorted(got)


def test_only_the_engines_tenant_or_the_operator_clears_a_listed_engine(pool, tmp_path, monkeypatch):
    """`kvpool stats --forget NAME` (an engine listed as silent, its process gone): a goodbye with a
    credential of the tenant it reports as, issued from the pool secret where that is; another
    tenant's clears nothing and says whose credential it takes."""
    import argparse

    from kvpool import stats_cli
    from kvpool.errors import Forbidden

    name = "vllm gone pid 7"
    ch = channel(pool["client"])
    ok, _ = ask(ch, "report", [ALICE, name, {"loads": 1, "every_s": 60.0}])
    ch.close()
    assert ok
    wait_for(lambda: name in _reports(pool), 10, what="the engine's report at the controller")
    monkeypatch.delenv("KVPOOL_CREDENTIAL", raising=False)
    monkeypatch.setattr(stats_cli, "FORGET_WAIT_S", 2.0)

    def forget(**kw) -> int:
        return stats_cli._stats(argparse.Namespace(**{"forget": name, "credential": None, "secret_file": None,
                                                      "json": False, "ray_address": None, **kw}))

    with pytest.raises(Forbidden, match="only a credential of 'alice' clears it"):
        forget(credential=BOB)
    assert name in _reports(pool)
    secret = tmp_path / "pool-secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    assert forget(secret_file=str(secret)) == 0  # the operator's machine: alice's credential issued from the secret
    assert name not in _reports(pool)
