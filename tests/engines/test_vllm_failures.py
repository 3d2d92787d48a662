"""A load that fails in a real vLLM engine is recomputed, and is not a pool hit in kvpool's figures.

The pool's chunk is corrupted after the save, so the scheduler's lookup still lists it (the index
does not read the bytes) and the worker's load fails its checksum: the load fails between lookup
and load. vLLM recomputes (policy ``recompute``) and the answer is the cold one.

What vLLM 0.32 counts: it records the connector's tokens as hits when it *admits* the request
(vllm/v1/core/sched/scheduler.py:1299, ``connector_prefix_cache_stats.record(...)`` with the
connector's ``get_external_cache_hit_sources``; and ``prefill_stats.set(num_external_cached_
tokens=...)`` at :1077), before the worker has loaded anything. The worker's failure comes back
as invalid blocks (``_handle_invalid_blocks``, :3356) that only roll ``num_computed_tokens`` back
("Recovered from KV load failure", :3427); the Prometheus counters are monotonic and nothing
takes the tokens back. So ``vllm:prompt_tokens_cached_by_source{source="host"}`` counts a failed
load, and no connector can stop it (a mismatch in the sources is re-labelled
``external_unspecified``, still counted). This test asserts that as it is, and that kvpool's own
figures (what `kvpool stats` shows) count only what was loaded.
"""

from __future__ import annotations

import pytest
from conftest import need_engines

need_engines("vllm")

from tinymodel import random_prompt, save_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine, worker_connector  # noqa: E402

CHUNK = 64
POOL = {"backend": "local", "pool": "test-vllm-failures", "chunk_tokens": CHUNK, "dram_mib": 32}
HOST_HITS = 'vllm:prompt_tokens_cached_by_source{source="host"}'


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)
    llm = make_engine(model, POOL, enable_prefix_caching=False, max_model_len=512, disable_log_stats=False)
    yield llm
    shutdown_engine(llm)


def host_hits(llm) -> float:
    """vLLM's own counter of prompt tokens its connector supplied ("host": kvpool's tier)."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name.startswith("vllm:prompt_tokens_cached_by_source") and m.labels.get("source") == "host":
            total += float(getattr(m, "value", 0))
    return total


def own(name: str, **labels: str) -> float:
    """One of the connector's own series (connectors/vllm_metrics.py) on vLLM's Prometheus registry
    (``LLM.get_metrics`` shows only ``vllm:`` series)."""
    from prometheus_client import REGISTRY

    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def run(llm, prompt):
    conn = scheduler_connector(llm)
    before, fig0 = dict(conn.counters), conn.figures()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    gained = {k: v - before.get(k, 0) for k, v in conn.counters.items()}
    fig1 = conn.figures()
    lps = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]
    return list(out.token_ids), lps, gained, {k: fig1[k] - fig0.get(k, 0) for k in (
        "loads", "loaded_tokens", "failed_tokens", "load_failures", "pool_tokens")}


def test_a_load_that_fails_after_the_lookup_is_recomputed_and_not_a_kvpool_hit(engine):
    prompt = random_prompt(300, seed=21)  # 4 whole chunks + 44
    cold = run(engine, prompt)
    assert cold[2].get("saved_chunks") == 4 and cold[3]["loads"] == 0
    # a good load first: it counts, in kvpool's figures and in vLLM's
    h0, o0 = host_hits(engine), own("kvpool:loaded_tokens_total")
    warm = run(engine, prompt)
    assert warm[0] == cold[0] and max(abs(a - b) for a, b in zip(warm[1], cold[1])) <= 1e-4
    assert warm[3] == {"loads": 1, "loaded_tokens": 256, "failed_tokens": 0, "load_failures": 0, "pool_tokens": 256}
    h1 = host_hits(engine)
    assert h1 - h0 == 256 and own("kvpool:loaded_tokens_total") - o0 == 256  # the connector's own series agree
    o1, f1 = own("kvpool:loaded_tokens_total"), own("kvpool:load_failures_total", cause="missing")
    # now chunk 0's bytes are corrupted: the lookup lists all four, the load fails at once
    pool = scheduler_connector(engine).pool
    keys = pool.addresses("default", pool.keys("default", prompt[: 4 * CHUNK]))
    tier, page = pool.store.locate(keys[0][0])  # chunk 0's first head slice
    pool.store.slab(tier).page(page)[:64] ^= 0xFF
    failed_before = len(worker_connector().worker.failed_history)
    bad = run(engine, prompt)
    assert bad[0] == cold[0] and max(abs(a - b) for a, b in zip(bad[1], cold[1])) <= 1e-4  # recomputed: right
    assert bad[2].get("matched_tokens") == 256 and bad[2].get("load_failures") == 1  # planned, then failed
    assert len(worker_connector().worker.failed_history) > failed_before  # vLLM was told (invalid blocks)
    # kvpool's figures: no load, no loaded token; the 256 tokens are failed (recomputed), not hits
    # `kvpool stats`' pool_tokens count as vLLM counts: the 256 tokens at admission, before the load failed
    assert bad[3] == {"loads": 0, "loaded_tokens": 0, "failed_tokens": 256, "load_failures": 1, "pool_tokens": 256}
    assert host_hits(engine) - h1 == 256
    # the connector's own series: no token loaded, one load failed (the pool returned no chunk: its
    # checksum failed inside the pool, a miss), its 256 tokens recomputed
    assert own("kvpool:loaded_tokens_total") == o1
    assert own("kvpool:load_failures_total", cause="missing") - f1 == 1
    again = run(engine, prompt)  # the recompute saved the chunk again: a good load
    assert again[3]["loads"] == 1 and again[3]["loaded_tokens"] == 256
    assert scheduler_connector(engine).figures()["pool_tokens"] == host_hits(engine)  # vLLM's counter, exactly
