"""Checks of the arguments callers pass to the store (a BadRequest, 400, on a bad one)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from kvpool.errors import BadRequest
from kvpool.store.requests import ActiveRequest


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise BadRequest(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_ttl(ttl_s: object) -> float:
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not (0 <= ttl_s and math.isfinite(ttl_s)):
        raise BadRequest(f"ttl_s must be a finite number of seconds >= 0, got {ttl_s!r}")
    return float(ttl_s)


def _check_position(first_position: object) -> int:
    if not isinstance(first_position, numbers.Integral) or isinstance(first_position, bool) or first_position < 0:
        raise BadRequest(f"first_position must be an int >= 0 (the chunk index of keys[0]), got {first_position!r}")
    return int(first_position)


def _as_list(name: str, value: object) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise BadRequest(f"{name} must be a list, one item per key, got {type(value).__name__}")
    return list(value)


def _check_request(request: object) -> None:
    if request is not None:
        if not isinstance(request, ActiveRequest):
            raise BadRequest(f"request must come from begin(), got {type(request).__name__}")
        request.check()
