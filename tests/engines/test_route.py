"""``kvpool route`` through real engines, as a user runs it: two vLLM OpenAI servers, one on each
node of a two-node pool (each on a core of its own, publishing its KV events), and two routers in
front of both, ``tier-aware`` and ``round-robin`` (the set-up of ``kvpool bench route``:
kvpool.connectors.bench.route.Bed).

- The router keys a request as the engines' connector does: after vLLM's own caches are emptied,
  the router expects a prompt's whole chunks from the pool, on the node that saved them, and the
  engine loads exactly those from the pool; another tenant sending the same tokens is expected
  nothing anywhere (its decision reads only its own prefixes).
- A multi-turn workload from several tenants in both arms, interleaved: the answers are equal
  token for token, tier-aware keeps more of the prompts' tokens on the instance's own node (its
  GPU cache or its node's shard) than round-robin, which loads from the other node.
- A restarted router knows each instance's GPU cache before any new request (vLLM's replay of its
  KV events): it keeps nothing it cannot rebuild.
- An instance killed mid-workload (SIGKILL, streamed and whole answers in flight) under a steady
  load of three tenants: no request fails but those that were on it (a 502 or an error event,
  never a 503); every later one is answered by the other instance; the healthy instance is never
  marked down; and no request runs twice (each server logs every request it receives: their sum
  is at most the requests sent). The servers close idle kept-alive connections after 1 s, the
  router's health interval, so its probes and requests meet connections closing under them
  throughout the module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import need_engines, wait_for

need_engines("vllm")

from kvpool.connectors.bench.route import Bed  # noqa: E402
from kvpool.connectors.bench.route_load import Client, workload  # noqa: E402
from kvpool.connectors.bench.route_measure import Meter  # noqa: E402

SYSTEM, USER, ANSWER, TURNS = 512, 128, 8, 3
CONTEXT = SYSTEM + TURNS * (USER + ANSWER)
CHUNK = 256


@pytest.fixture(scope="module")
def bed():
    # NOTE: each server logs each request it receives ("Received request"): what the kill test counts
    # ... and closes a kept-alive connection idle for 1 s (vLLM's default 5 s): as often as the router
    # probes, so that a probe or a request often meets a connection the server is closing
    b = Bed("tiny", tenants=3, context=CONTEXT, progress=False, server_args=("--enable-log-requests",),
            server_env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "1"})
    try:
        yield b.start(chunks=400)
    finally:
        b.close()


def state(router) -> dict:
    return json.loads(urllib.request.urlopen(router.url + "/kvpool/route", timeout=10).read())


def whole(url: str, prompt: list[int], secret: str, max_tokens: int) -> str:
    """A non-streamed completion through the router: the instance that answered."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": secret}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.headers["x-kvpool-instance"]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"the router answered {e.code}: {e.read()[:400]!r}") from None


def received(server) -> int:
    """Requests the server has received so far (its log's "Received request" lines)."""
    with open(server.log_path, errors="replace") as f:
        return len(re.findall(r"Received request (?:cmpl|chatcmpl)-", f.read()))


def test_the_router_finds_the_engines_chunks_and_a_tenant_sees_only_its_own(bed):
    secret = bed.secrets[bed.ids["tier-aware"][0]]
    other = bed.secrets[bed.ids["tier-aware"][1]]
    conv = workload({"x": secret}, 1, 1, SYSTEM, USER, bed.cfg.vocab_size, seed=1000)[0]
    prompt = conv.prompt(0)  # 640 tokens: two whole chunks
    client = Client(bed.routers["tier-aware"].url, "bench")
    first = client.complete(prompt, secret, ANSWER)
    bed.reset_caches()
    saved_on = bed.shards[[f"http://127.0.0.1:{s.port}" for s in bed.servers].index(first["instance"])]
    meter = Meter(bed.servers, bed.pool, bed.cfg.num_key_value_heads)
    try:
        before = meter._snapshot()
        again = client.complete(prompt, secret, ANSWER)
        after = meter._after(before, again["instance"])
    finally:
        meter.close()
    whole = len(prompt) // CHUNK * CHUNK
    tiers = dict(kv.split("=") for kv in again["tiers"].split(","))
    assert int(tiers["gpu"]) == 0 and int(tiers["node"]) + int(tiers["remote"]) == whole, again["tiers"]
    assert again["instance"] == first["instance"] and int(tiers["node"]) == whole, (saved_on, again)
    host = after["servers"][again["instance"]]["cached_host"] - before["servers"][again["instance"]]["cached_host"]
    assert host == whole  # the engine loaded from the pool exactly what the router expected there
    assert again["tokens"] == first["tokens"]
    stranger = client.complete(prompt, other, ANSWER)  # another tenant, the same tokens
    assert stranger["tiers"] == f"gpu=0,node=0,remote=0,miss={len(prompt)}"
    assert stranger["tokens"] == first["tokens"]
    client.close()


def test_tier_aware_keeps_conversations_on_their_node_and_answers_as_round_robin(bed):
    meter = Meter(bed.servers, bed.pool, bed.cfg.num_key_value_heads)
    clients = {arm: Client(bed.routers[arm].url, "bench") for arm in bed.routers}
    try:
        bed.reset_caches()
        # NOTE: three conversations a turn, so that round-robin moves each one to the other instance every turn
        arms = {arm: workload({t: bed.secrets[t] for t in bed.ids[arm]}, 1, TURNS, SYSTEM, USER,
                              bed.cfg.vocab_size, seed=7) for arm in bed.routers}
        row = meter.run(arms, clients, TURNS, ANSWER)
    finally:
        meter.close()
        for c in clients.values():
            c.close()
    ta, rr = row["tier-aware"], row["round-robin"]
    for arm in ("tier-aware", "round-robin"):
        print(f"\n{arm}:", *(f"\n  {r['instance'][-5:]} expected {r['tiers_expected']}: gpu {r['gpu']} node {r['node']} "
                              f"remote {r['remote']}" for r in row[arm]["requests_detail"]))
    assert row["same_answers"]
    assert rr["remote_tokens"] > 0, rr  # round-robin loads the conversation from the other node
    assert ta["same_node_share"] > rr["same_node_share"] and ta["remote_tokens"] < rr["remote_tokens"], (ta, rr)
    print(f"\nrouted TTFT median: tier-aware {ta['ttft_median_s']:.3f} s, round-robin {rr['ttft_median_s']:.3f} s; "
          f"same-node tokens {ta['same_node_share']:.0%} vs {rr['same_node_share']:.0%}")


def test_a_restarted_router_knows_every_instances_gpu_cache_before_any_request(bed):
    before = [i["gpu_blocks"] for i in state(bed.routers["tier-aware"])["instances"]]
    assert all(before), before  # the workload above left blocks in both instances' caches
    router = bed.start_router("tier-aware")
    router.wait_ready()
    deadline = time.monotonic() + 20
    while [i["gpu_blocks"] for i in state(router)["instances"]] != before:  # vLLM's replay of what it holds
        assert time.monotonic() < deadline, (state(router), before)
        time.sleep(0.1)
    assert all(i["events"]["replayed"] > 0 for i in state(router)["instances"])


def test_an_instance_killed_mid_workload_fails_only_what_it_was_streaming(bed):
    router = bed.routers["tier-aware"]
    secrets = [bed.secrets[t] for t in bed.ids["tier-aware"]]
    convs = workload(dict(enumerate(secrets)), 2, 1, SYSTEM, USER, bed.cfg.vocab_size, seed=99)
    results: list[tuple[float, str, object]] = []  # (started at, outcome, instance or error)
    stop = threading.Event()

    def client_loop(i: int) -> None:
        c = Client(router.url, "bench", timeout_s=60)
        n = 0
        while not stop.is_set():
            conv = convs[(i + n) % len(convs)]
            n += 1
            started = time.monotonic()
            try:
                # long enough to be on it when killed; streamed and whole answers in turn
                got = c.complete(conv.prompt(0), conv.secret, 64)["instance"] if n % 2 else \
                    whole(router.url, conv.prompt(0), conv.secret, 64)
                results.append((started, "ok", got))
            except Exception as e:  # noqa: BLE001 - counted: the test's point
                results.append((started, "failed", repr(e)))
        c.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(3)]
    before = sum(received(s) for s in bed.servers)
    assert [i["downs"] for i in state(router)["instances"]] == [0, 0]  # neither was ever marked down
    for t in threads:
        t.start()
    victim = bed.servers[1]
    victim_url = f"http://127.0.0.1:{victim.port}"
    # killed once it has answered and is serving again (events, not a timer)
    wait_for(lambda: any(r[1] == "ok" and r[2] == victim_url for r in results[:])
             and state(router)["instances"][1]["inflight"] > 0, 120, interval_s=0.02,
             what="the victim to have answered and to be serving a request")
    before_kill = state(router)["instances"][1]["inflight"]
    killed_at = time.monotonic()
    os.killpg(victim.proc.pid, signal.SIGKILL)  # the server and its engine processes, at once
    # read again after the kill: a request the router sent it between the first read and the kill
    # is counted too (its failure shows only once the dead process's sockets close, later)
    streaming = max(before_kill, state(router)["instances"][1]["inflight"])
    wait_for(lambda: sum(r[0] > killed_at for r in results[:]) >= 6, 180,
             what="six requests started after the kill to end")
    stop.set()
    for t in threads:
        t.join(120)
    failed = [r for r in results if r[1] == "failed"]
    print(f"\n{len(results)} requests, {len(failed)} failed ({streaming} in flight on the victim at the kill)")
    assert not [r for r in failed if re.search(r"answered 503|'code': 503", r[2])], failed  # never a 503
    # no request ran twice: the servers received each at most once (one killed mid-stream may not
    # have logged it yet: at most the failed ones are missing)
    got = sum(received(s) for s in bed.servers) - before
    assert len(results) - len(failed) <= got <= len(results), (got, len(results), failed)
    views = state(router)["instances"]
    assert views[0]["downs"] == 0 and views[0]["up"], views[0]  # the healthy one: never marked down
    assert views[1]["downs"] == 1, views[1]
    assert len(failed) <= streaming, (streaming, failed)  # at most those in flight on it
    assert all(r[0] < killed_at for r in failed), (killed_at, failed)  # streaming when it was killed
    # NOTE: by start, not by end: a killed process's sockets close only once its memory is torn down,
    # which on a loaded machine takes seconds, so a cut stream can end well after the kill
    after = [r for r in results if r[0] > killed_at]
    assert after and all(r[1] == "ok" and r[2] != victim_url for r in after), after
    view = state(router)["instances"][1]
    assert not view["up"] and view["why_down"]
    assert any(r[1] == "ok" and r[2] == victim_url and r[0] < killed_at for r in results)  # it did serve before
