"""A request's prompt as the engine will see it: its token ids, from the OpenAI request body.

- ``/v1/completions``: ``prompt`` as token ids is taken as is; as text, it is encoded with the
  served model's tokenizer (``add_special_tokens``, default true, as vLLM does). A batch of
  prompts is routed by its first.
- ``/v1/chat/completions``: the tokenizer's chat template renders ``messages`` (with
  ``add_generation_prompt``, ``continue_final_message``, ``tools`` and ``chat_template_kwargs`` as
  vLLM takes them), as vLLM renders it.

None when the router cannot know the tokens (no tokenizer, an image or audio part, a template that
fails): the request is routed on load alone, never refused. A tokenizer that differs from the
engine's only costs locality: the engines key what they load themselves.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("kvpool.route")


def _ids(x: object) -> list[int] | None:
    return x if isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x) else None


class Prompts:
    """``tokenizer``: a local folder with the served model's tokenizer (None: token-id prompts only)."""

    def __init__(self, tokenizer: str | None) -> None:
        self.path = tokenizer
        self._tok: Any = None
        self._failed = tokenizer is None
        self._lock = threading.Lock()  # NOTE: one tokenizer, called from the router's planning threads

    def _tokenizer(self):
        if self._tok is None and not self._failed:
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.path)
            except Exception as e:  # noqa: BLE001 - a model without a tokenizer: text prompts are not scored
                self._failed = True
                log.warning("kvpool route: no tokenizer in %s (%s): text prompts are routed on load alone; pass "
                            "--tokenizer with the served model's", self.path, e)
        return self._tok

    def tokens(self, path: str, body: dict) -> list[int] | None:
        try:
            with self._lock:
                return self._tokens(path, body)
        except Exception as e:  # noqa: BLE001 - whatever the body holds, the engine judges it; we route on load
            log.debug("kvpool route: cannot read the prompt's tokens (%s)", e)
            return None

    def _tokens(self, path: str, body: dict) -> list[int] | None:
        if path.endswith("/chat/completions"):
            return self._chat(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, str):
            tok = self._tokenizer()
            return None if tok is None else list(tok.encode(prompt, add_special_tokens=bool(
                body.get("add_special_tokens", True))))
        return _ids(prompt)

    def _chat(self, body: dict) -> list[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return None  # images, audio: the engine keys them by their content
        tok = self._tokenizer()
        if tok is None:
            return None
        out = tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)), tools=body.get("tools"),
            **(body.get("chat_template_kwargs") or {}))
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return _ids(list(out))
