"""The router's Prometheus metrics (``GET /metrics`` on the router), beside the engines' own. An
engine instance is the label ``engine`` (its URL): Prometheus keeps ``instance`` for the target
it scrapes.

- ``kvpool_route_requests_total{engine,outcome}``: ``ok``, ``failed`` (the client got an error or
  a cut stream), ``retried`` (no connection to the instance could be made, so nothing of the
  request reached it; sent to another),
  ``client_gone`` (the client left mid-stream);
- ``kvpool_route_prompt_tokens_total{tier}``: prompt tokens of routed requests by the tier the
  router expected them from on the chosen instance (``gpu``, ``node``, ``remote``, ``miss``);
- ``kvpool_route_ttft_seconds{engine}``: time to the first byte of a streamed answer (the whole
  answer otherwise);
- ``kvpool_route_instance_up{engine}``, ``kvpool_route_backlog_seconds{engine}``,
  ``kvpool_route_gpu_blocks{engine}`` (blocks its KV events show in its own cache);
- ``kvpool_route_cost_seconds_per_token{tier}``: the measured cost model (:mod:`.costs`);
- ``kvpool_route_index_errors_total``: lookups the pool could not answer (routed by load);
- ``kvpool_route_predicted_cached_tokens_total`` / ``kvpool_route_engine_cached_tokens_total``: of
  non-streamed answers, the cached tokens the router expected and those the engine reported;
- ``kvpool_route_marked_down_total{engine}``: times an instance was found down (after its probes
  on fresh connections failed);
- its KV events feed's health, per instance: ``kvpool_route_events_alive{engine}`` (1 while
  subscribed and reading), ``kvpool_route_event_frames_total{engine}``,
  ``kvpool_route_event_bad_frames_total{engine}`` (dropped: :mod:`.events`),
  ``kvpool_route_event_gaps_total{engine}``, ``kvpool_route_event_last_frame_age_seconds{engine}``
  (absent before its first frame); the frame counters start over with each subscription;
- ``kvpool_route_refused_total{cap}``: requests refused by a per-tenant cap (429, :mod:`.caps`),
  ``kvpool_route_render_timeouts_total``: prompts whose rendering passed its bound (400).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Figures:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvpool_route_requests", "Requests routed, by instance and outcome",
                                ["engine", "outcome"], registry=r)
        self.tokens = Counter("kvpool_route_prompt_tokens", "Prompt tokens routed, by the tier expected",
                              ["tier"], registry=r)
        self.ttft = Histogram("kvpool_route_ttft_seconds", "Time to first byte of the answer", ["engine"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.up = Gauge("kvpool_route_instance_up", "1 while the instance answers", ["engine"], registry=r)
        self.backlog = Gauge("kvpool_route_backlog_seconds", "Expected seconds of work queued", ["engine"],
                             registry=r)
        self.gpu_blocks = Gauge("kvpool_route_gpu_blocks", "Blocks its KV events show in its own cache",
                                ["engine"], registry=r)
        self.cost = Gauge("kvpool_route_cost_seconds_per_token", "Measured cost of a token, by tier", ["tier"],
                          registry=r)
        self.index_errors = Counter("kvpool_route_index_errors", "Lookups the pool could not answer", registry=r)
        self.predicted = Counter("kvpool_route_predicted_cached_tokens",
                                 "Cached prompt tokens the router expected (non-streamed answers)", registry=r)
        self.engine_cached = Counter("kvpool_route_engine_cached_tokens",
                                     "Cached prompt tokens the engines reported (non-streamed answers)", registry=r)

        self.refused = Counter("kvpool_route_refused", "Requests refused by a per-tenant cap (429)", ["cap"],
                               registry=r)
        self.render_timeouts = Counter("kvpool_route_render_timeouts",
                                       "Prompts whose rendering passed its time bound (400)", registry=r)

    def follow(self, instances: Callable[[], Iterable[tuple[str, int, dict | None]]]) -> None:
        """``instances()``: (engine, times found down, its events feed's ``figures()`` or None: not
        subscribed), per instance, read when scraped."""
        self.registry.register(_Instances(instances))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Instances:
    """Each instance's verdicts and its KV events feed's health."""

    def __init__(self, instances) -> None:
        self.instances = instances

    def describe(self):
        return []

    def collect(self):
        downs = CounterMetricFamily("kvpool_route_marked_down", "Times an instance was found down", labels=["engine"])
        alive = GaugeMetricFamily("kvpool_route_events_alive", "1 while its KV events feed is subscribed and reading",
                                  labels=["engine"])
        frames = CounterMetricFamily("kvpool_route_event_frames", "KV event frames received", labels=["engine"])
        bad = CounterMetricFamily("kvpool_route_event_bad_frames", "KV event frames dropped as malformed",
                                  labels=["engine"])
        gaps = CounterMetricFamily("kvpool_route_event_gaps", "Gaps in its KV events' sequence", labels=["engine"])
        age = GaugeMetricFamily("kvpool_route_event_last_frame_age_seconds", "Seconds since its last KV event frame",
                                labels=["engine"])
        for engine, down, f in self.instances():
            downs.add_metric([engine], down)
            alive.add_metric([engine], 1.0 if f and f["alive"] else 0.0)
            if f is None:
                continue
            frames.add_metric([engine], f["frames"])
            bad.add_metric([engine], f["bad_frames"])
            gaps.add_metric([engine], f["gaps"])
            if f["last_frame_age_s"] is not None:
                age.add_metric([engine], f["last_frame_age_s"])
        return [downs, alive, frames, bad, gaps, age]
