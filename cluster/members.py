"""A shard's view of the rest of the pool, from the controller (Ray: the control plane): which
shards are members and where their peer ports are, how much room each has, and where engines'
reports go. Followed in the background by long poll, so the data path reads a local copy and
never calls the controller per request (as Ray Serve's replicas follow their controller).
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from kvpool.cluster.controller import CONTROLLER

log = logging.getLogger("kvpool.shard")
LOADS_EVERY_S = 2.0  # how often the other shards' free pages are asked (placement)


class Members:
    def __init__(self, pool: str, shard_id: str, namespace: str | None = None) -> None:
        self.pool, self.shard_id, self.namespace = pool, shard_id, namespace
        self._shards: dict[str, dict] = {}
        self._version = -1
        self._loads: dict[str, tuple[int, int]] = {}
        self._loads_at = float("-inf")
        self._loads_busy = threading.Lock()
        self._controller = None
        self._credential: str | None = None  # the pool's own, for the controller
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True, name="kvpool-members")
        self._thread.start()

    # ---------------------------------------------------------------- what the data path reads
    def peers(self) -> dict[str, dict]:
        """The other member shards' info (``peer``: their peer port's address)."""
        return {sid: info for sid, info in self._shards.items() if sid != self.shard_id}

    def peer_address(self, shard_id: str) -> str | None:
        info = self._shards.get(shard_id)
        return None if info is None else info.get("peer")

    def loads(self) -> dict[str, tuple[int, int]]:
        """The other shards' (free, total) DRAM pages, refreshed every ``LOADS_EVERY_S`` in the background."""
        now = time.monotonic()
        if now - self._loads_at >= LOADS_EVERY_S and self._loads_busy.acquire(blocking=False):
            self._loads_at = now
            threading.Thread(target=self._refresh_loads, daemon=True, name="kvpool-loads").start()
        return self._loads

    def report(self, name: str, figures: dict) -> None:
        """An engine's figures to the controller (fire and forget), with the pool's own credential:
        the shard verified the engine's and names its tenant in ``figures``."""
        ctl = self._ctl()
        if ctl is not None:
            if self._credential is None:
                from kvpool.auth import Authority

                self._credential = Authority.from_env().pool_credential()
            ctl.report.remote(name, figures, credential=self._credential)

    def engines(self, timeout_s: float = 5.0) -> dict:
        """The engines' latest reports, as the controller keeps them."""
        ctl = self._ctl()
        return {} if ctl is None else ray.get(ctl.reports.remote(), timeout=timeout_s)

    def close(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- following the controller
    def _ctl(self):
        if self._controller is None:
            try:
                self._controller = ray.get_actor(CONTROLLER, namespace=self.namespace)
            except Exception:  # noqa: BLE001 - not up yet (the controller starts before the shards, normally)
                return None
        return self._controller

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                ctl = self._ctl()
                if ctl is None:
                    self._stop.wait(1.0)
                    continue
                state = ray.get(ctl.wait.remote(self._version, 2.0), timeout=10)
                self._shards, self._version = dict(state["shards"]), state["version"]
            except Exception as e:  # noqa: BLE001 - keep following; the data path keeps its last copy
                if self._stop.is_set():
                    return
                self._controller = None
                log.debug("shard %s: following the controller failed (%s); retrying", self.shard_id, e)
                self._stop.wait(1.0)

    def _refresh_loads(self) -> None:
        from kvpool.cluster.shard import shard_name

        try:
            refs = {}
            for sid in self.peers():
                try:
                    refs[sid] = ray.get_actor(shard_name(self.pool, sid), namespace=self.namespace).free_pages.remote()
                except Exception:  # noqa: BLE001 - a shard that is gone takes nothing
                    continue
            out = {}
            for sid, ref in refs.items():
                try:
                    out[sid] = (int(ray.get(ref, timeout=1.0)), int(self._shards.get(sid, {}).get("dram_pages", 0)))
                except Exception:  # noqa: BLE001 - a shard that does not answer takes nothing
                    continue
            self._loads = out
        finally:
            self._loads_busy.release()
