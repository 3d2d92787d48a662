"""The engine side of ``kvpool bench node`` (:mod:`kvpool.cluster.bench.node`): a worker process
that reaches the node's shard through a NodeClient and never imports Ray.

``python -m kvpool.cluster.bench.node_worker --config JSON``: one JSON request per line on stdin
(``put``, ``get``, ``fill``, ``memcpy``, ``stats``, ``phases``, ``rtt``, ``quit``), one JSON answer
per line on a stdout kept clean of everything else (as :mod:`kvpool.bench.peer_procs`' workers).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kvpool.bench import peer_procs as W
from kvpool.node.messages import Hello

TENANT = "bench"
FILLER_BYTES = 4096


class _Engine:
    """One NodeClient of one shard, a source buffer and preallocated ``outs`` buffers."""

    def __init__(self, cfg: dict) -> None:
        from kvpool.node.client import NodeClient

        self.sizes = cfg["sizes"]
        self.client = NodeClient(pool="default", shard=cfg["shard"], directory=cfg["run_dir"],
                                 timeout_s=cfg.get("timeout_s", 10.0))
        if self.client._at is None:
            raise RuntimeError(f"shard {cfg['shard']} does not answer in {cfg['run_dir']}")
        self.phase: dict[str, list] = {}
        self._instrument()
        n = max(self.sizes.values())
        self.src = np.zeros(n, dtype=np.uint8)
        self.outs = {name: np.zeros(size, dtype=np.uint8) for name, size in self.sizes.items()}

    def _instrument(self) -> None:
        """Where a call's time goes, seen from the engine: each socket call (by operation) and the
        client's own copy into the slab (``client_copy``); a perf_counter pair each, ~1 us."""
        from kvpool.node import client as mod

        phase, clock = self.phase, time.perf_counter

        def timed(name, fn):
            def wrapper(*a, **kw):
                t0 = clock()
                try:
                    return fn(*a, **kw)
                finally:
                    acc = phase.setdefault(name(a), [0, 0.0])
                    acc[0] += 1
                    acc[1] += clock() - t0
            return wrapper

        self.client.call = timed(lambda a: f"call {a[0].OP}", self.client.call)
        if hasattr(mod, "copy_with_checksum"):
            mod.copy_with_checksum = timed(lambda a: "client_copy", mod.copy_with_checksum)

    def phases(self) -> dict:
        out = {k: list(v) for k, v in self.phase.items()}
        self.phase.clear()
        return {"phases": out}

    @staticmethod
    def _key(hexkey: str):
        from kvpool.keys import ChunkKey

        return ChunkKey(bytes.fromhex(hexkey))

    def put(self, key: str, size: int, seed: int) -> dict:
        self.src[:size] = W.byte_pattern(size, seed)
        k = self._key(key)
        data = self.src[:size]
        t0 = time.perf_counter()
        n = self.client.put(TENANT, [k], [data])
        t = time.perf_counter() - t0
        return {"s": t, "stored": n}

    def get(self, key: str, name: str, seed: int, outs_first: bool, wait_s: float = 0.0) -> dict:
        size = self.sizes[name]
        k = self._key(key)
        waited = 0.0
        if wait_s:  # untimed: the index lists the chunk (published just after the commit)
            t0 = time.monotonic()
            while self.client.lookup(TENANT, [k]).count < 1 and time.monotonic() - t0 < wait_s:
                time.sleep(0.0005)
            waited = time.monotonic() - t0
        out = self.outs[name]
        res = {"waited_s": waited, "wrong": 0, "missing": 0}
        before = dict(self.client.counts)
        for with_outs in ((True, False) if outs_first else (False, True)):
            if with_outs:
                out[:] = 0
                t0 = time.perf_counter()
                got = self.client.get(TENANT, [k], outs=[out])
                t = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                got = self.client.get(TENANT, [k])
                t = time.perf_counter() - t0
            if len(got) != 1:
                res["missing"] += 1
                res["wrong"] += size
            else:
                res["wrong"] += W.count_wrong_bytes(got[0], seed, size)
                if with_outs and got[0].ctypes.data != out.ctypes.data:
                    res["outs_unused"] = res.get("outs_unused", 0) + 1
                    res["wrong"] += W.count_wrong_bytes(out, seed, size)
            res["s_outs" if with_outs else "s_plain"] = t
        res["paths"] = {c: self.client.counts[c] - before.get(c, 0) for c in ("get_shm", "get_remote", "get_failed")}
        return res

    def fill(self, n: int, seed: int) -> dict:
        """``n`` small filler chunks (one page each), untimed."""
        stored = 0
        data = W.byte_pattern(FILLER_BYTES, seed)
        for _ in range(n):
            stored += self.client.put(TENANT, [self._key(os.urandom(16).hex())], [data])
        return {"stored": stored}

    def memcpy(self, ops: dict, warmup: dict) -> dict:
        """``copy``: numpy.copyto; ``copy_checksum``: kvpool.checksum.copy_with_checksum (the copy a
        put or a same-node get makes, with its xxh3 in the same pass), heap to heap, alternating."""
        from kvpool.checksum import checksum
        from kvpool.checksum import copy_with_checksum as cwc

        out, wrong = {}, 0
        for name, size in self.sizes.items():
            src = np.empty(size, dtype=np.uint8)
            dst = np.empty(size, dtype=np.uint8)
            times = {"copy": [], "copy_checksum": []}
            for i in range(warmup[name] + ops[name]):
                seed = i + 1
                src[:] = W.byte_pattern(size, seed)
                for kind in (("copy", "copy_checksum") if i % 2 == 0 else ("copy_checksum", "copy")):
                    dst[:] = 0
                    t0 = time.perf_counter()
                    if kind == "copy":
                        np.copyto(dst, src)
                    else:
                        digest = cwc(dst, src)
                    t = time.perf_counter() - t0
                    wrong += W.count_wrong_bytes(dst, seed, size)
                    if kind == "copy_checksum" and digest != checksum(src):
                        wrong += 1
                    if i >= warmup[name]:
                        times[kind].append(t)
            out[name] = times
        return {"times": out, "wrong": wrong}

    def rtt(self, n: int) -> dict:
        """``n`` calls of the node's trivial ``hello`` operation: the socket's round trip alone."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.client.call(Hello())
            times.append(time.perf_counter() - t0)
        return {"s": times}

    def stats(self) -> dict:
        r = self.client.shard_stats()
        return {"node_op_s": r.get("node_op_s", {}), "node_served": r.get("node_served"),
                "peer_fetched": r.get("peer_fetched"), "peer_failed": r.get("peer_failed")}

    def close(self) -> dict:
        counts = dict(self.client.counts)
        self.client.close()
        return {"counts": counts}


def _worker_main(config: dict) -> int:
    """Requests on stdin, one JSON answer per line on the saved stdout (as kvpool.bench.peers)."""
    say = W.line_protocol()
    try:
        engine = _Engine(config)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say(error=f"{type(e).__name__}: {e}")
        return 1
    say(ready=True, pid=os.getpid(), endpoint=config["shard"], ray_imported="ray" in sys.modules)
    closed = False
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.pop("op", None)
        try:
            if op == "quit":
                r = engine.close()
                closed = True
                say(**r, ray_imported="ray" in sys.modules)
                break
            fn = getattr(engine, op, None) if op in ("put", "get", "fill", "memcpy", "stats", "phases", "rtt") else None
            if fn is None:
                say(error=f"unknown op {op!r}")
                continue
            say(**fn(**msg))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            say(error=f"{type(e).__name__}: {e}")
    if not closed:
        engine.close()
    return 0


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvpool.cluster.bench.node_worker")
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    return _worker_main(json.loads(a.config))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
