"""The engine instances behind a router: their health, their load and their GPU caches.

Each instance is a vLLM OpenAI server, named by its URL, on a node whose pool shard is ``shard``
(``--instance URL,shard=ID``; without one, the shard of the router's own node). Every
``health_s`` the router asks each instance ``/health`` and ``/metrics`` (requests running and
waiting), each within two intervals (at least 2 s).

An instance is down only when it is: a probe that fails on a kept-alive connection (which the
server may be closing just then: aiohttp's "Cannot write to closing transport"), a forwarded
request it refused or failed, only make it *suspect*; it is then asked ``/health`` on a fresh
connection, up to ``PROBE_TRIES`` times, and found down (no request is sent to it, its GPU cache
view and event feed are dropped) only when every one of those fails. It is up again once it
answers; its GPU cache view is then rebuilt from its events. An instance that comes up is asked
where its KV events are published (:mod:`kvpool.connectors.route.events`); without them its GPU
cache is unknown (the pool's tiers and the load still route it).

Nothing here is state the router cannot rebuild: a restarted router asks again.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field

from kvpool.connectors.route.events import EventFeed, subscribe_address
from kvpool.connectors.route.gpu import GpuView
from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.route")

_QUEUE = re.compile(rb"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})? (\S+)$", re.M)
_STEPS = re.compile(rb"^vllm:iteration_tokens_total_count(?:\{[^}]*\})? (\S+)$", re.M)
PROBE_TRIES = 3  # probes on fresh connections before an instance is found down
PROBE_PAUSE_S = 0.2  # between them
KEEPALIVE_S = 2.0  # NOTE: below the servers' own (uvicorn's 5 s), so the router seldom reuses one they close


@dataclass(frozen=True)
class InstanceSpec:
    url: str
    shard: str = ""
    events: str = ""  # a ZMQ address to read its KV events at instead of the one it announces

    @classmethod
    def parse(cls, text: str) -> "InstanceSpec":
        """``URL[,shard=ID][,events=ZMQ-ADDRESS]``."""
        url, *opts = [p.strip() for p in text.split(",")]
        if not re.match(r"^https?://[^/\s]+$", url.rstrip("/")):
            raise BadRequest(f"--instance {text!r}: start with the server's base URL, http://HOST:PORT")
        kw = {}
        for o in opts:
            k, sep, v = o.partition("=")
            if not sep or k not in ("shard", "events") or not v:
                raise BadRequest(f"--instance {text!r}: options are shard=ID and events=ZMQ-ADDRESS, got {o!r}")
            kw[k] = v
        return cls(url.rstrip("/"), **kw)


@dataclass
class Upstream:
    """One instance as the router sees it now."""

    spec: InstanceSpec
    view: GpuView
    up: bool = False
    why_down: str = "not asked yet"
    others: int = 0  # requests running or waiting on it that are not this router's, at the last look
    inflight: dict[int, float] = field(default_factory=dict)  # this router's requests on it -> expected s
    sent: int = 0  # this router's requests sent to it, ever
    steps: float = -1.0  # engine steps it had run at the last look
    fresh: int = 0  # others' requests its last look showed
    feed: EventFeed | None = None
    told_no_events: bool = False
    downs: int = 0  # times it was found down
    verifying: asyncio.Task | None = None  # its probes on fresh connections, while they run

    @property
    def name(self) -> str:
        return self.spec.url

    def backlog_s(self, mean_s: float) -> float:
        """Seconds of work ahead of a new request: this router's requests on it, and the others its
        metrics count, each at the mean expected time."""
        return sum(self.inflight.values()) + self.others * mean_s


class Fleet:
    def __init__(self, specs: list[InstanceSpec], tenant_of, default_shard: str, health_s: float = 1.0) -> None:
        if not specs:
            raise BadRequest("kvpool route: name at least one engine instance (--instance http://HOST:PORT)")
        if len({s.url for s in specs}) != len(specs):
            raise BadRequest("kvpool route: an instance is named twice")
        if health_s <= 0:
            raise BadRequest(f"--health-interval {health_s}: a positive number of seconds")
        self.health_s = health_s
        self.deadline_s = max(2.0, 2 * health_s)  # NOTE: a loaded server answers late, not never
        self.instances = [Upstream(s if s.shard else InstanceSpec(s.url, default_shard, s.events), GpuView(tenant_of))
                          for s in specs]
        self.adapters: set[str] = set()  # served LoRA adapters (their chunks are keyed by adapter)
        self._tasks: list[asyncio.Task] = []
        self.session = self._fresh = None

    def start(self) -> None:
        import aiohttp

        # kept-alive connections for the periodic looks; a fresh one for each probe before a verdict
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
        self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
        self._tasks = [asyncio.ensure_future(self._watch(u)) for u in self.instances]

    async def close(self) -> None:
        tasks = self._tasks + [u.verifying for u in self.instances if u.verifying is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for u in self.instances:
            self._drop_feed(u)
        for s in (self.session, self._fresh):
            if s is not None:
                await s.close()

    # ------------------------------------------------------------------ health
    async def _watch(self, u: Upstream) -> None:
        while True:
            try:
                await self.check(u)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the loop outlives any one failure
                log.warning("kvpool route: checking %s failed (%s)", u.name, e)
            await asyncio.sleep(self.health_s)

    async def _probe(self, session, u: Upstream) -> str | None:
        """Asks its ``/health`` once: None when it answers 200, else why not."""
        import aiohttp

        try:
            async with session.get(u.spec.url + "/health", timeout=aiohttp.ClientTimeout(total=self.deadline_s)) as r:
                return None if r.status == 200 else f"/health answered {r.status}"
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    async def verify(self, u: Upstream, why: str) -> bool:
        """Whether it answers ``/health`` on a fresh connection, tried ``PROBE_TRIES`` times; found
        down (``why``, and the last probe's answer) when it never does."""
        for k in range(PROBE_TRIES):
            if k:
                await asyncio.sleep(PROBE_PAUSE_S)
            last = await self._probe(self._fresh, u)
            if last is None:
                return True
        self.mark_down(u, f"{why}; {PROBE_TRIES} probes on fresh connections failed ({last})")
        return False

    def suspect(self, u: Upstream, why: str) -> None:
        """A request it failed: verified in the background (once at a time), found down only if so."""
        if u.up and (u.verifying is None or u.verifying.done()):
            u.verifying = asyncio.ensure_future(self.verify(u, why))

    async def check(self, u: Upstream) -> None:
        """One health check: /health (verified on fresh connections when it fails), then /metrics."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.deadline_s)
        ours, sent = len(u.inflight), u.sent  # what of its queue may be this router's (below)
        why = await self._probe(self.session, u)
        if why is not None and not u.up:
            self.mark_down(u, f"health check: {why}")  # still down (or never up): no verdict to change
            return
        if why is not None and not await self.verify(u, f"health check: {why}"):
            return
        try:
            async with self.session.get(u.spec.url + "/metrics", timeout=timeout) as r:
                text = await r.read() if r.status == 200 else b""
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError):
            text = b""  # its load unknown this time (its own requests are counted): still up
        # NOTE: vLLM's queue gauges are its last step's (requests that ended in it included) and keep
        # those values while it idles. So others' requests are its queue less every request of this
        # router's that was on it at some time while it answered (in flight, or sent since), taken
        # only while it keeps stepping, as the lower of two looks in a row: an engine that ran no step
        # since the last look, or ran a burst and stopped, is not taken as busy (this router's own
        # requests are always counted; a step longer than the health interval is missed).
        steps = sum(float(m[1]) for m in _STEPS.finditer(text))
        queued = int(sum(float(m[2]) for m in _QUEUE.finditer(text)))
        fresh = 0 if steps == u.steps or not text else max(0, queued - ours - (u.sent - sent))
        u.others, u.steps, u.fresh = min(fresh, u.fresh), steps, fresh
        if not u.up:
            u.up, u.why_down = True, ""
            log.info("kvpool route: %s is up (shard %s)", u.name, u.spec.shard or "unknown")
            await self._models(u)
        if u.feed is None:
            await self._subscribe(u)

    def mark_down(self, u: Upstream, why: str) -> None:
        """Found down: an instance up only after :meth:`verify`."""
        if u.up or u.why_down == "not asked yet":
            log.warning("kvpool route: %s is down (%s): routed around until it answers again", u.name, why)
        if u.up:
            u.downs += 1
        u.up, u.why_down, u.others = False, why, 0
        self._drop_feed(u)

    def _drop_feed(self, u: Upstream) -> None:
        if u.feed is not None:
            u.feed.close()
            u.feed = None
        u.view.clear()

    async def _models(self, u: Upstream) -> None:
        """The LoRA adapters it serves (``/v1/models`` entries with a parent): a request naming one is keyed
        by it, as the engine keys it."""
        import aiohttp

        try:
            async with self.session.get(u.spec.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.deadline_s)) as r:
                data = (await r.json()).get("data") or [] if r.status == 200 else []
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return
        self.adapters |= {m["id"] for m in data if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)}

    async def _subscribe(self, u: Upstream) -> None:
        """Its KV events: the address given, else those it announces (none: its GPU cache stays unknown)."""
        import aiohttp

        replays: list[str | None] = []
        if u.spec.events:
            addresses = [subscribe_address(u.spec.events, u.spec.url)]
        else:
            try:
                async with self.session.get(u.spec.url + "/kv_event_sources",
                                            timeout=aiohttp.ClientTimeout(total=self.deadline_s)) as r:
                    sources = await r.json() if r.status == 200 else {}
            except (OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
                sources = {}
            cfgs = [c for c in (sources.values() if isinstance(sources, dict) else ()) if isinstance(c, dict)
                    and c.get("enable_kv_cache_events") and c.get("publisher") == "zmq"]
            try:
                addresses = [subscribe_address(c.get("endpoint"), u.spec.url) for c in cfgs]
                replays = [subscribe_address(c["replay_endpoint"], u.spec.url)[0] if c.get("replay_endpoint") else None
                           for c in cfgs]
            except BadRequest as e:
                log.warning("kvpool route: %s: %s; its GPU cache is not followed", u.name, e)
                addresses = []
        if not addresses:
            if not u.told_no_events:
                log.warning("kvpool route: %s publishes no KV events (vllm serve --kv-events-config): the router "
                            "routes it on the pool's tiers and its load, not knowing its own GPU cache", u.name)
                u.told_no_events = True
            return
        try:
            u.feed = EventFeed(u.view, u.name, addresses, replays=replays or None)
        except Exception as e:  # noqa: BLE001 - an address in use, a bad one: the GPU cache stays unknown
            log.warning("kvpool route: %s: cannot subscribe to its KV events at %s (%s)", u.name, addresses, e)
            return
        u.feed.start()
        log.info("kvpool route: following %s's GPU cache through its KV events at %s", u.name, ", ".join(u.feed.addresses))
