"""A tiny random-weight Llama saved to a directory, for engine tests (no download, no tokenizer).

``save_tiny_llama(path, seed=0)`` writes ``config.json`` + ``model.safetensors`` of a
``LlamaForCausalLM`` whose weights depend only on ``seed`` and returns the directory. vLLM, SGLang
and transformers all load it; engines run it with ``skip_tokenizer_init`` and prompt token ids.

NOTE: ``initializer_range`` defaults to 0.2, ten times transformers' default: with 0.02 the
logits barely depend on the context (a perturbed key moved them by ~1e-3), so a test that
compares outputs after a KV reload could pass even when the reloaded KV were wrong. With 0.2 a
wrong KV block visibly changes the log-probs. Head size 64 is one that vLLM's CPU attention
supports.
"""

from __future__ import annotations

import json
import os
from typing import Any

DEFAULTS: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def save_tiny_llama(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Saves a random ``LlamaForCausalLM`` (float32) to ``path`` and returns ``str(path)``.

    Deterministic: the same ``seed`` and ``overrides`` give the same bytes. ``overrides`` are
    ``LlamaConfig`` fields (``num_hidden_layers=8``, ``hidden_size=512``, ...). A directory that
    already holds the same model (same seed and config) is reused as is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.fspath(path)
    fields = {**DEFAULTS, **overrides}
    stamp = json.dumps({"seed": seed, **fields}, sort_keys=True)
    stamp_file = os.path.join(path, "kvpool_tiny.json")
    if os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
        return path
    os.makedirs(path, exist_ok=True)
    cfg = LlamaConfig(**fields, torch_dtype="float32")
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    finally:
        torch.random.set_rng_state(gen_state)
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp_file, "w") as f:
        f.write(stamp)
    return path


def random_prompt(n: int, seed: int = 0, vocab_size: int = DEFAULTS["vocab_size"]) -> list[int]:
    """``n`` token ids drawn from ``[3, vocab_size)`` (clear of bos/eos), deterministic by seed."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab_size, n)]
