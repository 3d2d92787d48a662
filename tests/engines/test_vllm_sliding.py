"""Sliding-window models through vLLM's own OpenAI server on a kvpool node pool, across a restart.

- Mistral with a window (96 tokens) below the context (300): every layer slides, so vLLM pages the
  model as one sliding-window group and frees each request's blocks as they leave the window. The
  connector saves each chunk in the step that completes it and, on a hit, loads only the window's
  tail (the first chunks' blocks vLLM no longer holds; their KV is never attended to again).
- Gemma 2 (sliding and full layers alternating, same window): vLLM's hybrid allocator (on: the
  connector declares SupportsHMA) pages it as a full-attention group and a sliding-window group,
  each layer in its group's blocks; the load is asynchronous and fills the full layer's blocks
  whole and the sliding layer's with the window's tail.

For each, a server answers a prompt cold (saving its chunks), is stopped, and a new server on the
same pool answers it again from the pool: every whole chunk is a pool hit (vLLM's
``source="host"`` counter), with the cold answer's tokens and log-probs.
"""

from __future__ import annotations

import pytest
from conftest import need_engines

need_engines("vllm", "transformers")

from test_vllm_server_node import CHUNK, Pool, Server  # noqa: E402
from test_vllm_tp import answer  # noqa: E402
from tinymodel import random_prompt  # noqa: E402

PROMPT = 300
WHOLE = PROMPT // CHUNK * CHUNK
WINDOW = 96  # below the prompt, and no shorter than a chunk (a shorter one is refused at start)
COMMON = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, sliding_window=WINDOW)
MODELS = {
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(tie_word_embeddings=True, query_pre_attn_scalar=64)),  # vLLM's Gemma ties them
}
def save_model(path, family: str, seed: int = 0) -> str:
    import torch
    import transformers

    cls, fields = MODELS[family]
    cfg = getattr(transformers, cls)(**COMMON, **fields)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """Each model's cold answer, its answer from a restarted server, and a control prompt's; the
    two models' servers run side by side, each on a core of its own."""
    workdir = tmp_path_factory.mktemp("vllm-sliding")
    pool = Pool(workdir)
    models = {f: save_model(workdir / f, f) for f in sorted(MODELS)}
    prompts = {f: random_prompt(PROMPT, seed=40 + i) for i, f in enumerate(models)}
    out: dict[str, dict] = {f: {} for f in models}
    servers: list[Server] = []

    def run(stage: str, ask) -> None:
        started = [Server(m, workdir, pool.run_dir, name=f"{f}-{stage}", extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(i)})
                   for i, (f, m) in enumerate(models.items())]
        servers.extend(started)
        for server in started:
            server.wait_healthy()
        for f, server in zip(models, started):
            ask(f, server)
            server.close()

    try:
        pool.up(dram_pages=200)
        run("1", lambda f, srv: out[f].update(cold=answer(srv, prompts[f])))
        run("2", lambda f, srv: out[f].update(loaded=answer(srv, prompts[f]),
                                              other=answer(srv, random_prompt(PROMPT, seed=99)),
                                              log=srv.log_path.read_text()))
        yield out
    finally:
        for server in servers:
            server.close()
        pool.close()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_restarted_server_loads_a_sliding_window_models_chunks_with_the_cold_answer(answers, family):
    got = answers[family]
    assert got["cold"][2] == 0  # nothing in the pool yet: computed, and saved
    loaded = got["loaded"]
    assert loaded[2] == WHOLE, f"the restarted server loaded {loaded[2]} of the {WHOLE} tokens saved"
    assert loaded[0] == got["cold"][0] and loaded[1] == got["cold"][1], (loaded, got["cold"])  # bit for bit
    assert got["other"][2] == 0 and got["other"][0] != got["cold"][0]  # a control: another prompt, another answer
    assert "Turning off hybrid kv cache manager" not in got["log"]  # the connector declares SupportsHMA
    if family == "gemma2":  # vLLM's hybrid allocator made a group of each kind (it logs only several groups)
        assert "kv cache group sizes (32, 32)" in got["log"]
