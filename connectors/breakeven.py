"""Load or recompute: loading a cached prefix is not always faster than computing it again.

A connector measures both sides as it runs -- the bandwidth of its loads (bytes / seconds) and
the cost of its prefills (seconds / token) -- and loads a prefix only when the measured load
time is below the measured time to recompute it. Until both sides have been measured it loads
(a whole chunk is almost always cheaper to copy than to compute; the first cold prefills and
loads calibrate the figures within a few requests).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class _Ewma:
    alpha: float = 0.3
    value: float | None = None
    samples: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1


@dataclass
class BreakEven:
    """Measured figures and the decision. ``margin`` > 1 favours recomputing on ties (a load that
    is barely faster is not worth its risk of a miss halfway)."""

    margin: float = 1.0
    load_bps: _Ewma = field(default_factory=_Ewma)
    prefill_s_per_token: _Ewma = field(default_factory=_Ewma)
    loaded: int = 0
    recomputed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reported_at: float = field(default=float("-inf"), repr=False)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.load_bps.add(nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill_s_per_token.add(seconds / tokens)

    def should_load(self, tokens: int, nbytes: int) -> bool:
        """Whether loading ``tokens`` tokens (``nbytes`` bytes) beats recomputing them."""
        if tokens <= 0:
            return False
        with self._lock:
            bps, cost = self.load_bps.value, self.prefill_s_per_token.value
        decision = True if bps is None or cost is None else nbytes / bps * self.margin < tokens * cost
        with self._lock:
            if decision:
                self.loaded += 1
            else:
                self.recomputed += 1
        return decision

    def min_tokens(self, bytes_per_token: int) -> int | None:
        """The shortest prefix worth loading (None until measured; 0 when loading always wins)."""
        bps, cost = self.load_bps.value, self.prefill_s_per_token.value
        if bps is None or cost is None:
            return None
        per_token_load = bytes_per_token / bps * self.margin
        return 0 if per_token_load < cost else 2**31

    def stats(self, bytes_per_token: int | None = None) -> dict:
        bps, cost = self.load_bps.value, self.prefill_s_per_token.value
        out = {"load_gbps": None if bps is None else bps / 1e9,
               "prefill_ms_per_token": None if cost is None else cost * 1e3,
               "loads": self.loaded, "recomputes": self.recomputed}
        if bytes_per_token and bps and cost:
            # how many times faster loading a token is than computing it (> 1: load every prefix);
            # margin 0 (always load): the measured ratio
            out["load_advantage"] = cost / (bytes_per_token / bps * (self.margin or 1.0))
        return out

    def maybe_report(self, pool, name: str, bytes_per_token: int, every_s: float = 5.0) -> None:
        """Sends the figures to a pool that shows them (a Ray pool: `kvpool stats`), at most
        every ``every_s`` seconds."""
        import time

        report = getattr(pool, "report", None)
        now = time.monotonic()
        if report is None or now - self._reported_at < every_s:
            return
        self._reported_at = now
        try:
            report(name, self.stats(bytes_per_token))
        except Exception:  # noqa: BLE001 - figures are best effort, never a failed request
            pass
