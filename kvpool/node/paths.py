"""Where a node's files are: the run dir (``$KVPOOL_RUN_DIR``, else ``/dev/shm/kvpool-<uid>``, a
private directory: kvpool.node.trust) holds each shard's socket, page table, slab and node file
(``kvpool-<pool>-<shard>.node``: what an engine reads to find its node's shard)."""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

from kvpool.node.trust import default_run_dir

RUN_DIR_ENV = "KVPOOL_RUN_DIR"


def run_dir(given: str | None = None) -> str:
    """The run dir: ``given``, else ``$KVPOOL_RUN_DIR``, else ``/dev/shm/kvpool-<uid>``."""
    return given or os.environ.get(RUN_DIR_ENV) or default_run_dir()


def node_paths(directory: str, pool: str, shard_id: str) -> dict[str, str]:
    """A shard's socket, page table and node file in ``directory``."""
    base = os.path.join(directory, f"kvpool-{pool}-{shard_id}")
    return {"socket": base + ".sock", "table": base + ".kvtable", "node": base + ".node"}


def node_files(directory: str, pool: str, shard_id: str | None = None) -> list[str]:
    """The node files of ``pool``'s shards in ``directory`` (the one of ``shard_id`` when given)."""
    if shard_id:
        return [node_paths(directory, pool, shard_id)["node"]]
    return sorted(glob.glob(os.path.join(glob.escape(directory), f"kvpool-{glob.escape(pool)}-*.node")))


@contextlib.contextmanager
def own_run_dir(directory: str) -> Iterator[str]:
    """``$KVPOOL_RUN_DIR`` set to ``directory`` for the block (a pool started in it, a benchmark's
    or a test's, keeps its node files apart), restored after."""
    old = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = directory
    try:
        yield directory
    finally:
        if old is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = old
