"""Small random-weight models of the families engines serve, built in the test (no download).

Each family is its transformers config class with the fields that make it that family: sliding
windows shorter than the test prompts (Mistral, Gemma 2 and 3, Phi-3's real 2047), mixed layers
(Gemma 2/3 alternate sliding and full; Llama 4 mixes chunked and full), latent attention
(DeepSeek-V3: K and V of different widths), biases and GQA (Qwen2), head dims that are not a
power of two (Qwen3), partial rotary (Phi, GPT-NeoX) and learned positions (GPT-2).

NOTE: initializer_range 0.2 (ten times the default) makes the logits depend strongly on the KV,
so a wrong KV byte visibly moves them (see the negative controls).
"""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 40  # the small families' sliding window: shorter than the longer test prompts
CHUNK = 32  # pool chunk tokens for the small families (Phi-3 runs with the default, 256)

# family: (config class name, fields over COMMON, prompt lengths)
# Lengths: C - 5, 3C - 1, 3C, 3C + 1, and for a window W: W + 10 (the prompt that loaded wrong
# positions before: n >= W while its whole chunks end before W - 1) and 2W + 3.
AROUND_CHUNK = (CHUNK - 5, 3 * CHUNK - 1, 3 * CHUNK, 3 * CHUNK + 1)
AROUND_WINDOW = (WINDOW + 10, 2 * WINDOW + 3)
FAMILIES = {
    "llama": ("LlamaConfig", {}, AROUND_CHUNK),
    "qwen2": ("Qwen2Config", dict(hidden_size=384, num_key_value_heads=1), AROUND_CHUNK),
    "qwen3": ("Qwen3Config", dict(head_dim=80), AROUND_CHUNK),
    "gpt-neox": ("GPTNeoXConfig", {}, AROUND_CHUNK),
    "phi": ("PhiConfig", {}, AROUND_CHUNK),
    "gpt2": ("GPT2Config", dict(n_embd=128, n_layer=3, n_head=4, n_positions=4096), AROUND_CHUNK),
    "mistral-long-window": ("MistralConfig", dict(sliding_window=4096), AROUND_CHUNK),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), AROUND_WINDOW + AROUND_CHUNK),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, head_dim=32), AROUND_WINDOW + AROUND_CHUNK),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, head_dim=32, sliding_window_pattern=2),
               AROUND_WINDOW + AROUND_CHUNK),
    "llama4-chunked": ("Llama4TextConfig", dict(attention_chunk_size=WINDOW, head_dim=32, num_hidden_layers=4,
                                                intermediate_size_mlp=256, num_local_experts=2,
                                                interleave_moe_layer_step=2), AROUND_WINDOW + AROUND_CHUNK),
    "deepseek-v3-mla": ("DeepseekV3Config", dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                                 qk_nope_head_dim=48, v_head_dim=16, num_key_value_heads=4,
                                                 n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                                 moe_intermediate_size=64, n_group=1, topk_group=1), AROUND_CHUNK),
    # Phi-3-mini-4k's real window and the connector's default chunk size (256): 2047 tokens save
    # 7 chunks whose positions the window has partly dropped.
    "phi3-2047": ("Phi3Config", dict(sliding_window=2047), (2047, 2046, 2048)),
}
_GPT2_DROP = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings")


def config(family: str, **overrides):
    import transformers

    cls_name, fields, _ = FAMILIES[family]
    kw = {**COMMON, **fields, **overrides}
    if family == "gpt2":
        kw = {k: v for k, v in kw.items() if k not in _GPT2_DROP}
    return getattr(transformers, cls_name)(**kw)


def build(family: str, seed: int = 0, **overrides):
    """A random-weight fp32 model of ``family`` in eval mode, deterministic by seed."""
    from transformers import AutoModelForCausalLM

    cfg = config(family, **overrides)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg).float().eval()
    finally:
        torch.random.set_rng_state(state)


def chunk_tokens(family: str) -> int:
    return 256 if family == "phi3-2047" else CHUNK


def prompt(n: int, seed: int = 0, vocab: int = COMMON["vocab_size"]) -> torch.Tensor:
    """``[1, n]`` token ids in ``[3, vocab)``, deterministic by seed."""
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """The model on its own, as transformers runs it (its own cache, windows and all): the
    next-token logits after one forward of the whole prompt, and ``new_tokens`` greedy tokens."""
    from transformers import DynamicCache

    from kvpool.connectors.hf_model import cache_argument

    arg = cache_argument(model)
    cache = DynamicCache(config=model.config)  # transformers' own: sliding layers keep only their window
    logits = model(input_ids=ids, use_cache=True, **{arg: cache}).logits[0, -1]
    tokens, nxt = [], int(logits.argmax())
    for _ in range(new_tokens):
        tokens.append(nxt)
        if len(tokens) == new_tokens:
            break
        nxt = int(model(input_ids=torch.tensor([[nxt]]), use_cache=True, **{arg: cache}).logits[0, -1].argmax())
    return logits, tokens
