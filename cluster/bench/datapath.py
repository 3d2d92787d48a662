"""``kvpool bench datapath``: moving 32 MiB chunks through the pool on a local multi-node Ray
cluster, each figure beside its baseline in the same run.

- same node: the client and the shard share a node; put/get go through the shard's shared-memory
  slab (one copy, verified) -- against a plain in-process copy of the same bytes;
- cross node: put/get ride Ray between raylets -- against a raw Ray transfer of the same bytes (an
  actor on the other node returning a fresh array).
Starts and stops its own cluster on the loopback address (:func:`kvpool.cluster.local.local_cluster`).
"""

from __future__ import annotations

import os
import statistics
import time

# NOTE: read when Ray is imported: keeps every node of the benchmark's cluster on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # its cluster is loopback-only

import numpy as np  # noqa: E402
import ray  # noqa: E402

from kvpool.keys import Namespace, chunk_keys  # noqa: E402
from kvpool.progress import Progress  # noqa: E402
from kvpool.spec import KVSpec  # noqa: E402


@ray.remote(num_cpus=0)
class _Source:
    def data(self, n: int, nbytes: int) -> list[np.ndarray]:
        return [np.full(nbytes, i % 251, dtype=np.uint8) for i in range(n)]


def run(nodes: int = 2, chunk_mib: int = 32, chunks: int = 4, trials: int = 5, progress: bool = True) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvpool.cluster.bootstrap import down, shard_id_of, up
    from kvpool.cluster.client import PoolClient
    from kvpool.cluster.local import local_cluster

    nb = chunk_mib << 20
    with local_cluster(nodes, namespace="kvpool-bench", object_store_memory=1 << 30) as (c, workers):
        up(store={"page_bytes": nb, "dram_pages": chunks * 4}, tenants=[{"id": "bench"}])
        client = PoolClient(timeout_s=60.0)
        here = shard_id_of(client.node_id)
        there = shard_id_of(workers[0].node_id) if workers else None
        spec = KVSpec("bench", 32, 8, 128)
        rng = np.random.default_rng(0)
        srcs = [rng.integers(0, 256, nb, dtype=np.uint8) for _ in range(chunks)]
        dsts = [np.empty(nb, dtype=np.uint8) for _ in range(chunks)]
        source = _Source.options(scheduling_strategy=NodeAffinitySchedulingStrategy(workers[0].node_id, soft=False)
                                 ).remote() if workers else None

        def keys_on(shard: str, salt: int) -> list:
            out, i = [], 0
            while len(out) < chunks:
                k = chunk_keys(np.arange(256) + 1000 * i + salt * 10**7, Namespace.for_spec(spec, b"b"), 256)[0]
                if client.ring.owners(bytes(k))[0] == shard:
                    out.append(k)
                i += 1
            return out

        rows: dict[str, list[float]] = {k: [] for k in ("copy", "shm_put", "shm_get", "ray_put", "ray_get", "raw_ray")}
        with Progress(trials, "bench datapath", enabled=progress) as bar:
            for t in range(trials):
                t0 = time.perf_counter()
                for s, d in zip(srcs, dsts):
                    np.copyto(d, s)
                rows["copy"].append(time.perf_counter() - t0)
                k_local = keys_on(here, 2 * t)
                t0 = time.perf_counter()
                assert client.put("bench", k_local, srcs) == chunks
                rows["shm_put"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = client.get("bench", k_local, outs=dsts)  # like an engine: into its own buffers
                rows["shm_get"].append(time.perf_counter() - t0)
                assert len(got) == chunks and np.array_equal(dsts[-1], srcs[-1])
                if there:
                    k_remote = keys_on(there, 2 * t + 1)
                    t0 = time.perf_counter()
                    assert client.put("bench", k_remote, srcs) == chunks
                    rows["ray_put"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = client.get("bench", k_remote)
                    rows["ray_get"].append(time.perf_counter() - t0)
                    assert len(got) == chunks and np.array_equal(got[0], srcs[0])
                    t0 = time.perf_counter()
                    raw = ray.get(source.data.remote(chunks, nb))
                    rows["raw_ray"].append(time.perf_counter() - t0)
                    assert len(raw) == chunks
                client.index.remove(k_local + (k_remote if there else []))
                for sid in (here, there):
                    if sid:
                        from kvpool.cluster.shard import shard_name

                        h = ray.get_actor(shard_name("default", sid))
                        ray.get(h.remove.remote([bytes(k) for k in k_local + (k_remote if there else [])], "bench"))
                bar.advance()
        total = nb * chunks
        med = statistics.median

        def ratio(a: str, b: str) -> float:
            return med([rows[b][i] / rows[a][i] for i in range(trials)])

        out = {
            "nodes": nodes, "chunk_bytes": nb, "chunks": chunks, "trials": trials,
            "copy_gbps": total / med(rows["copy"]) / 1e9,
            "same_node_put_gbps": total / med(rows["shm_put"]) / 1e9,
            "same_node_get_gbps": total / med(rows["shm_get"]) / 1e9,
            "same_node_put_vs_copy": ratio("shm_put", "copy"),
            "same_node_get_vs_copy": ratio("shm_get", "copy"),
        }
        if there:
            out |= {
                "cross_node_put_gbps": total / med(rows["ray_put"]) / 1e9,
                "cross_node_get_gbps": total / med(rows["ray_get"]) / 1e9,
                "raw_ray_gbps": total / med(rows["raw_ray"]) / 1e9,
                "cross_node_get_vs_ray": ratio("ray_get", "raw_ray"),
                "cross_node_get_vs_copy": ratio("ray_get", "copy"),
            }
        client.close()
        down(namespace="kvpool-bench")
        return out


@ray.remote(num_cpus=0)
class _Client:
    """A pool client on one node, as an engine there would hold."""

    def __init__(self, timeout_s: float) -> None:
        from kvpool.cluster.client import PoolClient

        self.c = PoolClient(timeout_s=timeout_s, refresh=False)

    def refresh(self) -> int:
        self.c.refresh()
        return len(self.c.ring)

    def traffic(self, salt: int, chunks: int, nbytes: int, rounds: int) -> tuple[int, float]:
        """Puts then gets ``chunks`` fresh chunks per round; (bytes moved, seconds)."""
        spec = KVSpec("bench", 32, 8, 128)
        src = [np.full(nbytes, (salt + i) % 251, dtype=np.uint8) for i in range(chunks)]
        moved, t0 = 0, time.perf_counter()
        for r in range(rounds):
            keys = chunk_keys(np.arange(256 * chunks) + (salt * 100 + r) * 10**5, Namespace.for_spec(spec, b"b"), 256)
            moved += self.c.put("bench", keys, src) * nbytes
            got = self.c.get("bench", keys)
            assert all(g[0] == (salt + i) % 251 for i, g in enumerate(got)), "wrong bytes"
            moved += sum(g.shape[0] for g in got)
        return moved, time.perf_counter() - t0

    def close(self) -> None:
        self.c.close()


def run_aggregate(max_nodes: int = 3, chunk_mib: int = 8, chunks: int = 4, rounds: int = 4,
                  progress: bool = True) -> list[dict]:
    """Aggregate put+get throughput with one client per node, all clients at once, as the cluster
    grows from 1 to ``max_nodes`` nodes (one shard each). Keys spread over every shard, so most
    bytes cross nodes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvpool.cluster.bootstrap import up
    from kvpool.cluster.local import local_cluster

    nb = chunk_mib << 20
    store = {"page_bytes": nb, "dram_pages": chunks * max_nodes * 2}
    rows = []
    with local_cluster(1, namespace="kvpool-bench", object_store_memory=512 << 20) as (c, _):
        nodes = [ray.get_runtime_context().get_node_id()]
        with Progress(max_nodes, "bench datapath --aggregate", enabled=progress) as bar:
            for n in range(1, max_nodes + 1):
                if n > 1:
                    nodes.append(c.add_node(num_cpus=1, object_store_memory=512 << 20).node_id)
                    c.wait_for_nodes()
                up(store=store, tenants=[{"id": "bench"}])
                clients = [_Client.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
                           .remote(60.0) for nid in nodes]
                assert all(k == n for k in ray.get([cl.refresh.remote() for cl in clients], timeout=120))
                t0 = time.perf_counter()
                res = ray.get([cl.traffic.remote(i + 10 * n, chunks, nb, rounds) for i, cl in enumerate(clients)],
                              timeout=600)
                wall = time.perf_counter() - t0
                total = sum(m for m, _ in res)
                rows.append({"nodes": n, "clients": n, "bytes": total, "seconds": wall, "gbps": total / wall / 1e9})
                ray.get([cl.close.remote() for cl in clients], timeout=60)
                for cl in clients:
                    ray.kill(cl)
                bar.advance(note=f"{n} nodes")
        from kvpool.cluster.bootstrap import down

        down(namespace="kvpool-bench")
        return rows


def probe_rdt(chunk_mib: int = 32, trials: int = 3, timeout_s: float = 15.0) -> dict:
    """Ray's direct tensor transport (gloo) between actors on two nodes, beside the object store
    moving the same bytes between the same actors: GB/s of each, or the error RDT gave."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvpool.cluster.local import local_cluster

    os.environ["RAY_rdt_fetch_fail_timeout_milliseconds"] = str(int(timeout_s * 1000))
    import torch

    nb = chunk_mib << 20

    @ray.remote(num_cpus=0)
    class Src:
        def __init__(self) -> None:
            self.t = torch.ones(nb, dtype=torch.uint8)

        @ray.method(tensor_transport="gloo")
        def rdt(self):
            return self.t.clone()

        def obj(self):
            return self.t.numpy().copy()

    @ray.remote(num_cpus=0)
    class Dst:
        def take(self, t) -> int:
            return int(t.shape[0])

        def pull(self, src, n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                assert ray.get(src.obj.remote()).shape[0] == nb
            return n * nb / (time.perf_counter() - t0) / 1e9

    out: dict = {"chunk_bytes": nb}
    with local_cluster(2) as (c, (other,)):
        here = ray.get_runtime_context().get_node_id()
        src = Src.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
        dst = Dst.options(scheduling_strategy=NodeAffinitySchedulingStrategy(other.node_id, soft=False)).remote()
        out["object_store_gbps"] = ray.get(dst.pull.remote(src, trials), timeout=120)
        from ray.experimental.collective import create_collective_group

        create_collective_group([src, dst], backend="torch_gloo")
        t0 = time.perf_counter()
        try:
            for _ in range(trials):
                assert ray.get(dst.take.remote(src.rdt.remote()), timeout=timeout_s * 2) == nb
            out["rdt_gloo_gbps"] = trials * nb / (time.perf_counter() - t0) / 1e9
        except Exception as e:  # noqa: BLE001 - the probe reports what RDT did
            out["rdt_gloo_gbps"] = None
            out["rdt_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return out


def format_aggregate(rows: list[dict]) -> str:
    base = rows[0]["gbps"]
    lines = [f"{'nodes':>5}{'clients':>8}{'GB moved':>10}{'GB/s':>8}{'vs 1 node':>11}"]
    lines += [f"{r['nodes']:>5}{r['clients']:>8}{r['bytes'] / 1e9:>10.2f}{r['gbps']:>8.2f}{r['gbps'] / base:>10.2f}x"
              for r in rows]
    return "\n".join(lines)


def format_table(r: dict) -> str:
    lines = [f"{r['nodes']} nodes on one machine; {r['chunks']} chunks of {r['chunk_bytes'] >> 20} MiB per trial, "
             f"median of {r['trials']}",
             f"{'path':<34}{'GB/s':>8}{'ratio':>8}  baseline",
             f"{'plain copy (numpy, 1 thread)':<34}{r['copy_gbps']:>8.2f}",
             f"{'same-node put (shared memory)':<34}{r['same_node_put_gbps']:>8.2f}{r['same_node_put_vs_copy']:>8.2f}  copy",
             f"{'same-node get (shared memory)':<34}{r['same_node_get_gbps']:>8.2f}{r['same_node_get_vs_copy']:>8.2f}  copy"]
    if "raw_ray_gbps" in r:
        lines += [
            f"{'raw Ray transfer between raylets':<34}{r['raw_ray_gbps']:>8.2f}",
            f"{'cross-node put (Ray)':<34}{r['cross_node_put_gbps']:>8.2f}",
            f"{'cross-node get (Ray)':<34}{r['cross_node_get_gbps']:>8.2f}{r['cross_node_get_vs_ray']:>8.2f}  raw Ray",
        ]
    return "\n".join(lines)
