"""kvpool route's HTTP service against stand-in instances (small aiohttp servers that answer as
vLLM's OpenAI server does, and can refuse, die before answering or cut a stream): where requests
go, what happens when an instance fails, streaming, health. The real thing (two vLLM servers on a
two-node pool) is tests/engines/test_route.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvpool.connectors.route.costs import OnlineCost
from kvpool.connectors.route.fleet import Fleet, InstanceSpec
from kvpool.connectors.route.plan import Planner
from kvpool.connectors.route.prompts import Prompts
from kvpool.connectors.route.proxy import RouteService
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
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kv_event_sources", self.no_events)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        self.server = TestServer(app)

    async def start(self) -> None:
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")

    async def no_events(self, request):
        return web.json_response({})

    async def models(self, request):
        return web.json_response({"data": [{"id": "tiny", "parent": None}]})

    async def health(self, request):
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
        if not body.get("stream"):
            return web.json_response({"instance": self.name, "choices": [{"text": "x"}],
                                      "usage": {"prompt_tokens": len(body["prompt"])}})
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


def run(test, n_stands: int = 2, pool=None, policy: str = "tier-aware"):
    """Starts ``n_stands`` instances and the router over them, then ``await test(client, stands, service)``."""
    async def main():
        stands = [Stand(f"s{i}") for i in range(n_stands)]
        for s in stands:
            await s.start()
        tenancy = Tenancy(CFG, engine="test")
        fleet = Fleet([InstanceSpec(s.url, f"shard-{i}") for i, s in enumerate(stands)],
                      lambda salt: (r.tenant if (r := tenancy.of_secret(salt)) else None), "", health_s=HEALTH_S)
        service = RouteService(fleet, Planner(tenancy, Prompts(None), pool, 8), policy,
                               OnlineCost(CostModel(prefill_s=1e-3, node_s=1e-5, remote_s=1e-4)),
                               connect_timeout_s=1.0)
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
        assert not u.up and "ClientConnectorError" in u.why_down
        for _ in range(3):  # no further request tries it
            r, body = await post(client, {})
            assert json.loads(body)["instance"] == "s1"
        text = (await (await client.get("/metrics")).read()).decode()
        assert f'kvpool_route_requests_total{{engine="{stands[0].url}",outcome="retried"}} 1.0' in text
        assert 'kvpool_route_instance_up{engine="%s"} 0.0' % stands[0].url in text
    run(test)


def test_an_instance_dying_before_its_answer_is_retried_and_a_cut_stream_is_not():
    async def test(client, stands, service):
        stands[0].mode = "die"
        r, body = await post(client, {})
        assert r.status == 200 and json.loads(body)["instance"] == "s1" and len(stands[0].bodies) == 1
        await until(lambda: service.fleet.instances[0].up)  # its health check still answers: back in turn
        stands[0].mode, stands[1].mode = "cut", "cut"
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "stream": True})
        assert r.status == 200
        with pytest.raises(Exception):  # noqa: B017 - the client sees the stream end mid-way, whatever its class
            await r.read()
        assert sum(not u.up for u in service.fleet.instances) == 1  # the one that cut it is down
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
