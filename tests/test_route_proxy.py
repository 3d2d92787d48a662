"""kvpool route's HTTP service against stand-in instances (small aiohttp servers that answer as
vLLM's OpenAI server does, and can refuse, die with a request on them, cut a stream, drop a health
probe's connection or hold requests): where requests go, what happens when an instance fails
(never a request run twice, never a healthy instance marked down), streaming, health, chat
templates rendered in bounded workers, per-tenant caps. The real thing (two vLLM servers on a
two-node pool) is tests/engines/test_route.py."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvpool.connectors.route.caps import TenantCaps
from kvpool.connectors.route.costs import OnlineCost
from kvpool.connectors.route.fleet import Fleet, InstanceSpec
from kvpool.connectors.route.plan import Planner
from kvpool.connectors.route.proxy import RouteService
from kvpool.connectors.route.render import Renderers
from kvpool.connectors.tenancy import Tenancy
from kvpool.routing import CostModel

ACME = "acme-route-secret-0123456789"
CFG = {"backend": "local", "pool": "route-proxy", "chunk_tokens": 8,
       "tenants": ["default", {"id": "acme", "request_secret": ACME}]}
PROMPT = list(range(100, 132))  # 32 tokens: four chunks of 8, eight blocks of 4
HEALTH_S = 0.2


class Stand:
    """An instance: answers like vLLM's server; ``mode`` makes it fail on the next completions."""

    def __init__(self, name: str) -> None:
        self.name, self.mode, self.running, self.sick, self.bodies = name, "ok", 0, False, []
        self.drop_health = 0  # the next this many /health probes have their connection closed, unanswered
        self.probes = 0  # /health probes answered
        self.release = asyncio.Event()  # mode "hold": completions wait for it
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kv_event_sources", self.no_events)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.server = TestServer(app)

    async def start(self) -> None:
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")

    async def no_events(self, request):
        return web.json_response({})

    async def models(self, request):
        return web.json_response({"data": [{"id": "tiny", "parent": None}]})

    async def health(self, request):
        if self.drop_health:  # as a server closing a kept-alive connection just as the probe is written
            self.drop_health -= 1
            request.transport.close()
            return web.Response()
        self.probes += 1
        return web.Response(status=503 if self.sick else 200)

    async def metrics(self, request):
        return web.Response(text=f'vllm:num_requests_running{{model_name="tiny"}} {self.running}.0\n'
                                 'vllm:num_requests_waiting{model_name="tiny"} 0.0\n')

    async def complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "die":  # the process died mid-prefill: the connection drops, no answer
            request.transport.close()
            await asyncio.sleep(0.2)
            return web.Response()
        if self.mode == "hold":
            await self.release.wait()
        if not body.get("stream"):
            return web.json_response({"instance": self.name, "choices": [{"text": "x"}],
                                      "usage": {"prompt_tokens": len(body.get("prompt") or ())}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            await out.write(f"data: {json.dumps({'instance': self.name, 'i': i})}\n\n".encode())
            await asyncio.sleep(0.02)
            if self.mode == "cut":
                request.transport.close()
                return out
        await out.write(b"data: [DONE]\n\n")
        return out


def events(tokens, salt=None) -> list[dict]:
    n = len(tokens) // 4
    return [{"type": "BlockStored", "block_hashes": list(range(1000, 1000 + n)), "parent_block_hash": None,
             "token_ids": tokens[: 4 * n], "block_size": 4, "medium": "GPU", "group_idx": 0,
             "extra_keys": [[salt] if salt and k == 0 else None for k in range(n)]}]


def run(test, n_stands: int = 2, pool=None, policy: str = "tier-aware", renderers=None, caps=None,
        events: list[str] | None = None):
    """Starts ``n_stands`` instances and the router over them, then ``await test(client, stands, service)``."""
    async def main():
        stands = [Stand(f"s{i}") for i in range(n_stands)]
        for s in stands:
            await s.start()
        tenancy = Tenancy(CFG, engine="test")
        fleet = Fleet([InstanceSpec(s.url, f"shard-{i}", (events or [""] * n_stands)[i]) for i, s in enumerate(stands)],
                      lambda salt: (r.tenant if (r := tenancy.of_secret(salt)) else None), "", health_s=HEALTH_S)
        service = RouteService(fleet, Planner(tenancy, pool, 8), policy,
                               OnlineCost(CostModel(prefill_s=1e-3, node_s=1e-5, remote_s=1e-4)),
                               connect_timeout_s=1.0, renderers=renderers, caps=caps)
        client = TestClient(TestServer(service.app()))
        await client.start_server()
        try:
            await until(lambda: all(u.up for u in fleet.instances))
            await test(client, stands, service)
        finally:
            await client.close()
            for s in stands:
                await s.server.close()
    asyncio.run(main())


async def until(cond, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


async def post(client, body: dict):
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body})
    return r, await r.read()


def test_a_prefix_draws_its_own_tenant_to_the_gpu_cache_holding_it_and_nobody_else():
    async def test(client, stands, service):
        for e in events(PROMPT):  # the default tenant's prompt is in the second instance's own cache
            service.fleet.instances[1].view.apply(e)
        r, _ = await post(client, {})
        assert r.headers["x-kvpool-instance"] == stands[1].url
        assert r.headers["x-kvpool-tiers"] == "gpu=32,node=0,remote=0,miss=0"
        r, _ = await post(client, {"cache_salt": ACME})  # the same tokens as acme: nothing of its own anywhere
        assert r.headers["x-kvpool-tiers"] == "gpu=0,node=0,remote=0,miss=32"
        assert r.headers["x-kvpool-instance"] == stands[0].url  # not drawn to the other tenant's cache
        assert stands[0].bodies[-1]["cache_salt"] == ACME  # the body passes unchanged
    run(test)


def test_an_instance_that_refuses_is_routed_around_and_marked_down():
    async def test(client, stands, service):
        await stands[0].server.close()  # gone: connections refused
        r, body = await post(client, {})
        assert r.status == 200 and json.loads(body)["instance"] == "s1"
        u = service.fleet.instances[0]
        await until(lambda: not u.up)  # once its probes on fresh connections failed too
        assert "ClientConnectorError" in u.why_down and "3 probes on fresh connections failed" in u.why_down
        for _ in range(3):  # no further request tries it
            r, body = await post(client, {})
            assert json.loads(body)["instance"] == "s1"
        text = (await (await client.get("/metrics")).read()).decode()
        assert f'kvpool_route_requests_total{{engine="{stands[0].url}",outcome="retried"}} 1.0' in text
        assert 'kvpool_route_instance_up{engine="%s"} 0.0' % stands[0].url in text
    run(test)


def test_a_request_that_reached_an_instance_is_never_sent_to_another():
    """An instance that dies with a request on it may have run it: a 502, and no second instance
    gets it; a stream it cuts ends with an error event (no [DONE]). One whose health still answers
    is not marked down for it."""
    async def test(client, stands, service):
        stands[0].mode = "die"
        r, body = await post(client, {})
        assert r.status == 502 and "not sent to another instance" in body.decode()
        assert (len(stands[0].bodies), len(stands[1].bodies)) == (1, 0)  # sent once, run at most once
        u = service.fleet.instances[0]
        await until(lambda: u.verifying is not None and u.verifying.done())
        assert u.up and u.downs == 0  # its /health answers on a fresh connection: not down
        stands[0].mode, stands[1].mode = "cut", "cut"
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "stream": True})
        assert r.status == 200
        with pytest.raises(Exception):  # noqa: B017 - the client sees the stream end mid-way, whatever its class
            await r.read()
        assert len(stands[0].bodies) + len(stands[1].bodies) == 2  # the streamed one, sent once too
        text = (await (await client.get("/metrics")).read()).decode()
        assert 'outcome="retried"' not in text
    run(test)


def test_a_streamed_answer_passes_through_in_order():
    async def test(client, stands, service):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "stream": True})
        text = (await r.read()).decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in text.split("\n\n") if x]
        assert lines[-1] == "data: [DONE]" and [json.loads(x[6:])["i"] for x in lines[:-1]] == [0, 1, 2]
        assert service.cost.samples == 1  # an idle instance's first byte: a clean sample
    run(test)


def test_no_instance_up_is_a_503_that_names_why_and_health_says_so():
    async def test(client, stands, service):
        for s in stands:
            s.sick = True
        await until(lambda: not any(u.up for u in service.fleet.instances), timeout_s=3 * HEALTH_S + 1)
        r, body = await post(client, {})
        assert r.status == 503 and "no engine instance is up" in body.decode() and "503" in body.decode()
        assert (await client.get("/health")).status == 503
        stands[1].sick = False
        await until(lambda: service.fleet.instances[1].up, timeout_s=3 * HEALTH_S + 1)
        r, body = await post(client, {})
        assert r.status == 200 and json.loads(body)["instance"] == "s1"
    run(test)


class _DeadIndex:
    def keys(self, tenant, tokens, **kw):
        return [b"k"] * (len(tokens) // 8)

    def locate(self, tenant, keys):
        raise ConnectionError("no index")


def test_a_dead_index_routes_by_load_and_is_counted():
    async def test(client, stands, service):
        got = []
        for _ in range(4):
            r, body = await post(client, {})
            assert r.status == 200
            got.append(json.loads(body)["instance"])
        assert got == ["s0", "s1", "s0", "s1"]  # least-loaded: idle instances in turn
        text = (await (await client.get("/metrics")).read()).decode()
        assert "kvpool_route_index_errors_total 4.0" in text
    run(test, pool=_DeadIndex())


def test_a_body_that_is_not_json_is_refused():
    async def test(client, stands, service):
        r = await client.post("/v1/completions", data=b"{not json")
        assert r.status == 400 and "not a JSON object" in (await r.text())
        state = await (await client.get("/kvpool/route")).json()
        assert [i["up"] for i in state["instances"]] == [True, True] and state["policy"] == "tier-aware"
    run(test)


def test_a_probe_dropped_on_a_kept_alive_connection_marks_no_healthy_instance_down():
    """A health probe whose connection the server closes as it is written (aiohttp's "Cannot write
    to closing transport" on a reused connection) is verified on fresh connections first: the
    instance stays up and keeps its event feed."""
    import zmq

    port = _free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")  # the router binds it (as for a vLLM that dials its router)

    async def test(client, stands, service):
        downs = []
        fleet, mark_down = service.fleet, service.fleet.mark_down
        fleet.mark_down = lambda u, why: (downs.append((u.name, why)), mark_down(u, why))
        u = fleet.instances[0]
        await until(lambda: u.feed is not None)
        feed = u.feed
        for s in stands:
            s.drop_health = 2
        probes = [s.probes for s in stands]
        await until(lambda: all(s.drop_health == 0 and s.probes >= n + 3 for s, n in zip(stands, probes)))
        assert downs == [] and all(x.up for x in fleet.instances) and u.feed is feed and feed.alive
    try:
        run(test, events=[f"tcp://127.0.0.1:{port}", ""])
    finally:
        pub.close(linger=0)


def test_while_one_instance_answers_no_request_gets_a_503():
    async def test(client, stands, service):
        await stands[0].server.close()  # killed
        stands[1].drop_health = 3  # and the survivor's kept-alive probes fail now and then
        statuses = []
        while stands[1].drop_health or len(statuses) < 40:
            r, body = await post(client, {})
            statuses.append(r.status)
            assert r.status != 200 or json.loads(body)["instance"] == "s1"
        assert set(statuses) == {200}, statuses
        assert service.fleet.instances[1].downs == 0
        await until(lambda: not service.fleet.instances[0].up)
    run(test)


def test_the_event_feeds_health_is_in_the_metrics():
    import zmq

    port = _free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")

    async def test(client, stands, service):
        u = service.fleet.instances[0]
        await until(lambda: u.feed is not None)
        seq = 0
        while not u.feed.batches:  # ZMQ's slow joiner: until one arrives
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([1.0, events(PROMPT), 0])])
            seq += 1
            await asyncio.sleep(0.02)
        frames = u.feed.frames
        pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockStored",
                                                                             "block_hashes": 5}], 0])])
        await until(lambda: u.feed.bad == 1)
        text = (await (await client.get("/metrics")).read()).decode()
        e0, e1 = stands[0].url, stands[1].url
        assert f'kvpool_route_events_alive{{engine="{e0}"}} 1.0' in text
        assert f'kvpool_route_events_alive{{engine="{e1}"}} 0.0' in text  # it publishes none
        assert f'kvpool_route_event_frames_total{{engine="{e0}"}} {frames + 1}.0' in text
        assert f'kvpool_route_event_bad_frames_total{{engine="{e0}"}} 1.0' in text
        assert f'kvpool_route_event_last_frame_age_seconds{{engine="{e0}"}}' in text
        assert f'kvpool_route_marked_down_total{{engine="{e0}"}} 0.0' in text
        state = await (await client.get("/kvpool/route")).json()
        assert state["instances"][0]["events"]["bad_frames"] == 1 and state["instances"][0]["events"]["alive"]
    try:
        run(test, events=[f"tcp://127.0.0.1:{port}", ""])
    finally:
        pub.close(linger=0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- chat templates, bounded
# NOTE: the server's own template reads a variable ``n`` and loops n x n on it: what a request's
# chat_template_kwargs can make of a template that reads one
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
            "{% if n is defined %}{% for i in range(n) %}{% for j in range(n) %}{% endfor %}{% endfor %}{% endif %}")
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "world", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    path = str(tmp_path_factory.mktemp("tokenizer"))
    fast.save_pretrained(path)
    return path


def test_chat_templates_render_in_bounded_workers_and_a_hostile_request_fails_alone(tokenizer_dir):
    async def chat(client, salt=None, **kw):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], **kw}
        r = await client.post("/v1/chat/completions", json={**body, **({"cache_salt": salt} if salt else {})})
        return r, (await r.read()).decode()

    async def test(client, stands, service):
        renderers = service.renderers
        await until(lambda: renderers.figures()["idle"] == 2, timeout_s=60)  # both workers hold the tokenizer
        r, _ = await chat(client)
        assert r.status == 200 and r.headers["x-kvpool-tiers"] == "gpu=0,node=0,remote=0,miss=4"  # rendered: 4 tokens
        # a template of the request's own, in its kwargs: refused before anything renders, as vLLM refuses it
        r, text = await asyncio.wait_for(chat(client, ACME, chat_template_kwargs={"chat_template": LOOP}), 5)
        assert r.status == 400 and "chat_template" in text and "may not set" in text
        # ... at the top level: vLLM's to take or refuse; the router does not run it (routed on load)
        r, _ = await chat(client, ACME, chat_template=LOOP)
        assert r.status == 200 and r.headers["x-kvpool-tiers"] == "gpu=0,node=0,remote=0,miss=0"
        sent = sum(len(s.bodies) for s in stands)
        # a variable the server's template reads, made to loop 100k x 100k: that request alone fails
        hostile = asyncio.ensure_future(chat(client, ACME, chat_template_kwargs={"n": 100_000}))
        await until(lambda: renderers.figures()["idle"] == 1)
        for salt in (None, ACME):  # meanwhile every tenant is served, its prompt rendered by the other worker
            r, _ = await chat(client, salt)
            assert r.status == 200 and r.headers["x-kvpool-tiers"].endswith("miss=4") and not hostile.done()
        r, _ = await post(client, {})  # and a prompt of token ids needs no worker
        assert r.status == 200 and not hostile.done()
        r, text = await asyncio.wait_for(hostile, 10)
        assert r.status == 400 and "--render-timeout" in text
        assert sum(len(s.bodies) for s in stands) == sent + 3  # the hostile one never reached an instance
        await until(lambda: renderers.figures()["workers"] == 2 and renderers.figures()["idle"] == 2, timeout_s=60)
        assert renderers.timeouts == 1
        r, _ = await chat(client, ACME)  # the killed worker was replaced
        assert r.status == 200 and r.headers["x-kvpool-tiers"].endswith("miss=4")
        text = (await (await client.get("/metrics")).read()).decode()
        assert "kvpool_route_render_timeouts_total 1.0" in text
        # a router whose workers are still loading the tokenizer is not ready yet: a request now would
        # be routed blind (the README's quickstart waits on /health, then sends a text prompt)
        service.renderers = fresh = Renderers(tokenizer_dir, workers=1, timeout_s=2.0)
        try:
            fresh.start()
            r = await client.get("/health")
            assert r.status == 503 and (await r.json())["prompts_ready"] is False
            await until(lambda: fresh.ready, timeout_s=60)
            assert (await client.get("/health")).status == 200
        finally:
            fresh.close()
            service.renderers = renderers  # closed with the router
    run(test, renderers=Renderers(tokenizer_dir, workers=2, timeout_s=2.0))


# ---------------------------------------------------------------- per-tenant caps
def test_a_tenant_past_its_cap_gets_a_429_naming_it_and_others_are_served():
    async def test(client, stands, service):
        for s in stands:
            s.mode = "hold"
        held = [asyncio.ensure_future(post(client, {"cache_salt": ACME})) for _ in range(2)]
        await until(lambda: sum(len(s.bodies) for s in stands) == 2)
        r, body = await post(client, {"cache_salt": ACME})  # acme's third at once
        assert r.status == 429 and "--max-inflight-per-tenant" in body.decode() and "'acme'" in body.decode()
        others = [asyncio.ensure_future(post(client, {})),  # the default tenant's: admitted
                  asyncio.ensure_future(post(client, {"cache_salt": "nobodys-secret-0123456789"}))]  # no tenant's too
        await until(lambda: sum(len(s.bodies) for s in stands) == 4)
        for s in stands:
            s.release.set()
        for f in (*held, *others):
            r, _ = await f
            assert r.status == 200
        big = {"cache_salt": ACME, "user": "x" * (1 << 20)}  # a body past acme's MiB
        r, body = await post(client, big)
        assert r.status == 429 and "--max-body-mib-per-tenant" in body.decode()
        r, _ = await post(client, {"cache_salt": ACME})  # every hold released: admitted again
        assert r.status == 200 and service.caps.figures()["tenants_holding"] == 0
        text = (await (await client.get("/metrics")).read()).decode()
        assert 'kvpool_route_refused_total{cap="inflight"} 1.0' in text
        assert 'kvpool_route_refused_total{cap="body_bytes"} 1.0' in text
    run(test, caps=TenantCaps(inflight=2, body_mib=1.0))


class _Dying:
    """An instance killed an instant ago, as the router sees it while the kernel still takes its
    connections: GETs are answered (its last health probe passed), a POST's head is read and the
    connection dropped before the body is asked for (no 100 Continue)."""

    def __init__(self) -> None:
        self.heads, self.body_bytes = 0, 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"POST"):
            self.heads += 1
            try:
                self.body_bytes += len(await asyncio.wait_for(reader.read(1 << 16), 0.2))
            except asyncio.TimeoutError:
                pass
            writer.transport.abort()  # a reset, as the kernel sends for a dead process's connections
            return
        body = b"{}" if b"/kv_event_sources" in head or b"/v1/models" in head else b""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()


def test_a_request_whose_body_never_left_is_sent_to_another_instance():
    """With the request's head written but its body never asked for, nothing the instance could run
    reached it: the request goes to the next instance, and the client never sees the failure."""
    async def main():
        dying, live = _Dying(), Stand("s1")
        await live.start()
        urls = [await dying.start(), live.url]
        tenancy = Tenancy(CFG, engine="test")
        fleet = Fleet([InstanceSpec(u, f"shard-{i}") for i, u in enumerate(urls)], lambda salt: None, "",
                      health_s=HEALTH_S)
        service = RouteService(fleet, Planner(tenancy, None, 8), "round-robin",
                               OnlineCost(CostModel(prefill_s=1e-3, node_s=1e-5, remote_s=1e-4)), connect_timeout_s=1.0)
        client = TestClient(TestServer(service.app()))
        await client.start_server()
        try:
            await until(lambda: all(u.up for u in fleet.instances))
            for _ in range(4):  # round-robin: the dying instance's turn comes
                r, body = await post(client, {})
                assert r.status == 200 and json.loads(body)["instance"] == "s1"
            assert dying.heads >= 1 and dying.body_bytes == 0 and len(live.bodies) == 4
            text = (await (await client.get("/metrics")).read()).decode()
            assert f'kvpool_route_requests_total{{engine="{urls[0]}",outcome="retried"}} {dying.heads}.0' in text
        finally:
            await client.close()
            await live.server.close()
            dying.server.close()
    asyncio.run(main())
