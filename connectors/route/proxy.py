"""``kvpool route``'s HTTP service: an OpenAI-compatible front for several vLLM servers that sends
each request where its time to first token is expected lowest, and streams the answer back.

Per request (``POST /v1/completions``, ``/v1/chat/completions``): its tenant and its admission
under the tenant's caps (:mod:`.caps`, 429), its prompt's tokens (rendered in a worker process
within a deadline: :mod:`.render`, 400 past it), the plan (where the pool holds each leading
chunk: :mod:`.plan`), then each instance that is up is scored by
:class:`kvpool.routing.Router` on the prompt's tokens by tier there (its own GPU cache from its
KV events, its node's shard, another node's, prefill) at the measured costs (:mod:`.costs`)
against its backlog, and the body is forwarded unchanged, on a connection of its own.

A request is sent to an instance at most once, and to another only when its body never reached
the first: the connection could not be made, or it failed before the instance asked for the body
(the request goes with ``Expect: 100-continue``, and vLLM's server asks for the body only as it
takes the request on; a server already killed, whose socket the kernel still accepts on, never
does). Then that instance is suspect (:meth:`Fleet.suspect`: probed on fresh connections, down
only if they fail) and the request goes to the next best one. An instance that fails once the
body was on its way (it died mid-prefill, reset, cut the answer) may have run it: the request is
not sent again; the client gets a 502 (or, mid-stream, an error event and no ``[DONE]``). An index
that does not answer makes that request least-loaded's.

Also: ``GET /v1/models`` (from an instance that is up), ``GET /health`` (200 while one instance is
up, once the render workers hold the tokenizer), ``GET /metrics`` (:mod:`.figures`), ``GET /kvpool/route`` (the router's view, JSON). Answers
carry ``x-kvpool-instance`` (where it went) and ``x-kvpool-tiers`` (the prompt's tokens by tier
expected there, the requester's own tenant's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from aiohttp import web

from kvpool.connectors.route.caps import CapReached, TenantCaps
from kvpool.connectors.route.costs import OnlineCost
from kvpool.connectors.route.figures import Figures
from kvpool.connectors.route.fleet import Fleet, Upstream
from kvpool.connectors.route.plan import Plan, Planner
from kvpool.connectors.route.render import Renderers, RenderTimeout
from kvpool.errors import BadRequest
from kvpool.routing import TIERS, Instance, Router

log = logging.getLogger("kvpool.route")

MAX_BODY = 64 << 20
PASSED_IN = ("content-type", "authorization", "accept", "x-request-id", "openai-organization", "openai-project")
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade", "proxy-connection", "te",
       "trailer", "server", "date"}
UNSENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)  # no connection: nothing of it was sent
FAILED = (aiohttp.ClientError, ConnectionError)  # its body sent: it may have run there


async def _body_going(session, ctx, params) -> None:
    """A request's body is about to be written (aiohttp calls this before each chunk)."""
    ctx.trace_request_ctx["body"] = True


class _Unsent(Exception):
    """The request's body never reached the instance (nothing it could run): another may take it."""


def _error(status: int, message: str) -> web.Response:
    kind = {400: "invalid_request_error", 429: "rate_limit_exceeded", 502: "bad_gateway", 503: "service_unavailable",
            504: "timeout"}.get(status, "error")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _failed_on(u: Upstream, e: BaseException) -> str:
    return (f"{u.name} failed while this request was on it ({type(e).__name__}: {e}); it was not sent to another "
            "instance, as it may have run there: retry it if that is safe")


class RouteService:
    def __init__(self, fleet: Fleet, planner: Planner, policy: str, cost: OnlineCost, *, balance: float = 1.25,
                 request_timeout_s: float = 600.0, connect_timeout_s: float = 3.0, renderers: Renderers | None = None,
                 caps: TenantCaps | None = None) -> None:
        self.fleet, self.planner, self.cost = fleet, planner, cost
        self.renderers = renderers or Renderers(None)
        self.caps = caps or TenantCaps()
        self.router = Router(policy, cost.model(), balance)
        self.fallback = Router("least-loaded", cost.model())
        self.figures = Figures()
        self.figures.follow(lambda: [(u.name, u.downs, u.feed.figures() if u.feed else None)
                                     for u in self.fleet.instances])
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._executor = ThreadPoolExecutor(4, thread_name_prefix="kvpool-route")
        self._ids = itertools.count()
        self._mean_s = 0.0  # expected seconds of a routed request (EWMA): what a queued one of others' costs
        self.session: aiohttp.ClientSession | None = None
        self._seen = [0, 0, 0]  # cached tokens expected, cached tokens the engines reported, answers (non-streamed)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/completions", self.routed)
        app.router.add_post("/v1/chat/completions", self.routed)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kvpool/route", self.state)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        # NOTE: bodies pass through as the instance sent them (no decompression). Each request gets
        # a connection of its own: on a kept-alive one the server may be closing just as the request
        # is written (a connect costs far less than a request); and its body goes only once the
        # instance asks for it (_forward), so a failure before then is known to have sent nothing
        traced = aiohttp.TraceConfig()
        traced.on_request_chunk_sent.append(_body_going)
        self.session = aiohttp.ClientSession(auto_decompress=False, trace_configs=[traced],
                                             connector=aiohttp.TCPConnector(limit=0, force_close=True))
        self.fleet.start()
        self.renderers.start()

    async def _stop(self, app) -> None:
        await self.fleet.close()
        await self.session.close()
        self.renderers.close()
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ the decision
    def choose(self, plan: Plan, tried: set[int]) -> tuple[Upstream, dict[str, int]] | None:
        ups = self.fleet.instances
        usable = [u.up and i not in tried for i, u in enumerate(ups)]
        if not any(usable):
            return None
        views = [Instance(u.name, u.spec.shard, u.backlog_s(self._mean_s)) for u in ups]
        tiers = [plan.tiers_on(u.spec.shard, u.view) for u in ups]
        router = self.fallback if plan.error else self.router
        router.cost = self.cost.model()
        i = router.choose(views, tiers, usable)
        return ups[i], tiers[i]

    # ------------------------------------------------------------------ handlers
    async def routed(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object")
        route = self.planner.route(body)
        try:
            held = self.caps.admit(None if route is None else route.tenant, len(raw))
        except CapReached as e:
            self.figures.refused.labels(e.cap).inc()
            return _error(429, e.message)
        with held:
            return await self._routed(request, raw, body, route)

    async def _routed(self, request: web.Request, raw: bytes, body: dict, route) -> web.StreamResponse:
        adapter = body.get("model") if body.get("model") in self.fleet.adapters else ""
        try:
            tokens = None if route is None else await self.renderers.tokens(route.tenant, request.path, raw, body)
        except BadRequest as e:
            if isinstance(e, RenderTimeout):
                self.figures.render_timeouts.inc()
            return _error(400, e.message)
        plan = await asyncio.get_running_loop().run_in_executor(self._executor, self.planner.plan, route, tokens,
                                                                adapter)
        if plan.error:
            self.figures.index_errors.inc()
        tried: set[int] = set()
        while True:
            picked = self.choose(plan, tried)
            if picked is None:
                return _error(503, "no engine instance is up: " + "; ".join(
                    f"{u.name}: {u.why_down or 'could not be reached for this request'}" for u in self.fleet.instances))
            u, tiers = picked
            rid, expected = next(self._ids), self.cost.overhead_s + self.cost.model().seconds(tiers)
            self._mean_s = expected if not self._mean_s else 0.9 * self._mean_s + 0.1 * expected
            clean = not u.inflight and u.others == 0
            u.inflight[rid] = expected
            u.sent += 1
            try:
                return await self._forward(request, raw, body, u, tiers, clean)
            except _Unsent as e:
                self.fleet.suspect(u, str(e))
                self.figures.requests.labels(u.name, "retried").inc()
                tried.add(self.fleet.instances.index(u))
            finally:
                u.inflight.pop(rid, None)

    async def _forward(self, request: web.Request, raw: bytes, body: dict, u: Upstream,
                       tiers: dict[str, int], clean: bool) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_IN}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = {"body": False}
        try:
            # NOTE: the body goes once the instance asks for it (100 Continue): until then nothing it
            # could run has reached it, and a failure may be sent elsewhere
            up = await self.session.post(u.spec.url + request.path_qs, data=raw, headers=headers, timeout=self.timeout,
                                         expect100=True, trace_request_ctx=sent)
        except UNSENT as e:
            raise _Unsent(f"{type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:
            self.figures.requests.labels(u.name, "failed").inc()
            return _error(504, f"{u.name} did not answer in time")
        except FAILED as e:
            if not sent["body"]:
                raise _Unsent(f"{type(e).__name__} before it asked for the body: {e}") from None
            return self._lost(u, e)
        tag = {"x-kvpool-instance": u.name, "x-kvpool-tiers": ",".join(f"{t}={tiers[t]}" for t in TIERS)}
        passed = {k: v for k, v in up.headers.items() if k.lower() not in HOP}
        try:
            async with up:
                if "text/event-stream" not in up.headers.get("content-type", ""):
                    data = await up.read()
                    ttft = loop.time() - t0
                    self._account(u, up.status, tiers, ttft, clean and body.get("max_tokens") == 1, data, passed)
                    return web.Response(body=data, status=up.status, headers={**passed, **tag})
                part = await up.content.readany()
                ttft = loop.time() - t0
                out = web.StreamResponse(status=up.status, headers={**passed, **tag})
                self._account(u, up.status, tiers, ttft, clean, None, passed)
                return await self._stream(request, out, up, part, u)
        except asyncio.TimeoutError:
            self.figures.requests.labels(u.name, "failed").inc()
            return _error(504, f"{u.name} did not finish its answer in time")
        except FAILED as e:
            return self._lost(u, e)

    def _lost(self, u: Upstream, e: BaseException) -> web.Response:
        """The instance failed with the request on it: a 502, never a second instance."""
        log.warning("kvpool route: %s failed with a request on it (%s: %s)", u.name, type(e).__name__, e)
        self.figures.requests.labels(u.name, "failed").inc()
        self.fleet.suspect(u, f"failed a request: {type(e).__name__}: {e}")
        return _error(502, _failed_on(u, e))

    async def _stream(self, request: web.Request, out: web.StreamResponse, up, part: bytes,
                      u: Upstream) -> web.StreamResponse:
        """Copies a streamed answer on; an instance that cuts it is down, a client that leaves ends it."""
        try:
            await out.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            self.figures.requests.labels(u.name, "client_gone").inc()
            return out
        while part:
            try:
                await out.write(part)
            except (ConnectionResetError, aiohttp.ClientConnectionError):
                self.figures.requests.labels(u.name, "client_gone").inc()
                return out
            try:
                part = await up.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                log.warning("kvpool route: %s cut a streamed answer (%s)", u.name, e)
                self.figures.requests.labels(u.name, "failed").inc()
                self.fleet.suspect(u, f"cut a stream: {e}")
                # NOTE: the client is told, as vLLM tells it of an error mid-stream, and the stream is
                # left unterminated (no [DONE], no last chunk): it cannot pass for a whole answer
                error = {"error": {"message": _failed_on(u, e), "type": "bad_gateway", "code": 502}}
                with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionError):
                    await out.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                if request.transport is not None:
                    request.transport.close()
                return out
        await out.write_eof()
        if out.status == 200:
            self.figures.requests.labels(u.name, "ok").inc()
        return out

    def _account(self, u: Upstream, status: int, tiers: dict[str, int], ttft: float, clean: bool,
                 data: bytes | None, headers: dict) -> None:
        f = self.figures
        if data is not None or status != 200:  # (a stream is counted when it ends)
            f.requests.labels(u.name, "ok" if status < 500 else "failed").inc()
        if status != 200:
            return
        f.ttft.labels(u.name).observe(ttft)
        for t in TIERS:
            f.tokens.labels(t).inc(tiers[t])
        if clean:
            self.cost.observe(tiers, ttft)
        if data is not None and "content-encoding" not in {k.lower() for k in headers}:
            try:
                usage = json.loads(data).get("usage") or {}
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            except (ValueError, TypeError, AttributeError):
                return
            expected = tiers["gpu"] + tiers["node"] + tiers["remote"]
            f.predicted.inc(expected)
            f.engine_cached.inc(cached)
            self._check_keys(expected, cached)

    def _check_keys(self, expected: int, cached: int) -> None:
        """Says once when the engines keep finding cached tokens the router never expects: its keys
        are not theirs (another --model path, --dtype or config), so it routes blind to the pool."""
        self._seen[0] += expected
        self._seen[1] += cached
        self._seen[2] += 1
        if self._seen[2] == 50 and self._seen[0] == 0 and self._seen[1] > 0:
            log.warning("kvpool route: in 50 answers the engines reported %d cached prompt tokens and the router "
                        "expected none: its keys are not the engines'. Give --model exactly as vllm serve was given "
                        "it, the same --dtype and the engines' --config", self._seen[1])

    async def models(self, request: web.Request) -> web.Response:
        for u in self.fleet.instances:
            if not u.up:
                continue
            try:
                async with self.session.get(u.spec.url + "/v1/models", timeout=self.timeout) as r:
                    return web.Response(body=await r.read(), status=r.status,
                                        content_type=r.content_type or "application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.fleet.suspect(u, f"/v1/models: {type(e).__name__}: {e}")
        return _error(503, "no engine instance is up")

    async def health(self, request: web.Request) -> web.Response:
        up, ready = sum(u.up for u in self.fleet.instances), self.renderers.ready
        return web.json_response({"instances_up": up, "instances": len(self.fleet.instances), "prompts_ready": ready},
                                 status=200 if up and ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        f = self.figures
        for u in self.fleet.instances:
            f.up.labels(u.name).set(1 if u.up else 0)
            f.backlog.labels(u.name).set(u.backlog_s(self._mean_s))
            f.gpu_blocks.labels(u.name).set(len(u.view))
        m = self.cost.model()
        for tier, v in (("node", m.node_s), ("remote", m.remote_s), ("miss", m.prefill_s)):
            f.cost.labels(tier).set(v)
        return web.Response(body=f.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response({
            "policy": self.router.policy, "cost": self.cost.figures(), "mean_request_s": self._mean_s,
            "tenancy": self.planner.tenancy.stats(), "render": self.renderers.figures(), "caps": self.caps.figures(),
            "instances": [{"url": u.name, "shard": u.spec.shard, "up": u.up, "why_down": u.why_down, "downs": u.downs,
                           "others_queued": u.others, "inflight": len(u.inflight), "backlog_s": u.backlog_s(self._mean_s),
                           "gpu_blocks": len(u.view), "events": u.feed.figures() if u.feed else None}
                          for u in self.fleet.instances]})
