"""Load: concurrent client processes on a local 2-node pool for a bounded time (the long soak is
`kvpool bench soak --seconds 600`): zero wrong bytes, only typed errors, latency within the
timeout, and memory that stops growing after warm-up."""

from kvpool.cluster.bench import soak


def test_concurrent_clients_get_only_right_bytes_and_memory_stays_bounded():
    r = soak.run(seconds=12, clients=3, nodes=2, progress=False)
    print("FIGURES", {k: r[k] for k in ("ops", "ops_per_s", "wrong_bytes", "errors", "latency_ms",
                                        "rss_growth_after_warmup_mib")})
    assert r["ops"] > 300 and r["chunks_read"] > 300
    assert r["wrong_bytes"] == 0
    assert all(k.split()[-1] in ("429", "503", "507") for k in r["errors"]), r["errors"]  # typed, expected kinds
    assert r["latency_ms"]["get"]["max"] < 5000  # no call outlived the client's 5 s timeout
    # Bounded: after warm-up no process grows by more than a slab's worth of bookkeeping.
    assert r["rss_growth_after_warmup_mib"] < 64, r["rss_mib"]
