"""Prefill/decode disaggregation through the pool, as a user runs it: two vLLM OpenAI servers on
one node of a kvpool cluster, a prefill instance (``kv_role: kv_producer``: saves, never loads)
and a decode instance (``kv_consumer``: loads, never saves), and the documented two-step recipe a
router follows: the request to the prefill instance with ``max_tokens=1``, then the same request
to the decode instance.

Per prompt (4,000 tokens): the decode instance answers it cold first (a single instance's cold
run: the reference, and since a consumer never saves, the pool still holds nothing of it), its own
prefix cache is reset, then the recipe runs. The decode instance's answer equals the cold one,
token for token and in log-probs, having loaded every whole chunk from the pool (vLLM's
``source="host"`` counter); the prefill instance never loads. Figures: the median TTFT of each,
printed.
"""

from __future__ import annotations

import statistics

import pytest
from conftest import need_engines

need_engines("vllm")

from test_vllm_server_node import CHUNK, Pool, Server  # noqa: E402
from tinymodel import random_prompt, save_tiny_llama  # noqa: E402

PROMPT = 4000
WHOLE = PROMPT // CHUNK * CHUNK
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-pd")
    model = save_tiny_llama(workdir / "model", seed=0)
    pool = Pool(workdir)
    servers = []
    try:
        pool.up(dram_pages=400)
        # NOTE: each instance on a core of its own, as on hardware of its own: on 2 shared cores the
        # prefill instance's OpenMP threads, still spinning after its answer, slowed the decode's by 2-4x
        for role, name, core in (("kv_producer", "prefill", "0"), ("kv_consumer", "decode", "1")):
            servers.append(Server(model, workdir, pool.run_dir, kv_role=role, name=name, max_model_len=4096,
                                  extra_env={"VLLM_CPU_OMP_THREADS_BIND": core}))
        for s in servers:
            s.wait_healthy()
        yield servers
    finally:
        for s in servers:
            s.close()
        pool.close()


def answer(server: Server, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[float], float]:
    """(tokens, their log-probs, the tokens loaded from the pool) of a greedy completion."""
    before = server.cached_by_source().get("host", 0.0)
    out = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0.0, "logprobs": 1, "return_token_ids": True,
                                          "return_tokens_as_token_ids": True,  # the server has no tokenizer
                                          "ignore_eos": True})
    choice = out["choices"][0]
    return ([int(t) for t in choice["token_ids"]], [float(x) for x in choice["logprobs"]["token_logprobs"]],
            server.cached_by_source().get("host", 0.0) - before)


def ttft(server: Server, prompt: list[int], what: str) -> tuple[list[int], float, float]:
    """(the first token, seconds to it, tokens loaded) of one request: ``max_tokens=1``."""
    tokens, took, host = server.complete(prompt, what, max_tokens=1)
    return tokens, took, host


def test_the_decode_instance_answers_from_the_prefill_instances_kv(pd):
    prefill, decode = pd
    cold_s, pd_s = [], []
    for seed in range(5):
        prompt = random_prompt(PROMPT, seed=100 + seed)
        ref_tokens, ref_lp, host = answer(decode, prompt)  # a single instance, cold: the pool holds nothing
        assert host == 0
        decode.reset_local_prefix_cache()
        _, cold, host = ttft(decode, prompt, "decode cold")  # TTFT of a single instance's cold prefill
        assert host == 0  # the decode instance never saves: still nothing in the pool
        cold_s.append(cold)
        decode.reset_local_prefix_cache()
        first, _, host = ttft(prefill, prompt, "prefill")  # step 1 of the recipe: computes and saves
        assert host == 0 and first == ref_tokens[:1]  # the producer never loads
        _, warm, host = ttft(decode, prompt, "decode after prefill")  # step 2: loads the whole chunks
        assert host == WHOLE
        pd_s.append(warm)
        decode.reset_local_prefix_cache()
        tokens, lp, host = answer(decode, prompt)
        assert host == WHOLE and tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lp, ref_lp)) <= 1e-4, (lp, ref_lp)
    # NOTE: the figures are printed, not asserted: on a shared 2-core machine a timing bound fails by load
    print(f"\nP/D TTFT at {PROMPT} tokens, median of 5: single instance cold {statistics.median(cold_s):.3f} s, "
          f"decode instance after the prefill instance {statistics.median(pd_s):.3f} s "
          f"({statistics.median(cold_s) / statistics.median(pd_s):.1f}x); each: cold "
          f"{[round(t, 3) for t in cold_s]}, after prefill {[round(t, 3) for t in pd_s]}")


def test_the_prefill_instance_never_loads_what_the_pool_holds(pd):
    prefill, _ = pd
    prompt = random_prompt(PROMPT, seed=200)
    assert answer(prefill, prompt, 1)[2] == 0
    prefill.reset_local_prefix_cache()
    assert answer(prefill, prompt, 1)[2] == 0  # saved by its first run, yet computed again: it only produces
