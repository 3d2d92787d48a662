"""One way to start a local multi-node Ray cluster on this machine (benchmarks, soak, tests).

``ray.cluster_utils.Cluster`` with a head and ``nodes - 1`` more nodes, every node on the
loopback address and without Ray's token auth (a token left in ``~/.ray`` by another local Ray
would make the heads and clients disagree), this process connected to it; all torn down after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def local_cluster(nodes: int = 2, *, namespace: str | None = None, num_cpus: int = 1,
                  object_store_memory: int | None = None, system_config: dict | None = None,
                  logging_level: str = "INFO") -> Iterator[tuple[object, list]]:
    """``with local_cluster(3, namespace="x") as (cluster, workers): ...``; ``workers`` are the
    nodes besides the head (add more with ``cluster.add_node``).

    NOTE: Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (nodes on 127.0.0.1) when it is
    imported: a caller that imported Ray first must have set it; the assertion below refuses a
    cluster on any other address rather than send traffic off the machine."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": num_cpus, "node_ip_address": "127.0.0.1"}
    if object_store_memory:
        node["object_store_memory"] = object_store_memory
    head = {**node, "include_dashboard": False}
    if system_config:
        head["_system_config"] = system_config
    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        workers = [c.add_node(**node) for _ in range(nodes - 1)]
        ray.init(address=c.address, namespace=namespace, logging_level=logging_level)
        assert c.address.startswith("127.0.0.1"), c.address
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()
