"""The production rules around eviction: requests in flight, cancellation, watermarks, warm-up,
fractional quotas, guaranteed shares and health verdicts."""

import numpy as np
import pytest
import torch
from conftest import make_keys, make_store, payload, wait_for

from kvpool import BadRequest, ChunkStore, KVSpec, PoolFull, QuotaExceeded, StoreConfig, Tenant, TenantRegistry
from kvpool.errors import RequestCancelled
from kvpool.health import HealthMonitor, figures_from_stats, judge
from kvpool.pool import LocalPool


def store_with(tenants, pages=4, **config):
    return ChunkStore(StoreConfig(1024, pages, policy=config.pop("policy", "lru"), **config), TenantRegistry(tenants))


def test_streaming_requests_keep_their_chunks_and_the_lowest_priority_one_is_cancelled():
    s = store_with([Tenant("hi", priority="high"), Tenant("lo", priority="low")], pages=4)
    k = [make_keys(1, seed=i)[0] for i in range(6)]
    old_low = s.begin("lo")
    s.put(k[0], payload(0), "lo", request=old_low)
    young_low = s.begin("lo")
    s.put(k[1], payload(1), "lo", request=young_low)
    high = s.begin("hi")
    s.put_many([k[2]], [payload(2)], "hi", request=high)
    s.put(k[3], payload(3), "hi", request=high)
    # Full, and every page belongs to a request in flight: the youngest low-priority one goes.
    s.put(k[4], payload(4), "hi", request=high)
    assert young_low.cancelled and not old_low.cancelled and not high.cancelled
    assert s.metrics.cancelled_requests.get("lo") == 1
    with pytest.raises(RequestCancelled) as e:
        s.put(k[5], payload(5), "lo", request=young_low)
    assert e.value.status == 429 and "lowest-priority" in str(e.value)
    assert s.contains_many(k[:5], "hi") == [False, False, True, True, True]
    assert s.contains(k[0], "lo")  # the older low request's chunk was never touched


def test_the_writer_itself_is_cancelled_when_it_is_the_lowest_priority():
    s = store_with([Tenant("hi", priority="high"), Tenant("lo", priority="low")], pages=2)
    k = [make_keys(1, seed=i)[0] for i in range(3)]
    high = s.begin("hi")
    s.put(k[0], payload(0), "hi", request=high)
    low = s.begin("lo")
    s.put(k[1], payload(1), "lo", request=low)
    with pytest.raises(RequestCancelled):
        s.put(k[2], payload(2), "lo", request=low)
    assert low.cancelled and not high.cancelled
    assert s.tenants.usage("lo") == 1000  # the chunk it stored before stays, accounted


def test_without_requests_in_flight_a_full_pool_of_leases_is_a_507():
    s = make_store(dram_pages=1)
    a, b = make_keys(1, seed=1)[0], make_keys(1, seed=2)[0]
    s.put(a, payload(0), "a")
    with s.lease([a], "a"):
        with pytest.raises(PoolFull):
            s.put(b, payload(1), "a")
    assert s.metrics.rejected_full.get("dram") == 1


def test_ending_a_request_releases_its_chunks():
    s = make_store(dram_pages=2)
    k = [make_keys(1, seed=i)[0] for i in range(3)]
    r = s.begin("a")
    s.put(k[0], payload(0), "a", request=r)
    s.put(k[1], payload(1), "a", request=r)
    s.end(r)
    s.put(k[2], payload(2), "a")
    assert s.contains(k[2], "a") and len(s) == 2


@pytest.mark.parametrize("fmt, high", [("raw", 0.90), ("fp8", 0.95), ("int4-kivi", 0.97)])
def test_default_high_watermark_follows_the_storage_format(fmt, high):
    assert StoreConfig(1024, 4, storage_format=fmt).watermarks == (high, pytest.approx(high - 0.10))


def test_bad_watermarks_are_rejected():
    with pytest.raises(BadRequest, match="watermarks"):
        StoreConfig(1024, 4, high_watermark=0.5, low_watermark=0.6)


def test_eviction_from_high_to_low_watermark():
    s = make_store(dram_pages=10, high_watermark=0.8, low_watermark=0.5)
    k = [make_keys(1, seed=i)[0] for i in range(9)]
    for i in range(8):
        s.put(k[i], payload(i), "a")
    assert s.evict_to_low_watermark() == 0  # 80%: not above the high watermark
    s.put(k[8], payload(8), "a")
    assert s.evict_to_low_watermark() == 4  # 90% -> 50%
    assert s.contains_many(k, "a") == [False] * 4 + [True] * 5  # the least recently used went


def test_background_evictor_keeps_puts_from_waiting():
    s = store_with([Tenant("a")], pages=10, high_watermark=0.8, low_watermark=0.5, background_eviction=True)
    try:
        for i in range(9):
            s.put(make_keys(1, seed=i)[0], payload(i), "a")
        wait_for(lambda: s.occupancy() <= 0.5, 5, interval_s=0.01, what="the background evictor to reach 50%")
        assert s.occupancy() == 0.5
    finally:
        s.close()


def test_quota_as_a_fraction_of_the_pool():
    s = store_with([Tenant("big", quota_fraction=0.5), Tenant("tiny", quota_fraction=0.25)], pages=4)
    k = [make_keys(1, seed=i)[0] for i in range(4)]
    s.put(k[0], payload(0), "tiny")  # 1000 B of 4096 B: within 25% = 1024 B
    with pytest.raises(QuotaExceeded, match="limit 1024 B"):
        s.put(k[1], payload(1), "tiny")
    s.put_many([k[2]], [payload(2)], "big")
    s.put(k[3], payload(3), "big")
    assert s.tenants.usage("big") == 2000


def test_a_burst_cannot_evict_another_tenants_guaranteed_share():
    # steady is guaranteed 45% of 4096 B = 1843 B: it can lose one of its three chunks, not two
    s = store_with([Tenant("steady", guaranteed_fraction=0.45), Tenant("bursty")], pages=4)
    mine = [make_keys(1, seed=100 + i)[0] for i in range(3)]
    for i, k in enumerate(mine):
        s.put(k, payload(i), "steady")
    burst = [make_keys(1, seed=200 + i)[0] for i in range(6)]
    for i, k in enumerate(burst):
        s.put(k, payload(i), "bursty")
    # the burst took one of steady's chunks, then recycled its own pages
    assert sum(s.contains_many(mine, "steady")) == 2
    assert s.tenants.usage("steady") == 2000
    assert sum(s.contains_many(burst, "bursty")) == 2


def test_tenant_fractions_are_checked():
    with pytest.raises(BadRequest, match="fraction"):
        Tenant("x", quota_fraction=1.5)


def test_warmup_preloads_and_pins_up_to_the_cap():
    spec = KVSpec("t", 1, 1, 4, dtype="float32", block_size=4, chunk_tokens=4)
    store = ChunkStore(StoreConfig(spec.chunk_nbytes, 10, policy="tiered", policy_params={"pinned_fraction": 0.2}),
                       TenantRegistry([Tenant("a")]))
    pool = LocalPool(spec, store)
    prompts = [(np.arange(i * 100, i * 100 + 8), [torch.randn(spec.chunk_shape) for _ in range(2)]) for i in range(2)]
    stored, pinned = pool.warmup("a", prompts)
    assert (stored, pinned) == (4, 2)  # 20% of 10 pages
    for i in range(40):  # traffic cannot push the pinned system prompt out
        pool.save("a", pool.keys("a", np.arange(10_000 + 4 * i, 10_004 + 4 * i)), [torch.randn(spec.chunk_shape)])
    assert pool.lookup("a", pool.keys("a", prompts[0][0])) == 8


def test_health_verdicts_flag_out_of_range_figures():
    verdicts = {v.figure: v for v in judge({"hit_rate": 0.5, "evictions_per_s_fraction": 0.001,
                                            "active_occupancy": 0.9, "cancellations_per_hour": 0.0})}
    assert not verdicts["hit_rate"].ok and verdicts["evictions_per_s_fraction"].ok
    assert not verdicts["active_occupancy"].ok and verdicts["cancellations_per_hour"].ok
    assert "OUT OF RANGE" in str(verdicts["hit_rate"])


def test_health_monitor_measures_a_window_of_traffic():
    s = make_store(dram_pages=4)
    clock = [0.0]
    mon = HealthMonitor(s, clock=lambda: clock[0])
    k = make_keys(1)[0]
    s.put(k, payload(0), "a")
    for _ in range(99):
        s.get(k, "a")
    s.get(make_keys(1, seed=3)[0], "a")
    r = s.begin("a", [k])
    clock[0] = 10.0
    f = mon.sample()
    assert f["hit_rate"] == pytest.approx(0.99)
    assert f["active_occupancy"] == pytest.approx(0.25)
    assert f["window_s"] == 10.0
    assert all(v.ok for v in f["verdicts"] if v.figure != "active_occupancy")
    s.end(r)


def test_health_monitor_and_stats_compute_the_same_figures_from_the_same_counters():
    s = store_with([Tenant("hi", priority="high"), Tenant("lo", priority="low")], pages=4)
    clock = [0.0]
    mon = HealthMonitor(s, clock=lambda: clock[0])
    idle = mon.sample()
    assert idle["active_occupancy"] is None and all(v.ok for v in idle["verdicts"])  # idle is not unhealthy
    k = [make_keys(1, seed=i)[0] for i in range(6)]
    low, young_low, high = s.begin("lo"), s.begin("lo"), s.begin("hi")
    s.put(k[0], payload(0), "lo", request=low)
    s.put(k[1], payload(1), "lo", request=young_low)
    s.put_many([k[2], k[3]], [payload(2), payload(3)], "hi", request=high)
    s.put(k[4], payload(4), "hi", request=high)  # full: young_low is cancelled, its chunk evicted
    for key in (k[2], k[3], k[5]):
        s.get(key, "hi")
    clock[0] = 10.0
    window = mon.sample()
    st = s.stats() | {"uptime_s": 10.0, "active_requests": len(s.active_requests())}
    life = figures_from_stats([st])
    assert window["cancellations_per_hour"] == pytest.approx(360.0)
    for figure in ("hit_rate", "evictions_per_s_fraction", "active_occupancy", "cancellations_per_hour"):
        assert window[figure] == pytest.approx(life[figure]), figure
    assert [v.ok for v in window["verdicts"]] == [v.ok for v in life["verdicts"]]
    s.end(low)
    s.end(high)
