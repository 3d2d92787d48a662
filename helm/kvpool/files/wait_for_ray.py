"""Waits until the Ray cluster answers and has at least $KVPOOL_WAIT_NODES alive nodes.

Run by the chart's `kvpool up` Job before placing shards: `kvpool up` puts a shard on every node
alive at that moment, so it must not run before the workers joined. Settings (environment):
KVPOOL_RAY_ADDRESS (ray://host:10001), KVPOOL_WAIT_NODES (default 1), KVPOOL_WAIT_TIMEOUT_S
(default 600), KVPOOL_WAIT_POLL_S (default 5). Exit status 0 when enough nodes joined, 1 with a
message naming what was missing when the time ran out.
"""

from __future__ import annotations

import os
import sys
import time


def alive_nodes(ray) -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def wait(ray, address: str, want: int, timeout_s: float, poll_s: float, log=print) -> int:
    """Alive nodes once ``want`` joined; raises TimeoutError naming the last state otherwise."""
    deadline = time.monotonic() + timeout_s
    last = "the cluster never answered"
    while True:
        try:
            if not ray.is_initialized():
                ray.init(address=address, namespace="kvpool", logging_level="ERROR", log_to_driver=False)
            n = alive_nodes(ray)
            last = f"{n} of {want} Ray nodes alive"
            if n >= want:
                log(f"wait_for_ray: {last}")
                return n
        except Exception as e:  # noqa: BLE001 - the head may not be up yet: try again until the deadline
            last = f"{address} did not answer ({type(e).__name__}: {e})"
            try:
                ray.shutdown()
            except Exception:  # noqa: BLE001
                pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"after {timeout_s:.0f} s: {last}")
        log(f"wait_for_ray: {last}; waiting")
        time.sleep(poll_s)


def main() -> int:
    import ray

    address = os.environ.get("KVPOOL_RAY_ADDRESS")
    if not address:
        print("wait_for_ray: set KVPOOL_RAY_ADDRESS (ray://host:10001)", file=sys.stderr)
        return 2
    try:
        wait(ray, address, int(os.environ.get("KVPOOL_WAIT_NODES", "1")),
             float(os.environ.get("KVPOOL_WAIT_TIMEOUT_S", "600")), float(os.environ.get("KVPOOL_WAIT_POLL_S", "5")))
    except TimeoutError as e:
        print(f"wait_for_ray: {e}; check the RayCluster's pods (kubectl get pods -l ray.io/cluster)",
              file=sys.stderr)
        return 1
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
