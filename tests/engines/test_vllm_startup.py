"""A vLLM engine whose kvpool does not answer does not start silently.

``backend: "node"`` with a ``run_dir`` where no shard runs: without ``degraded`` the engine fails
to start with a message that names the run_dir and the fix; with ``"degraded": true`` it starts,
answers (recomputing), and its connector says DEGRADED (its stats, its `kvpool stats` figures and
vLLM's connector stats).
"""

from __future__ import annotations

import pytest
from conftest import need_engines

need_engines("vllm")

from tinymodel import random_prompt, save_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine  # noqa: E402

CHUNK = 64


def node_pool(run_dir, **extra) -> dict:
    return {"backend": "node", "pool": "startup", "run_dir": str(run_dir), "chunk_tokens": CHUNK, "timeout_s": 0.5,
            **extra}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def chain(e: BaseException) -> str:
    parts = []
    while e is not None and len(parts) < 10:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def test_an_unreachable_pool_fails_start_up_with_the_fix(model_dir, tmp_path):
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    with pytest.raises(Exception) as e:
        make_engine(model_dir, node_pool(tmp_path, start_timeout_s=0), enable_prefix_caching=False,
                    max_model_len=512)
    text = chain(e.value)
    assert "did not answer at start" in text, text[-3000:]
    assert str(tmp_path) in text and "kvpool up" in text and '"degraded": true' in text
    assert not has_kv_transfer_group()  # nothing left behind: the next engine can start


def test_degraded_starts_answers_and_says_so(model_dir, tmp_path):
    llm = make_engine(model_dir, node_pool(tmp_path, degraded=True), enable_prefix_caching=False,
                      max_model_len=512)
    try:
        conn = scheduler_connector(llm)
        prompt = random_prompt(300, seed=5)
        sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
        outs = [llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0] for _ in range(2)]
        a, b = (o.outputs[0] for o in outs)
        assert len(a.token_ids) == 6 and a.token_ids == b.token_ids  # it answers, the same both times
        assert all(int(o.num_cached_tokens or 0) == 0 for o in outs)  # recomputed: nothing from any cache
        st = conn.stats()
        assert st["health"]["degraded"] is True and st.get("degraded_requests") == 2
        assert st.get("matched_tokens", 0) == 0 and st.get("loads_planned", 0) == 0
        fig = conn.figures()
        assert fig["degraded"] is True and fig["loads"] == 0  # what `kvpool stats` would show
        assert conn.get_kv_connector_stats().reduce()["degraded"] == 1  # vLLM's connector stats
    finally:
        shutdown_engine(llm)
