"""The router's cost model, measured on the requests it routes.

A request the router sends to an instance that has nothing else of the router's in flight and no
queue in its metrics is a clean sample: its time to first token (a streamed request's first
token; a non-streamed one's whole answer when it asks for one token) is a fixed overhead plus its
prompt's tokens by tier, each at that tier's cost per token. Over the last ``window`` samples the
router fits ``ttft = overhead + node * t_node + remote * t_remote + prefill * t_miss`` by least
squares, pulled toward the prior (the figures it starts from: worth ``weight`` samples of a tier
never seen, fading as the tier is seen) so that a tier seldom seen keeps a sane cost, and kept in the order the tiers must have
(0 <= node <= remote <= prefill: a tier that fits dearer than the one after it is averaged with it).

A GPU-cache hit costs nothing in the model (its tokens are neither loaded nor computed).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from kvpool.routing import CostModel

TIER_ORDER = ("node", "remote", "miss")


class OnlineCost:
    def __init__(self, prior: CostModel, window: int = 256, weight: float = 4.0) -> None:
        self.prior, self.window, self.weight = prior, window, weight
        self._samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._model, self.overhead_s = prior, 0.0

    @property
    def samples(self) -> int:
        return len(self._samples)

    def model(self) -> CostModel:
        return self._model

    def observe(self, tokens: dict[str, int], ttft_s: float) -> None:
        """A clean sample: ``tokens`` by tier (:func:`kvpool.routing.tiers`, the prompt's partial
        last chunk in ``miss``) and the time to first token it took."""
        if not ttft_s > 0:
            return
        with self._lock:
            self._samples.append((*(float(tokens.get(t, 0)) for t in TIER_ORDER), float(ttft_s)))
            self._fit()

    def _fit(self) -> None:
        data = np.array(self._samples)
        x, y = np.hstack([np.ones((len(data), 1)), data[:, :3]]), data[:, 3]
        prior = np.array([0.0, self.prior.node_s, self.prior.remote_s, self.prior.prefill_s])
        scale = np.maximum((x[:, 1:] ** 2).mean(axis=0), 1.0)  # a typical sample's tokens of each tier, squared
        seen = np.maximum((x[:, 1:] > 0).sum(axis=0), 1)  # the prior fades as a tier is seen
        reg = np.diag([0.0, *(self.weight * scale / seen)])
        try:
            beta = np.linalg.solve(x.T @ x + reg + 1e-12 * np.eye(4), x.T @ y + reg @ prior)
        except np.linalg.LinAlgError:
            return
        per = [max(0.0, float(b)) for b in beta[1:]]
        for _ in range(2):  # pool adjacent violators, three values
            for i in range(2):
                if per[i] > per[i + 1]:
                    per[i] = per[i + 1] = (per[i] + per[i + 1]) / 2
        self.overhead_s = max(0.0, float(beta[0]))
        self._model = CostModel(prefill_s=per[2], node_s=per[0], remote_s=per[1])

    def figures(self) -> dict:
        m = self._model
        return {"samples": self.samples, "overhead_s": self.overhead_s, "prefill_s_per_token": m.prefill_s,
                "node_s_per_token": m.node_s, "remote_s_per_token": m.remote_s}
