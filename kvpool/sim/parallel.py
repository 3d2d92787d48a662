"""Independent simulations of one request list, run in parallel over the machine's cores."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from kvpool.progress import Progress
from kvpool.sim.trace import SimRequest

_REQS: list[SimRequest] = []  # the requests, inherited by forked workers instead of pickled
_FN: Callable | None = None


def _one(task):
    return _FN(_REQS, task)


def run_all(reqs: list[SimRequest], tasks: Sequence[Hashable], fn: Callable[[list[SimRequest], Hashable], dict],
            label: str, note: Callable[[Hashable], str], progress: bool = True,
            workers: int | None = None) -> dict:
    """``{task: fn(reqs, task)}`` for every task, in forked workers where the platform forks (one
    process otherwise), with a progress bar on stderr."""
    global _REQS, _FN
    workers = workers or min(len(tasks), os.cpu_count() or 1)
    results: dict = {}
    _REQS, _FN = reqs, fn
    try:
        with Progress(len(tasks), label, enabled=progress) as bar:
            if workers <= 1 or "fork" not in mp.get_all_start_methods():
                for t in tasks:
                    results[t] = _one(t)
                    bar.advance(note=note(t))
            else:
                with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as ex:
                    futs = {ex.submit(_one, t): t for t in tasks}
                    for f in as_completed(futs):
                        results[futs[f]] = f.result()
                        bar.advance(note=note(futs[f]))
    finally:
        _REQS, _FN = [], None
    return results
