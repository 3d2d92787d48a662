"""How chunk bytes travel between a client and a shard on another node.

A transport starts a batched send or fetch to a shard and returns a future; the client waits on
it with its timeout. Ray's object store is the one built in. Another transport (an RDMA engine
such as NIXL or Mooncake's transfer engine) plugs in by implementing the same three methods and
registering in ``TRANSPORTS``. A shard on the client's own node is never reached through a
transport: its slab is mapped and copied directly (``PoolClient``).

NOTE: Ray's direct tensor transport (RDT, ``@ray.method(tensor_transport="gloo")``) was tried on
this machine kind (Ray 2.60, CPU, two raylets on loopback): the transfer of a 32 MiB tensor
between two actors never completed (Ray's RDT timeout fired and killed both actors), so the
object store stays the transport; ``kvpool bench datapath --rdt`` repeats the probe.
"""

from __future__ import annotations

from typing import Protocol

import ray

from kvpool.cluster.messages import Get, Put


class Transport(Protocol):
    name: str

    def send(self, shard, put: Put): ...

    def fetch(self, shard, get: Get): ...

    def wait(self, future, timeout_s: float): ...


class RayObjectTransport:
    """Bytes ride Ray's object store: arguments of a shard's ``put``, results of its ``get``."""

    name = "ray"

    def send(self, shard, put: Put):
        return shard.put.remote(put)

    def fetch(self, shard, get: Get):
        return shard.get.remote(get)

    def wait(self, future, timeout_s: float):
        return ray.get(future, timeout=timeout_s)


TRANSPORTS: dict[str, type] = {"ray": RayObjectTransport}
