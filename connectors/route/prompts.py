"""A request's prompt as the engine will see it: its token ids, from the OpenAI request body.

- ``/v1/completions``: ``prompt`` as token ids is taken as is (:func:`token_ids`, no tokenizer);
  as text, it is encoded with the served model's tokenizer (``add_special_tokens``, default true,
  as vLLM does). A batch of prompts is routed by its first.
- ``/v1/chat/completions``: the tokenizer's chat template renders ``messages`` (with
  ``add_generation_prompt``, ``continue_final_message``, ``tools`` and ``chat_template_kwargs``
  as vLLM takes them), as vLLM renders it.

The template is the server's, never the request's: :func:`refused` turns down (400) what vLLM
itself refuses, a ``chat_template`` or ``tokenize`` in ``chat_template_kwargs``; a request giving
its own top-level ``chat_template`` is not rendered here (vLLM takes it only with
``--trust-request-chat-template``) and is routed on load. Of ``chat_template_kwargs`` only the
variables the template reads are passed (as vLLM filters them), so no key of a request reaches
the tokenizer's own arguments. Rendering and tokenizing run in worker processes with a deadline
(:mod:`.render`): :class:`Prompts` is what a worker runs.

None when the router cannot know the tokens (no tokenizer, an image or audio part, a template that
fails): the request is routed on load alone. A tokenizer that differs from the engine's only
costs locality: the engines key what they load themselves.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.route")

UNTRUSTED = ("chat_template", "tokenize")  # chat_template_kwargs vLLM refuses (400)
# apply_chat_template's own arguments (and the messages): never taken from chat_template_kwargs
RESERVED = frozenset({*UNTRUSTED, "conversation", "messages", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "return_dict", "return_tensors", "padding", "truncation",
                      "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens"})


def _ids(x: object) -> list[int] | None:
    return x if isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x) else None


def _first(prompt: object) -> object:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        return prompt[0]  # a batch: its first prompt
    return prompt


def token_ids(path: str, body: dict) -> list[int] | None:
    """A completion's prompt given as token ids (no tokenizer needed), else None."""
    return None if path.endswith("/chat/completions") else _ids(_first(body.get("prompt")))


def needs_tokenizer(path: str, body: dict) -> bool:
    """Whether a tokenizer could give this request's tokens (a text prompt, or chat messages of
    text only under the server's template)."""
    if not path.endswith("/chat/completions"):
        return isinstance(_first(body.get("prompt")), str)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or body.get("chat_template") is not None:
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            return False  # images, audio: the engine keys them by their content
    return True


def refused(path: str, body: dict) -> str | None:
    """Why vLLM would refuse this chat request's template arguments (a 400 naming the fix), or None."""
    if not path.endswith("/chat/completions"):
        return None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        return "chat_template_kwargs: a JSON object of the chat template's variables"
    bad = sorted(k for k in UNTRUSTED if k in kwargs)
    if bad:
        return (f"chat_template_kwargs may not set {', '.join(bad)} (vLLM refuses it too): pass only the variables "
                "the server's template reads; a template of the request's own goes in the top-level chat_template, "
                "which vLLM takes when started with --trust-request-chat-template")
    return None


class Prompts:
    """``tokenizer``: a local folder with the served model's tokenizer (None: token-id prompts only)."""

    def __init__(self, tokenizer: str | None) -> None:
        self.path = tokenizer
        self._tok: Any = None
        self._failed = tokenizer is None
        self._vars: dict[str, frozenset[str]] = {}  # a template -> the variables it reads

    def load(self) -> bool:
        """Loads the tokenizer now; whether there is one."""
        return self._tokenizer() is not None

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
        """The tokens, None when they cannot be known; BadRequest for a request vLLM refuses."""
        why = refused(path, body)
        if why:
            raise BadRequest(why)
        ids = token_ids(path, body)
        if ids is not None or not needs_tokenizer(path, body):
            return ids
        tok = self._tokenizer()
        if tok is None:
            return None
        try:
            return self._chat(tok, body) if path.endswith("/chat/completions") else list(tok.encode(
                _first(body.get("prompt")), add_special_tokens=bool(body.get("add_special_tokens", True))))
        except Exception as e:  # noqa: BLE001 - whatever the body holds, the engine judges it; we route on load
            log.debug("kvpool route: cannot read the prompt's tokens (%s)", e)
            return None

    def tokens_of(self, path: str, raw: bytes) -> tuple[str, object]:
        """A worker's answer for one request body: ("ok", tokens or None) or ("bad", why)."""
        try:
            return "ok", self.tokens(path, json.loads(raw))
        except BadRequest as e:
            return "bad", e.message
        except Exception as e:  # noqa: BLE001 - routed on load
            log.debug("kvpool route: cannot read the prompt's tokens (%s)", e)
            return "ok", None

    def _declared(self, tok, tools) -> frozenset[str]:
        """The variables the template used for this request reads (vLLM passes no other)."""
        template = tok.get_chat_template(None, tools)
        if template not in self._vars:
            import jinja2
            import jinja2.meta

            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                env = _compile_jinja_template(template).environment  # its own extensions parse it
            except Exception:  # noqa: BLE001 - another transformers: a plain environment
                env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
            try:
                self._vars[template] = frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
            except jinja2.TemplateError:
                self._vars[template] = frozenset()
        return self._vars[template]

    def _chat(self, tok, body: dict) -> list[int] | None:
        tools = body.get("tools")
        declared = self._declared(tok, tools)
        kwargs = {k: v for k, v in (body.get("chat_template_kwargs") or {}).items()
                  if k in declared and k not in RESERVED}
        out = tok.apply_chat_template(
            body["messages"], tokenize=True, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)), tools=tools, **kwargs)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return _ids(list(out))
