"""The router's Prometheus metrics (``GET /metrics`` on the router), beside the engines' own. An
engine instance is the label ``engine`` (its URL): Prometheus keeps ``instance`` for the target
it scrapes.

- ``kvpool_route_requests_total{engine,outcome}``: ``ok``, ``failed`` (the client got an error or
  a cut stream), ``retried`` (the instance failed before answering; sent to another),
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
  non-streamed answers, the cached tokens the router expected and those the engine reported.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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

    def render(self) -> bytes:
        return generate_latest(self.registry)
