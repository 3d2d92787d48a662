"""Load and soak: concurrent clients (each a process, a Ray actor only as a place to run, with the
engines' own client: a NodeClient of its node's shard) on a local multi-node pool,
doing a realistic mix for a bounded time. Records throughput, p50/p99 latency by operation,
errors by kind, wrong bytes (every chunk read is checked against the bytes its key implies) and
the memory (RSS) of every process at start, after warm-up and at the end.

The mix, per client step: 70% a returning conversation (lookup + get of its prefix, Zipf over
conversations, then a put of one new chunk that extends it), 20% a new conversation (put of its
first chunks), 10% a lookup of a prompt nobody sent (a miss).
"""

from __future__ import annotations

import os
import statistics
import time
from functools import partial

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # its cluster is loopback-only

import numpy as np  # noqa: E402
import ray  # noqa: E402
import xxhash  # noqa: E402

from kvpool.errors import KvPoolError  # noqa: E402
from kvpool.keys import ChunkKey, Namespace, chunk_keys  # noqa: E402
from kvpool.spec import KVSpec  # noqa: E402

SPEC = KVSpec("soak", 2, 2, 64, dtype="float16", block_size=16, chunk_tokens=64)
NS_SALT = b"tenant/"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def truth(key: bytes, nbytes: int) -> np.ndarray:
    """The payload a key implies: reads are verified without any shared state."""
    seed = xxhash.xxh64_intdigest(bytes(key))
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@ray.remote(num_cpus=0)
class SoakClient:
    def __init__(self, index: int, tenants: list[str], chunk_bytes: int, timeout_s: float, run: str) -> None:
        from kvpool.cluster.bootstrap import shard_id_of
        from kvpool.node.client import NodeClient

        self.i = index
        self.tenants = tenants
        self.nb = chunk_bytes
        self.c = NodeClient(shard=shard_id_of(ray.get_runtime_context().get_node_id()), directory=run,
                            timeout_s=timeout_s)
        self.rng = np.random.default_rng(index)
        self.convs: list[tuple[str, np.ndarray]] = []  # (tenant, tokens so far)

    def rss(self) -> int:
        return rss_bytes()

    def _keys(self, tenant: str, tokens: np.ndarray) -> list[ChunkKey]:
        return chunk_keys(tokens, Namespace.for_spec(SPEC, NS_SALT + tenant.encode()), SPEC.chunk_tokens)

    def run(self, seconds: float) -> dict:
        lat: dict[str, list[float]] = {"lookup": [], "get": [], "put": []}
        errors: dict[str, int] = {}
        wrong = chunks_read = 0
        deadline = time.monotonic() + seconds

        def timed(kind: str, fn):
            t0 = time.perf_counter()
            try:
                return fn()
            except KvPoolError as e:
                errors[f"{type(e).__name__} {e.status}"] = errors.get(f"{type(e).__name__} {e.status}", 0) + 1
                return None
            finally:
                lat[kind].append((time.perf_counter() - t0) * 1e3)

        while time.monotonic() < deadline:
            r = self.rng.random()
            if r < 0.7 and self.convs:
                z = min(int(self.rng.zipf(1.3)) - 1, len(self.convs) - 1)
                tenant, tokens = self.convs[-1 - z]  # recent conversations return more often
                keys = self._keys(tenant, tokens)
                hit = timed("lookup", partial(self.c.lookup, tenant, keys))
                if hit is not None and hit.count:
                    got = timed("get", partial(self.c.get, tenant, keys, hit)) or []
                    chunks_read += len(got)
                    wrong += sum(not np.array_equal(g, truth(keys[j], self.nb)) for j, g in enumerate(got))
                more = self.rng.integers(0, 32000, SPEC.chunk_tokens)
                tokens = np.concatenate([tokens, more])
                k2 = self._keys(tenant, tokens)
                timed("put", partial(self.c.put, tenant, k2[-1:], [truth(k2[-1], self.nb)],
                                     first_position=len(k2) - 1))
                self.convs[-1 - z] = (tenant, tokens)
            elif r < 0.9:
                tenant = self.tenants[int(self.rng.integers(len(self.tenants)))]
                tokens = self.rng.integers(0, 32000, SPEC.chunk_tokens * int(self.rng.integers(2, 6)))
                keys = self._keys(tenant, tokens)
                timed("put", partial(self.c.put, tenant, keys, [truth(k, self.nb) for k in keys]))
                self.convs.append((tenant, tokens))
                self.convs = self.convs[-200:]
            else:
                tokens = self.rng.integers(0, 32000, SPEC.chunk_tokens * 3)
                timed("lookup", partial(self.c.lookup, self.tenants[0], self._keys(self.tenants[0], tokens)))
        return {"latency_ms": lat, "errors": errors, "wrong_bytes": wrong, "chunks_read": chunks_read}

    def close(self) -> None:
        self.c.close()


def run(seconds: float = 20.0, clients: int = 4, nodes: int = 2, chunk_kib: int = 64, dram_pages: int = 512,
        timeout_s: float = 5.0, progress: bool = True) -> dict:
    import shutil
    import tempfile

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvpool.cluster.bootstrap import down, up
    from kvpool.cluster.local import local_cluster
    from kvpool.cluster.shard import shard_name
    from kvpool.node.paths import own_run_dir
    from kvpool.progress import Progress

    nb = chunk_kib << 10
    tenants = ["a", "b", "c"]
    ns = "kvpool-soak"
    run_dir = tempfile.mkdtemp(prefix="kvpool-soak-run-")  # its own node files
    with own_run_dir(run_dir), local_cluster(nodes, namespace=ns, logging_level="ERROR") as (c, workers):
        state = up(store={"page_bytes": nb, "dram_pages": dram_pages}, tenants=[{"id": t} for t in tenants],
                   namespace=ns)
        node_ids = [ray.get_runtime_context().get_node_id()] + [w.node_id for w in workers]
        procs = [SoakClient.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids[i % nodes], soft=False))
                 .remote(i, tenants, nb, timeout_s, run_dir) for i in range(clients)]
        shards = {sid: ray.get_actor(shard_name("default", sid), namespace=ns) for sid in state["shards"]}

        def rss_all() -> dict[str, int]:
            out = {f"client-{i}": ray.get(p.rss.remote(), timeout=30) for i, p in enumerate(procs)}
            for sid, h in shards.items():
                out[sid] = ray.get(h.__ray_call__.remote(lambda self: rss_bytes()), timeout=30)
            return out

        rss_start = rss_all()
        warm = max(seconds * 0.25, 2.0)  # the first quarter fills the slabs and the index
        ray.get([p.run.remote(warm) for p in procs], timeout=warm + 120)
        rss_warm = rss_all()
        t0 = time.monotonic()
        refs = [p.run.remote(seconds) for p in procs]
        with Progress(int(seconds), "soak", enabled=progress) as bar:
            while not all(ray.wait([r], timeout=0)[0] for r in refs):
                time.sleep(1)
                bar.advance()
        results = ray.get(refs, timeout=120)
        wall = time.monotonic() - t0
        rss_end = rss_all()
        ray.get([p.close.remote() for p in procs], timeout=60)
        down(namespace=ns)
    shutil.rmtree(run_dir, ignore_errors=True)
    lat = {k: [x for r in results for x in r["latency_ms"][k]] for k in ("lookup", "get", "put")}
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    ops = sum(len(v) for v in lat.values())

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q)) if xs else None

    return {
        "seconds": wall, "clients": clients, "nodes": nodes, "chunk_bytes": nb, "ops": ops, "ops_per_s": ops / wall,
        "chunks_read": sum(r["chunks_read"] for r in results), "wrong_bytes": sum(r["wrong_bytes"] for r in results),
        "errors": errors,
        "latency_ms": {k: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99), "max": max(v) if v else None}
                       for k, v in lat.items()},
        "rss_mib": {p: {"start": rss_start[p] / 2**20, "warm": rss_warm[p] / 2**20, "end": rss_end[p] / 2**20}
                    for p in rss_start},
        "rss_growth_after_warmup_mib": max((rss_end[p] - rss_warm[p]) / 2**20 for p in rss_start),
        "median_get_ms": statistics.median(lat["get"]) if lat["get"] else None,
    }


def format_report(r: dict) -> str:
    lines = [f"soak: {r['clients']} clients on {r['nodes']} nodes for {r['seconds']:.0f} s, "
             f"{r['chunk_bytes'] >> 10} KiB chunks: {r['ops']} ops ({r['ops_per_s']:.0f}/s), "
             f"{r['chunks_read']} chunks read, wrong bytes {r['wrong_bytes']}",
             f"{'op':<8}{'n':>8}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"]
    for k, v in r["latency_ms"].items():
        if v["n"]:
            lines.append(f"{k:<8}{v['n']:>8}{v['p50']:>9.2f}{v['p99']:>9.2f}{v['max']:>9.1f}")
    lines.append("errors: " + (", ".join(f"{k} x{v}" for k, v in r["errors"].items()) or "none"))
    lines.append(f"{'process':<22}{'start MiB':>10}{'warm MiB':>10}{'end MiB':>10}")
    for p, m in r["rss_mib"].items():
        lines.append(f"{p:<22}{m['start']:>10.1f}{m['warm']:>10.1f}{m['end']:>10.1f}")
    lines.append(f"largest RSS growth after warm-up: {r['rss_growth_after_warmup_mib']:.1f} MiB")
    return "\n".join(lines)
