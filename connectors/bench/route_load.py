"""The multi-turn, multi-tenant workload of ``kvpool bench route``, and its client.

Each tenant has a system prompt of its own and ``conversations`` conversations of ``turns`` turns:
turn k's prompt is the system prompt, every earlier user message and answer, and the new user
message; its answer is ``answer_tokens`` greedy tokens. Prompts are token ids (the servers need no
tokenizer). Two arms run the same conversations, token for token, as different tenants (their
namespaces and vLLM's ``cache_salt`` keep them apart), each through its own router: the answers
of the two arms must be equal.

A request is one streamed ``POST /v1/completions`` through a router: its time to first token is
the wall time to the first streamed token; the instance it went to (the router's
``x-kvpool-instance``) says where its prompt's cached tokens came from (that instance's vLLM
counters ``source="device"``: its own cache, ``source="host"``: the pool) and the shards say how
many of those came from another node (``peer_fetched``, slices).
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Conversation:
    tenant: str
    secret: str  # the tenant's request secret: the request's cache_salt
    system: list[int]
    users: list[list[int]]
    answers: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: int) -> list[int]:
        out = list(self.system)
        for k in range(turn):
            out += self.users[k] + self.answers[k]
        return out + self.users[turn]


def workload(tenants: dict[str, str], conversations: int, turns: int, system_tokens: int, user_tokens: int,
             vocab: int, seed: int) -> list[Conversation]:
    """``tenants``: id -> request secret, in order; the token content depends on the tenants'
    positions and ``seed`` only (so two arms of as many tenants get the same conversations)."""
    rng = random.Random(seed)
    out = []
    for tenant, secret in tenants.items():
        system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
        for _ in range(conversations):
            users = [[rng.randrange(3, vocab) for _ in range(user_tokens)] for _ in range(turns)]
            out.append(Conversation(tenant, secret, system, users))
    return out


class Client:
    """Streamed completions through one router, on a kept-alive connection."""

    def __init__(self, url: str, model: str, timeout_s: float = 300.0) -> None:
        u = urlsplit(url)
        self.host, self.port, self.model, self.timeout_s = u.hostname, u.port, model, timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def complete(self, prompt: list[int], secret: str, max_tokens: int) -> dict:
        """{"tokens", "ttft_s", "instance", "tiers", "cached_tokens"}; raises on a failed request."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "cache_salt": secret, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        t0 = time.perf_counter()
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = self.conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"the router answered {r.status}: {r.read()[:400]!r}")
            tokens, ttft, usage, done = [], None, {}, False
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"the stream failed: {chunk['error']}")
                for c in chunk.get("choices") or ():
                    got = c.get("token_ids") or []
                    if got and ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += got
                usage = chunk.get("usage") or usage
            r.read()  # the rest of the stream (its last chunk): the connection is then free for the next
            if not done:
                raise RuntimeError("the stream ended without [DONE]")
        except Exception:
            self.conn.close()
            self.conn = None
            raise
        return {"tokens": tokens, "ttft_s": ttft, "instance": r.getheader("x-kvpool-instance"),
                "tiers": r.getheader("x-kvpool-tiers"),
                "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
