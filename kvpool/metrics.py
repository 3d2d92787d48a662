"""Counters and gauges of the pool, kept in one place so that every exporter (``kvpool stats``,
the Ray dashboard, Prometheus) reads the same figures.

A metric has a name, a kind and label names; a sample is one tuple of label values. Updates are
a dict lookup and an add: cheap enough for the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Metric:
    name: str
    kind: str  # "counter" | "gauge"
    help: str
    labels: tuple[str, ...] = ()
    values: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, amount: float = 1, *label_values: str) -> None:
        assert self.kind == "counter" or amount != 0, self.name
        self.values[label_values] = self.values.get(label_values, 0) + amount

    def set(self, value: float, *label_values: str) -> None:
        assert self.kind == "gauge", f"{self.name} is a {self.kind}; only gauges are set"
        self.values[label_values] = value

    def set_total(self, value: float, *label_values: str) -> None:
        """Sets a counter kept elsewhere (it only grows there) to its current value."""
        assert self.kind == "counter", self.name
        self.values[label_values] = value

    def get(self, *label_values: str) -> float:
        return self.values.get(label_values, 0)

    def total(self) -> float:
        return sum(self.values.values())


# Every metric the pool keeps. Exporters iterate this table; nothing else defines metric names.
_DEFINITIONS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("hits_chunks", "counter", "chunks served from the pool", ("tenant",)),
    ("misses_chunks", "counter", "chunks asked for and not served", ("tenant",)),
    ("hits_tokens", "counter", "tokens whose KV was served from the pool", ("tenant",)),
    ("misses_tokens", "counter", "tokens asked for and not served", ("tenant",)),
    ("puts", "counter", "chunks stored", ("tenant",)),
    ("put_bytes", "counter", "payload bytes stored", ("tenant",)),
    ("get_bytes", "counter", "payload bytes served", ("tenant",)),
    ("evictions", "counter", "chunks dropped to make room", ("tier",)),
    ("demotions", "counter", "chunks moved to a lower tier to make room", ("tier",)),
    ("promotions", "counter", "chunks moved to a higher tier on a hit", ("tier",)),
    ("checksum_failures", "counter", "chunks whose bytes failed verification (served as misses)", ("tier",)),
    ("lease_waits", "counter", "eviction candidates passed over because they were leased", ()),
    ("rejected_quota", "counter", "writes refused with 429 (tenant over quota)", ("tenant",)),
    ("rejected_full", "counter", "writes refused with 507 (nothing evictable)", ("tier",)),
    ("cut_writes", "counter", "writes stopped where a prompt's chain outgrew the pool (its leading chunks kept; more "
     "pages serve longer prompts)", ("tenant",)),
    ("cancelled_requests", "counter", "requests in flight cancelled with 429 to free memory", ("tenant",)),
    ("bytes", "gauge", "payload bytes resident", ("tier",)),
    ("chunks", "gauge", "chunks resident", ("tier",)),
    ("pages_total", "gauge", "pages in the tier's slab", ("tier",)),
    ("tenant_bytes", "gauge", "payload bytes resident per tenant", ("tenant",)),
)


class Metrics:
    """The pool's metric registry. Attribute access by name: ``metrics.hits_chunks.inc(1, "a")``."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        for name, kind, help_, labels in _DEFINITIONS:
            self._metrics[name] = Metric(name, kind, help_, labels)

    def __getattr__(self, name: str) -> Metric:
        try:
            return self.__dict__["_metrics"][name]
        except KeyError:
            raise AttributeError(f"no metric named {name!r}") from None

    def __iter__(self):
        return iter(self._metrics.values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{metric: {"label=value,...": value}}``, a plain dict for JSON and tests."""
        out: dict[str, dict[str, float]] = {}
        for m in self._metrics.values():
            out[m.name] = {
                ",".join(f"{k}={v}" for k, v in zip(m.labels, lv)): val for lv, val in m.values.items()
            }
        return out
