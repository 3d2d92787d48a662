"""The real-model demo's workload: three tenants, each with its own system prompt and one
document, and the questions their users ask about it in multi-turn chats (RAG style: the
document rides in a conversation's first message, the follow-ups refer back to it).

The documents are real English text shipped with Python itself, never text a model wrote: the
reference manual's "Exceptions" section (``pydoc_data.topics``), François Pinard's essay on heaps
(``heapq.__about__``) and the Zen of Python (the ``this`` module). The system prompts and
questions are ours.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import io
from dataclasses import dataclass

from kvpool.errors import BadRequest


@dataclass(frozen=True)
class Document:
    title: str
    source: str  # where it ships: a module and attribute a reader can open
    text: str


@dataclass(frozen=True)
class TenantWork:
    tenant: str
    system: str
    document: Document
    questions: tuple[str, ...]


def _exceptions() -> Document:
    from pydoc_data.topics import topics

    text = topics["exceptions"].split("-[ Footnotes ]-")[0].strip()
    return Document("Exceptions (the Python reference manual)", "pydoc_data.topics.topics['exceptions']", text)


def _heaps(max_chars: int = 2800) -> Document:
    import heapq

    # NOTE: the essay's first half (about 600 tokens): it holds every answer asked for, and each
    # token of a prompt costs about 4 ms of prefill on 2 cores, twice per request (pool and no pool)
    paragraphs, size = [], 0
    for p in heapq.__about__.strip().split("\n\n"):
        if size + len(p) > max_chars and paragraphs:
            break
        paragraphs.append(p)
        size += len(p) + 2
    return Document("Heap queues, by François Pinard", "heapq.__about__", "\n\n".join(paragraphs))


def _zen() -> Document:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        this = importlib.import_module("this")
    return Document("The Zen of Python, by Tim Peters", "this.s (rot13)", codecs.decode(this.s, "rot13").strip())


def tenants() -> list[TenantWork]:
    """The demo's tenants, in order; six questions each (conversations x turns take them in turn)."""
    return [
        TenantWork(
            "helpdesk",
            "You are the help desk of an online Python course. Students paste a page of the Python reference "
            "manual and ask about it. Answer in one or two short sentences, in plain words, using only what "
            "the page says. If the page does not say, answer that you do not know.",
            _exceptions(),
            ("What is an exception in Python, in one sentence?",
             "What happens when an exception is not handled at all?",
             "What is the finally clause used for?",
             "Can my code rely on the exact text of exception messages?",
             "Which statement do I use to raise an exception myself?",
             "What does the termination model of error handling mean?"),
        ),
        TenantWork(
            "tutor",
            "You are a patient tutor for a course on algorithms and data structures. The student shares a text "
            "from the course reader; explain its ideas simply and briefly, in at most two sentences, and stay "
            "faithful to the text.",
            _heaps(),
            ("Who wrote this explanation of heaps?",
             "Why is a heap like a sports tournament?",
             "Where is the smallest element of a heap?",
             "Why is a heap a good structure for a scheduler?",
             "How do you get a sorted list out of a heap?",
             "What did the author use a heap for?"),
        ),
        TenantWork(
            "reviewer",
            "You are a friendly code reviewer on a Python team. The team's style guide is the Zen of Python, "
            "which the developer quotes to you. Answer their question about it in one or two sentences.",
            _zen(),
            ("Who wrote the Zen of Python?",
             "What does the Zen of Python say about errors?",
             "Is flat code better than nested code?",
             "What should I do in the face of ambiguity?",
             "What does it say about namespaces?",
             "Sum up its advice about readability in one sentence."),
        ),
    ]


@dataclass(frozen=True)
class Conversation:
    work: TenantWork
    number: int  # 1, 2, ... within its tenant
    questions: tuple[str, ...]  # one per turn


def plan(count: int, per_tenant: int, turns: int) -> list[Conversation]:
    """``per_tenant`` conversations of ``turns`` questions for each of the first ``count`` tenants,
    in serving order within a turn: tenants interleave, so a tenant's second conversation comes
    after its first has stored the shared prefix. Conversation ``c`` asks questions ``c*turns``
    onwards (wrapping around: a later user may ask what an earlier one did)."""
    work = tenants()
    if not 1 <= count <= len(work):
        raise BadRequest(f"--tenants {count}: the real-model demo has {len(work)} tenants (give 1-{len(work)}), "
                         "or run the random-weight model with --model tiny for more")
    if turns < 1 or per_tenant < 1:
        raise BadRequest("--turns and --conversations must be at least 1")
    out = []
    for c in range(per_tenant):
        for w in work[:count]:
            q = w.questions
            out.append(Conversation(w, c + 1, tuple(q[(c * turns + t) % len(q)] for t in range(turns))))
    return out


def first_message(work: TenantWork, question: str) -> str:
    """A conversation's first user message: the document, then the question (so every conversation
    over the same document shares the system prompt and the document as one cached prefix)."""
    d = work.document
    return f"Here is {d.title}:\n\n{d.text}\n\nMy question: {question}"
