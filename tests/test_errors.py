"""Every typed error keeps its type and fields when it crosses a process boundary: pickled, and
raised in a Ray task and caught by the caller (a 429 raised in a shard once reached clients as
Ray's UnserializableException)."""

from __future__ import annotations

import inspect
import os
import pickle

import pytest

import kvpool.connectors.families  # noqa: F401 - registers UnsupportedModel
import kvpool.node.messages  # noqa: F401 - registers WireMismatch
from kvpool.errors import KvPoolError

SAMPLE = {"tenant": "t", "usage": 1, "limit": 2, "requested": 3, "request_id": 4, "priority": 5, "message": "m",
          "model": "x", "reason": "y"}


def every_error() -> list[type]:
    out, todo = [], [KvPoolError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(set(out), key=lambda c: c.__name__)


def make(cls: type) -> KvPoolError:
    names = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    params = inspect.signature(cls.__init__).parameters
    return cls(*[SAMPLE.get(n, "v") for n in names if params[n].default is inspect.Parameter.empty])


ERRORS = every_error()


def test_every_error_class_is_found():
    names = {c.__name__ for c in ERRORS}
    assert {"QuotaExceeded", "RequestCancelled", "Unavailable", "Unauthorized", "WireMismatch"} <= names


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_an_error_survives_pickling_with_its_type_and_fields(cls):
    e = make(cls)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and back.status == e.status and str(back) == str(e) and back.__dict__ == e.__dict__


def test_errors_raised_in_a_ray_task_reach_the_caller_with_their_type():
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        @ray.remote
        def fail(e):
            raise e

        for cls in ERRORS:
            e = make(cls)
            with pytest.raises(cls) as got:
                ray.get(fail.remote(e), timeout=60)
            assert got.value.status == e.status and getattr(got.value, "tenant", None) == getattr(e, "tenant", None)
    finally:
        ray.shutdown()
