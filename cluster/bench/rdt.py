"""``kvpool bench datapath --rdt``: Ray's direct tensor transport (gloo) between actors on two
nodes, beside Ray's object store moving the same bytes between the same actors: a probe of a
transport the pool could carry bytes on between nodes (it carries them on its own peer streams,
cluster/peers.py). Starts and stops its own cluster on the loopback address."""

from __future__ import annotations

import os
import time

# NOTE: read when Ray is imported: keeps every node of the benchmark's cluster on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # its cluster is loopback-only

import ray  # noqa: E402


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
