"""A real vLLM engine reading a node's chunks in place (kvpool/node/inplace.py): when a chunk turns
out, on its release after the scatter, not to have held still, the worker reports its blocks and
vLLM recomputes them; the answer is the cold one, never one computed over the bytes scattered.

The pool runs outside this process (a Ray head and `kvpool up`, as an operator starts them:
:class:`kvpool.connectors.bench.node_pool_proc.NodePool`); vLLM's engine runs in this process, so the
test reaches the worker's in-place read through ``kvpool.node.inplace.before_verify``, the hook
between a view's use and its verification. There it does what a page rewritten during the scatter
leaves behind: garbage in vLLM's blocks, and a chunk that no longer verifies.
"""

from __future__ import annotations

import pytest
from conftest import need_engines

need_engines("vllm")

import torch  # noqa: E402
from tinymodel import random_prompt, save_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from kvpool.connectors.bench.node_pool_proc import CHUNK_TOKENS, NodePool  # noqa: E402
from kvpool.connectors.bench.vllm_engine import make_engine, scheduler_connector, shutdown_engine, worker_connector  # noqa: E402
from kvpool.node import inplace  # noqa: E402

PROMPT = random_prompt(4 * CHUNK_TOKENS + 44, seed=31)  # 4 whole chunks and a tail


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)
    pool = NodePool(1 << 20, 32, progress=False)  # a 256-token chunk of the tiny Llama: 512 KiB
    try:
        pool.start()
        engine = make_engine(model, pool.connector_config(), enable_prefix_caching=False, max_model_len=2048)
        try:
            yield engine
        finally:
            shutdown_engine(engine)
    finally:
        inplace.before_verify = None
        pool.close()


def run(llm):
    conn = scheduler_connector(llm)
    worker = worker_connector().worker
    before, failed_before = dict(conn.counters), len(worker.failed_history)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    gained = {k: v - before.get(k, 0) for k, v in conn.counters.items()}
    lps = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]
    return list(out.token_ids), lps, gained, len(worker.failed_history) - failed_before


def same(a, b) -> bool:
    return a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) <= 1e-4


def garbage_then(fail: bool):
    """A hook for the first view released: vLLM's blocks turn to garbage (what a page rewritten
    under the scatter leaves there); with ``fail`` the chunk also stops verifying, as it then would."""
    calls = []

    def hook(view):
        calls.append(view)
        if len(calls) == 1:
            for cache in worker_connector().worker.groups[0].copier.caches:
                cache.normal_(0.0, 50.0, generator=torch.Generator().manual_seed(7))
            if fail:
                view._entry = view._entry._replace(checksum=view._entry.checksum ^ 1)

    return hook, calls


def test_a_chunk_that_changed_during_the_in_place_read_is_recomputed(llm):
    cold = run(llm)
    assert cold[2].get("saved_chunks") == 4
    warm = run(llm)
    assert warm[2].get("loaded_tokens") == 4 * CHUNK_TOKENS and not warm[3] and same(cold, warm)
    # in place indeed: the node's chunks were views of its slab, verified on release
    assert worker_connector().worker.pool.client.counts["get_inplace"] > 0

    # The control: garbage in the blocks while every chunk still verifies changes the answer (so the
    # check below could fail: the garbage is read, and only a reported failure makes vLLM recompute).
    inplace.before_verify, calls = garbage_then(fail=False)
    try:
        poisoned = run(llm)
    finally:
        inplace.before_verify = None
    assert calls and poisoned[2].get("loaded_tokens") == 4 * CHUNK_TOKENS
    assert not same(cold, poisoned), "garbage in vLLM's blocks did not change the answer: the test could not fail"

    inplace.before_verify, calls = garbage_then(fail=True)
    try:
        changed = run(llm)
    finally:
        inplace.before_verify = None
    assert calls
    g = changed[2]
    # the first chunk did not verify: the whole load failed, its blocks went back to vLLM
    assert g.get("load_failures") == 1 and g.get("failed_tokens") == 4 * CHUNK_TOKENS and not g.get("loaded_tokens")
    assert changed[3] == 4 * CHUNK_TOKENS // 32  # every block of the load (32-token blocks)
    assert same(cold, changed)  # vLLM recomputed them: the cold answer, not the garbage's

    again = run(llm)
    assert again[2].get("loaded_tokens") == 4 * CHUNK_TOKENS and same(cold, again)
