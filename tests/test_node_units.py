"""Unit tests of the node path's own logic: remembered locations and where new chunks go."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvpool.cluster.locations import Locations
from kvpool.cluster.placement import SPILL_MARGIN, Placement


def test_locations_answer_the_leading_run_until_they_expire_or_are_forgotten():
    loc = Locations(ttl_s=0.2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    loc.remember([a, b], ["s1", "s2"])
    assert loc.recall([a, b, c]) == ["s1", "s2"]
    assert loc.recall([c, a]) == []  # the leading run only
    loc.forget([b])
    assert loc.recall([a, b]) == ["s1"]
    time.sleep(0.25)
    assert loc.recall([a]) == []


def test_locations_keep_at_most_their_limit():
    loc = Locations(limit=3)
    keys = [bytes([i]) * 16 for i in range(5)]
    loc.remember(keys, ["s"] * 5)
    assert loc.recall(keys[:2]) == [] and loc.recall(keys[2:]) == ["s"] * 3


def _service(free: int, total: int, loads: dict):
    cache = SimpleNamespace(tier_pages=[total], tier_used=lambda t: total - free)
    members = SimpleNamespace(loads=lambda: loads)  # the other shards' (free, total) pages
    return SimpleNamespace(store=SimpleNamespace(_cache=cache), shard_id="here", members=members)


def test_new_chunks_stay_local_while_there_is_room_and_spill_only_to_clearly_emptier_shards():
    loads = {"far": (90, 100)}
    assert Placement(_service(free=10, total=100, loads=loads)).spill(4) is None  # free pages here: stays
    p = Placement(_service(free=2, total=100, loads=loads))
    loads["near"] = (3, 100)
    assert p.spill(4) == "far"  # would evict here; the emptiest has room
    loads.clear()
    loads["far"] = (2 + int(SPILL_MARGIN * 100) - 1, 100)
    assert p.spill(3) is None  # not clearly emptier: evict here instead
    loads["far"] = (2 + int(SPILL_MARGIN * 100) + 1, 100)
    assert p.spill(3) == "far"
    loads["far"] = (3, 100)
    assert p.spill(4) is None  # no room there either
