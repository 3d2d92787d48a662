"""`kvpool stats` lists each engine once, with its tenants beneath, and counts as the engine does.

The path an engine's figures take, each piece the real one: the vLLM connector's counts
(connectors/vllm_figures.py ``Counts``, fed as its scheduler feeds them), its ``Reporter`` (one
credential for every report), the node client's ``report`` (the credential the shard last
accepted, unless one is given), the shard's verdict on that credential (the tenant a report is
kept under), the controller's ``Reports`` and what `kvpool stats` makes of them
(cluster/pool_stats.py, cluster/stats_view.py). The figures are checked against what vLLM 0.32
counts on its /metrics for the same requests (``vllm:prompt_tokens_total``: a request once, with
its first token; ``vllm:prompt_tokens_cached_by_source_total{source="host"}``: the connector's
tokens at the admission of a request not preempted), computed here by those rules.
"""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

from conftest import wait_for

from kvpool.auth import Authority, new_secret
from kvpool.cluster.pool_stats import summarize
from kvpool.cluster.reports import Reports
from kvpool.cluster.stats_view import format_stats
from kvpool.connectors.pools import Reporter
from kvpool.connectors.vllm_figures import MAX_TENANTS_REPORTED, NO_TENANT, OTHERS, Counts, engine_name
from kvpool.node.client import NodeClient

AUTH = Authority(new_secret())
TENANTS = ["default", "acme", "globex", "initech", "umbrella", "hooli"]
CREDS = {t: AUTH.issue(t) for t in TENANTS}
NAME = "vllm 127.0.0.1:8000 (tiny)"


class Shard:
    """The shard's side of a report (cluster/service.py ``report``): the credential verified, the
    figures kept under its tenant by the controller's Reports, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reports = Reports(clock=lambda: self.now)

    def call(self, msg):
        self.reports.add(msg.name, {**msg.figures, "tenant": AUTH.verify(msg.credential).tenant})
        return None, []


class Client(NodeClient):
    """The engine's node client, its socket replaced by the shard above; ``serve(tenant)`` is a
    call of that tenant's the shard accepted (what the client remembers as its last credential)."""

    def __init__(self, shard: Shard) -> None:  # no socket, no run dir
        self.counts, self.last_credential, self._shard = Counter(), None, shard

    def call(self, msg, *args, **kwargs):
        return self._shard.call(msg)

    def serve(self, tenant: str) -> None:
        self.last_credential = CREDS[tenant]


def request(prompt: int, preempted: int = 0, first_token: bool = True):
    """vLLM's Request as the connector reads it at admission and at finish."""
    return SimpleNamespace(num_prompt_tokens=prompt, num_preemptions=preempted,
                           prefill_stats=None if first_token else object())


class Engine:
    """A vLLM engine's scheduler connector as far as its figures go, and vLLM's own counters for
    the same requests."""

    def __init__(self, client: Client, name: str = NAME) -> None:
        self.client, self.counts = client, Counts()
        reports = client._shard.reports
        self.vllm = {"prompt_tokens": 0, "host": 0}
        self.by_tenant: dict[str, dict] = {}  # the same, per tenant
        self.reporter = Reporter(client, name, self.figures, every_s=3600.0, credential=CREDS["default"])
        # its first heartbeat, at once; the next in an hour: the test sends the rest (``report``)
        wait_for(lambda: name in reports.live(), 5, what="the engine's first report")

    def figures(self) -> dict:
        return self.counts.figures({"loads": 0, "recomputes": 0}, {"degraded": False})

    def serve(self, tenant: str, prompt: int, offered: int) -> None:
        self.client.serve(tenant)  # its lookup and its load went with the tenant's credential
        counted = self.counts.admitted(False, tenant, request(prompt), offered)
        if offered:
            self.counts.loaded(offered)
        self.counts.finished(counted, tenant, request(prompt))
        self.vllm["prompt_tokens"] += prompt
        self.vllm["host"] += offered
        mine = self.by_tenant.setdefault(tenant, {"prompt_tokens": 0, "pool_tokens": 0})
        mine["prompt_tokens"] += prompt
        mine["pool_tokens"] += offered

    def report(self, reports: Reports, name: str = NAME) -> None:
        self.reporter.send(self.figures())
        want = self.counts.c["requests"]
        wait_for(lambda: reports.live().get(name, {}).get("requests") == want, 5, what="the report at the controller")


def test_an_engine_serving_six_tenants_is_listed_once_and_adds_up_to_vllms_counters():
    shard = Shard()
    engine = Engine(Client(shard))
    try:
        for rnd in range(3):  # cumulative reports, each sent after another tenant's request
            for i, tenant in enumerate(TENANTS):
                engine.serve(tenant, 300 + 10 * i, 256 if (rnd + i) % 2 else 0)
                engine.report(shard.reports)
        st = summarize(0, {}, shard.reports.live(), "single-node")
        assert list(st["engines"]) == [NAME], list(st["engines"])  # once, whichever tenant it served last
        e = st["engines"][NAME]
        assert e["tenant"] == "default" and e["requests"] == 18
        assert (e["prompt_tokens"], e["pool_tokens"]) == (engine.vllm["prompt_tokens"], engine.vllm["host"])
        assert e["tenants"] == engine.by_tenant
        assert st["tenants"] == e["tenants"]  # one engine: the tenants' totals are its own
        text = format_stats(st)
        assert text.count(NAME) == 1, text
        assert f"as vLLM counts them: {engine.vllm['host']} of {engine.vllm['prompt_tokens']} prompt tokens" in text
        assert "\n      acme: 512 of 930 prompt tokens from the pool (55.1%)\n      default: " in text, text
    finally:
        engine.reporter.close()


def test_counts_follow_vllms_rules_and_the_tenants_always_add_up():
    c = Counts()
    r = request(300, first_token=False)
    counted = c.admitted(False, "a", r, 256)
    assert counted and (c.c["requests"], c.c["prompt_tokens"], c.c["pool_tokens"]) == (1, 300, 256)
    r.num_preemptions = 1  # preempted, back: vLLM counts neither its prompt again nor the tokens it reloads
    assert c.admitted(counted, "a", r, 256) and (c.c["requests"], c.c["pool_tokens"]) == (1, 256)
    r.prefill_stats = None  # its first token: vLLM counted its prompt
    c.finished(counted, "a", r)
    aborted = request(100, first_token=False)  # finished before its first token: vLLM never counted its prompt,
    c.finished(c.admitted(False, "b", aborted, 64), "b", aborted)  # but the tokens offered, at admission
    stranger = request(50)  # a request secret that is nobody's: counted, as no tenant
    c.finished(c.admitted(False, "", stranger, 0), "", stranger)
    f = c.figures({}, {})
    assert (f["requests"], f["prompt_tokens"], f["pool_tokens"]) == (3, 350, 320), f
    assert (f["tenant a prompt_tokens"], f["tenant b prompt_tokens"], f[f"tenant {NO_TENANT} prompt_tokens"]) == \
        (300, 0, 50)
    # more tenants than a report holds: the smallest summed, so they still add up
    for i in range(2 * MAX_TENANTS_REPORTED):
        c.admitted(False, f"t{i}", request(10 + i), i)
    f = c.figures({"loads": 0}, {"degraded": False})
    tenants = {k.split(" ")[1] for k in f if k.startswith("tenant ")}
    assert len(tenants) == MAX_TENANTS_REPORTED and OTHERS in tenants and "a" in tenants
    for what in ("prompt_tokens", "pool_tokens"):
        assert sum(v for k, v in f.items() if k.startswith("tenant ") and k.endswith(what)) == f[what], what
    assert len(f) + 2 <= 64  # with every_s and the tenant: what one report may hold (kvpool.node.messages)


def test_a_data_parallel_servers_engines_are_listed_apart_and_add_up():
    """Each engine of ``--data-parallel-size 2`` has its own scheduler and counts (vLLM's /metrics
    labels them engine="0", "1"): one name each, never the same name overwritten by turns."""
    names = [engine_name("m", "tiny", dp_rank=i) for i in range(2)]
    assert names == [f"{engine_name('m', 'tiny')} engine {i}" for i in range(2)]  # one engine: no rank in its name
    shard = Shard()
    engines = [Engine(Client(shard), name) for name in names]
    try:
        for i, (e, name) in enumerate(zip(engines, names)):
            e.serve("acme", 300, 256 * i)
            e.serve("globex", 100, 0)
            e.report(shard.reports, name)
        st = summarize(0, {}, shard.reports.live(), "single-node")
        assert sorted(st["engines"]) == sorted(names)
        assert st["tenants"] == {"acme": {"prompt_tokens": 600, "pool_tokens": 256},
                                 "globex": {"prompt_tokens": 200, "pool_tokens": 0}}
    finally:
        for e in engines:
            e.reporter.close()


def test_a_silent_engine_stays_listed_until_its_goodbye_or_a_long_expiry():
    shard = Shard()
    reports = shard.reports
    reports.add("vllm a", {"requests": 4, "every_s": 5.0, "tenant": "acme"})
    reports.add("vllm b", {"requests": 2, "every_s": 5.0, "tenant": "acme"})
    shard.now += 14  # under 3 intervals: not silent yet
    assert not any(e["silent"] for e in reports.live().values())
    shard.now += 46  # a: killed 60 s ago; b reports on
    reports.add("vllm b", {"requests": 5, "every_s": 5.0, "tenant": "acme"})
    live = reports.live()
    assert live["vllm a"]["silent"] and live["vllm a"]["silent_s"] == 60 and live["vllm a"]["requests"] == 4
    assert not live["vllm b"]["silent"] and live["vllm b"]["requests"] == 5  # the latest report, not a sum
    text = format_stats(summarize(0, {}, live, "single-node"))
    a, b = text.split("  vllm b")
    assert "SILENT for 60 s (reports every 5 s)" in a and "kvpool stats --forget 'vllm a'" in a and "24 h" in a
    assert "SILENT" not in b
    shard.now += 3600  # an hour later: still listed
    assert reports.live()["vllm a"]["silent_s"] == 3660
    reports.add("vllm b", {"goodbye": True, "tenant": "acme"})  # a clean shutdown, or `kvpool stats --forget`
    assert set(reports.live()) == {"vllm a"}
    reports.add("vllm a", {"goodbye": True, "tenant": "globex"})  # another tenant's goodbye clears nothing
    assert set(reports.live()) == {"vllm a"}
    shard.now += Reports.FORGET_AFTER_S
    assert reports.live() == {} and reports.expired == 1


def test_a_full_table_makes_room_by_forgetting_the_longest_silent():
    shard = Shard()
    reports = shard.reports
    reports.MAX_ENGINES = 2
    reports.add("old", {"every_s": 5.0})
    shard.now += 100
    reports.add("live", {"every_s": 5.0})
    reports.add("new", {"every_s": 5.0})  # "old" is silent: it makes room
    assert set(reports.live()) == {"live", "new"} and reports.refused == 0
    reports.add("newer", {"every_s": 5.0})  # nobody silent: refused
    assert set(reports.live()) == {"live", "new"} and reports.refused == 1


def test_stats_show_degraded_engines_failed_loads_and_silence():
    engines = {
        "vllm m pid 1": {"load_gbps": 1.0, "prefill_ms_per_token": 0.5, "loads": 3, "recomputes": 1,
                         "load_advantage": 4.0, "load_failures": 2, "failed_tokens": 3584, "degraded": False,
                         "every_s": 5.0, "silent": False, "silent_s": 1.0},
        "vllm n pid 2": {"load_gbps": None, "prefill_ms_per_token": None, "loads": 0, "recomputes": 0,
                         "degraded": True, "degraded_s": 42.0, "every_s": 5.0, "silent": True, "silent_s": 20.0,
                         "tenant": "acme"},
    }
    text = format_stats({"version": 1, "shards": {}, "engines": engines})
    m, n = text.split("  vllm n pid 2", 1)
    assert "3 loads (0 tokens from the pool), 1 declined by the break-even; 2 failed loads (3584 tokens " \
           "recomputed, not hits)" in m and "not measured yet" not in m
    assert "load and prefill speed: not measured yet" in n
    assert "DEGRADED" not in m and "SILENT" not in m
    assert "DEGRADED: its pool does not answer" in n and "42 s degraded" in n
    assert "SILENT for 20 s" in n


def test_stats_of_vllm_engines_add_up_per_engine_and_per_tenant():
    """Two servers' reports: each engine's line, its tenants beneath, and the tenants over both;
    a load that failed is no load (its tokens recomputed) but vLLM counted its tokens at admission."""
    engines = {}
    # (tenant, prompt tokens, tokens offered, of which loaded and kept)
    for name, reqs in (("vllm 127.0.0.1:8000 (m)", [("a", 600, 512, 512), ("a", 600, 0, 0), ("b", 300, 256, 0)]),
                       ("vllm 127.0.0.1:8001 (m)", [("a", 600, 512, 512)])):
        c = Counts()
        for tenant, prompt, offered, kept in reqs:
            c.finished(c.admitted(False, tenant, request(prompt), offered), tenant, request(prompt))
            if kept:
                c.loaded(kept)
            elif offered:
                c.add("load_failures")
                c.add("failed_tokens", offered)
        engines[name] = {**c.figures({"loads": 7, "recomputes": 0, "load_gbps": None,  # planned: not shown
                                      "prefill_ms_per_token": None}, {"degraded": False}), "tenant": "a"}
    text = format_stats(summarize(0, {}, engines, "single-node"))
    assert "1 loads (512 tokens from the pool) in 3 requests of 1500 prompt tokens: token hit rate 34.1%; " \
           "2 computed (0 of them declined by the break-even); 1 failed loads (256 tokens recomputed, not hits)" \
           in text, text
    assert "as vLLM counts them: 768 of 1500 prompt tokens from the pool (51.2%)" in text
    assert "1 loads (512 tokens from the pool) in 1 requests of 600 prompt tokens: token hit rate 85.3%" in text
    assert "      a: 512 of 1200 prompt tokens from the pool (42.7%)\n      b: 256 of 300" in text, text
    assert "  a: 1024 of 1800 prompt tokens from the pool (56.9%)" in text
    assert "  b: 256 of 300 prompt tokens from the pool (85.3%)" in text
    # the quickstart's parse of an engine's line (tests/engines/test_quickstart.py)
    assert re.findall(r"^\s+(\d+) loads \((\d+) tokens from the pool\)", text, re.M) == [("1", "512"), ("1", "512")]
