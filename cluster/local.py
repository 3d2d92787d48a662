"""One way to start a local multi-node Ray cluster on this machine (benchmarks, soak, tests), and
``local_cluster_pool``: a one-node pool on local Ray started in this process, reached as engines
reach theirs (what `kvpool demo` runs on).

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


@contextlib.contextmanager
def local_cluster_pool(spec, tenants, dram_chunks: int, address: str | None = None, index_url: str | None = None):
    """A pool on local Ray (started here, or ``address``) with the embedded index (or Redis at
    ``index_url``) holding ``dram_chunks`` chunks of ``spec``, as an engine opens it: a SlicedPool
    (kvpool.slices) over a NodePool through this node's shard, pages one slice each; torn down after."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from kvpool.cluster.bootstrap import down, shard_id_of, up
    from kvpool.codec import stored_nbytes
    from kvpool.connectors.pools import node_pool
    from kvpool.node.client import NodeClient
    from kvpool.slices import Slicing

    ns = "kvpool-demo"
    if address:
        ray.init(address=address, namespace=ns, logging_level="ERROR", log_to_driver=False)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback only; see kvpool.cluster.ops
        ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=ns, logging_level="ERROR",
                 log_to_driver=False)
    opened = None
    slicing = Slicing.of(spec)
    part = slicing.slice_spec(spec)
    try:
        up(store={"page_bytes": stored_nbytes(part), "dram_pages": dram_chunks * slicing.per_chunk,
                  "storage_format": spec.storage_format},
           tenants=[{"id": t.id} for t in tenants], namespace=ns, index_url=index_url)
        opened = NodeClient(shard=shard_id_of(ray.get_runtime_context().get_node_id()), timeout_s=10.0)
        yield node_pool(spec, opened, tenants, slicing)
    finally:
        if opened is not None:
            opened.close()
        down(namespace=ns)
        ray.shutdown()
