"""Tensor parallel through the pool, as a user runs it: vLLM's OpenAI server at
``--tensor-parallel-size 2`` (vLLM's multiprocess executor, one OpenMP thread per rank) and one at
TP=1, on one node of a kvpool cluster, sharing a tenant.

Each rank stores and loads its own KV heads' slices (kvpool.slices), keyed without the TP size, so:

- KV saved at TP=1 loads at TP=2 and the other way round: every whole chunk loaded (vLLM's
  ``source="host"`` counter), greedy tokens equal to the reader's own cold answer and log-probs
  within 1e-4 of it (the cold answer is the reader's, computed under another tenant, whose
  namespace holds nothing of the writer's);
- a chunk missing one rank's slices (the rank died before its save) is a miss for every rank and
  every TP size: recomputed, the answer right, although the other rank's slices in the pool are
  garbage; once the missing slices are there too, the garbage is loaded and the answer changes
  (the check could fail);
- a model with fewer KV heads than ranks (1 KV head, TP=2: both ranks hold it) stores each
  chunk's head once, and loads it on both ranks.
"""

from __future__ import annotations

import pytest
import torch
from conftest import need_engines

need_engines("vllm", "transformers")

from test_vllm_server_node import CHUNK, POOL_SECRET, Pool, Server  # noqa: E402
from tinymodel import random_prompt, save_tiny_llama  # noqa: E402

from kvpool.auth import Authority  # noqa: E402

PROMPT = 300
WHOLE = PROMPT // CHUNK * CHUNK
MAX_TOKENS = 6
COLD_SECRET = "tp-test-cold-tenant-secret"  # a request with this cache_salt is tenant "cold"


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-tp")
    model = save_tiny_llama(workdir / "model", seed=0)  # 2 KV heads: one a rank at TP=2
    pool = Pool(workdir)
    servers = {}
    try:
        pool.up(dram_pages=400, tenants=("default", "cold"))
        # NOTE: one OpenMP thread a rank, each on a core of its own; the TP=1 server shares core 0
        servers[2] = Server(model, workdir, pool.run_dir, name="tp2", tensor_parallel=2,
                            secrets={"cold": COLD_SECRET}, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        servers[1] = Server(model, workdir, pool.run_dir, name="tp1", secrets={"cold": COLD_SECRET},
                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
        for s in servers.values():
            s.wait_healthy()
        yield servers, pool, model
    finally:
        for s in servers.values():
            s.close()
        pool.close()


def answer(server: Server, prompt: list[int], salt: str | None = None) -> tuple[list[int], list[float], float]:
    """(tokens, their log-probs, tokens loaded from the pool) of a greedy completion, vLLM's own
    prefix cache emptied first (the pool is asked)."""
    server.reset_local_prefix_cache()
    before = server.cached_by_source().get("host", 0.0)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    choice = server.post("/v1/completions", body)["choices"][0]
    host = server.cached_by_source().get("host", 0.0) - before
    return [int(t) for t in choice["token_ids"]], [float(x) for x in choice["logprobs"]["token_logprobs"]], host


def same(a, b) -> bool:
    return a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) <= 1e-4


@pytest.mark.parametrize("writer,reader", [(1, 2), (2, 1)])
def test_kv_saved_at_one_tp_size_loads_at_the_other(tp, writer, reader):
    servers, _, _ = tp
    prompt = random_prompt(PROMPT, seed=10 + writer)
    ref = answer(servers[reader], prompt, salt=COLD_SECRET)  # the reader's own cold answer
    assert ref[2] == 0
    wrote = answer(servers[writer], prompt)
    assert wrote[2] == 0 and wrote[0] == ref[0]  # TP=1 and TP=2 agree on the greedy tokens
    loaded = answer(servers[reader], prompt)
    assert loaded[2] == WHOLE, f"TP={reader} loaded {loaded[2]} of the {WHOLE} tokens TP={writer} saved"
    assert same(loaded, ref), (loaded, ref)


def rank_pool(model: str, tp_size: int, rank: int, run_dir: str):
    """This test's own client of the pool, as rank ``rank`` of a TP engine keys and slices chunks
    (the transformers spec of the checkpoint, which equals vLLM's: tests/engines/test_cross_engine.py)."""
    from transformers import AutoModelForCausalLM

    from kvpool.connectors.hf_model import model_spec
    from kvpool.connectors.pools import open_pool
    from kvpool.slices import Slicing

    spec = model_spec(AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32), model_id=model,
                      chunk_tokens=CHUNK)
    cfg = {"backend": "node", "pool": "default", "run_dir": run_dir, "chunk_tokens": CHUNK,
           "tenants": [{"id": "default", "credential": Authority(POOL_SECRET).issue("default")}]}
    return open_pool(spec, cfg, Slicing.of(spec, tp_size, rank))


def test_a_chunk_missing_a_ranks_slices_is_recomputed_at_every_tp_size(tp):
    servers, pool, model = tp
    credential = Authority(POOL_SECRET).issue("default")
    ranks = [rank_pool(model, 2, r, pool.run_dir) for r in (0, 1)]
    g = torch.Generator().manual_seed(3)

    def garbage(prompt, which):
        keys = ranks[0].keys(credential, prompt[:WHOLE])
        shape = ranks[0].slicing.rank_spec(ranks[0].spec).chunk_shape
        for r in which:
            assert ranks[r].save(credential, keys, [torch.randn(shape, generator=g) * 3 for _ in keys]) == len(keys)
        return keys

    # NOTE: one prompt a reader: a reader that recomputes saves its slices, which would complete the
    # chunk around the garbage (in a real pool rank 0's slices would be right, so that is correct).
    for n, seed in ((2, 30), (1, 31)):
        prompt = random_prompt(PROMPT, seed=seed)
        ref = answer(servers[n], prompt, salt=COLD_SECRET)
        keys = garbage(prompt, [0])  # rank 0's slices: there, and wrong; rank 1 "died" before saving
        assert ranks[0].lookup(credential, keys) == ranks[1].lookup(credential, keys) == 0  # no chunk is whole
        got = answer(servers[n], prompt)
        assert got[2] == 0 and same(got, ref), f"TP={n}: {got} != {ref}"
    # The check could fail: with both ranks' slices stored, the engines load the garbage.
    prompt = random_prompt(PROMPT, seed=32)
    refs = {n: answer(s, prompt, salt=COLD_SECRET) for n, s in servers.items()}
    keys = garbage(prompt, [0, 1])
    assert ranks[0].lookup(credential, keys) == WHOLE
    for n, s in servers.items():
        got = answer(s, prompt)
        assert got[2] == WHOLE and not same(got, refs[n]), f"TP={n} loaded garbage KV and answered the same"


def test_a_model_with_fewer_kv_heads_than_ranks_stores_each_head_once(tmp_path_factory, tp):
    """1 KV head at TP=2: both ranks hold it, the first writes it; both load it."""
    servers, pool, _ = tp
    workdir = tmp_path_factory.mktemp("vllm-tp-mqa")
    model = save_tiny_llama(workdir / "model", seed=1, num_key_value_heads=1)
    servers[1].close()  # room for another engine on 2 cores
    mqa = Server(model, workdir, pool.run_dir, name="tp2-mqa", tensor_parallel=2, secrets={"cold": COLD_SECRET},
                 extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        mqa.wait_healthy()
        client = rank_pool(model, 2, 0, pool.run_dir)
        before = client.stats()["chunks"]  # slices the node's shard holds
        prompt = random_prompt(PROMPT, seed=40)
        ref = answer(mqa, prompt, salt=COLD_SECRET)
        assert client.stats()["chunks"] - before == WHOLE // CHUNK  # the cold tenant's: one slice a chunk, not two
        wrote = answer(mqa, prompt)
        assert wrote[2] == 0 and same(wrote, ref)
        loaded = answer(mqa, prompt)
        assert loaded[2] == WHOLE and same(loaded, ref)
    finally:
        mqa.close()


def test_a_hybrid_model_at_tp2_loads_every_group_on_both_ranks(tmp_path_factory, tp):
    """Gemma 2 (a sliding and a full group, vLLM's hybrid allocator on) at TP=2: its loads are
    asynchronous, and vLLM waits for both ranks to report each one; the pool hit is the cold answer."""
    from test_vllm_sliding import save_model

    servers, pool, _ = tp
    workdir = tmp_path_factory.mktemp("vllm-tp-hybrid")
    model = save_model(workdir / "gemma2", "gemma2")
    servers[1].close()  # room for another engine on 2 cores
    hybrid = Server(model, workdir, pool.run_dir, name="tp2-gemma2", tensor_parallel=2,
                    secrets={"cold": COLD_SECRET}, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        hybrid.wait_healthy()
        prompt = random_prompt(PROMPT, seed=50)
        ref = answer(hybrid, prompt, salt=COLD_SECRET)
        wrote = answer(hybrid, prompt)
        assert wrote[2] == 0 and same(wrote, ref)
        loaded = answer(hybrid, prompt)
        assert loaded[2] == WHOLE and same(loaded, ref), (loaded, ref)
        assert "kv cache group sizes (32, 32)" in hybrid.log_path.read_text()
    finally:
        hybrid.close()
