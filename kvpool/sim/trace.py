"""Requests as the simulator sees them, and the Mooncake trace format.

Mooncake's jsonl: one request per line with ``timestamp`` (ms), ``input_length``,
``output_length`` (tokens) and ``hash_ids``: ids of the prompt's 512-token blocks, numbered so
that an id always has the same parent (so an id stands for a chained chunk key).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvpool.errors import BadRequest

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SimRequest:
    time_s: float
    blocks: tuple[int, ...]  # chained block ids, root first
    input_tokens: int
    output_tokens: int = 0
    tenant: int = 0
    chunk_tokens: int = BLOCK_TOKENS

    @property
    def full_blocks(self) -> int:
        return min(len(self.blocks), self.input_tokens // self.chunk_tokens)

    def block_tokens(self, i: int) -> int:
        """Tokens of the prompt in block ``i`` (the last block may be partial)."""
        return max(0, min(self.chunk_tokens, self.input_tokens - i * self.chunk_tokens))


def merge_blocks(trace: list[SimRequest], n: int) -> list[SimRequest]:
    """The same requests in chunks of ``n`` blocks (n x 512 tokens). Block ids are chained, so a
    chunk is named by its last block's id: two chunks with the same last block hold the same
    tokens at the same place."""
    if n < 1:
        raise BadRequest(f"--merge-blocks {n}: give a whole number of 512-token blocks per chunk (1, 2, 4, ...)")
    if n == 1:
        return trace
    return [SimRequest(r.time_s, tuple(r.blocks[min(i + n, len(r.blocks)) - 1] for i in range(0, len(r.blocks), n)),
                       r.input_tokens, r.output_tokens, r.tenant, r.chunk_tokens * n) for r in trace]


def load_mooncake(path: str, limit: int | None = None) -> list[SimRequest]:
    if not os.path.exists(path):
        raise BadRequest(f"trace file {path!r} does not exist")
    out: list[SimRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                blocks = tuple(int(b) for b in r["hash_ids"])
                req = SimRequest(float(r["timestamp"]) / 1000.0, blocks, int(r["input_length"]),
                                 int(r.get("output_length", 0)), int(r.get("tenant", 0)))
            except (ValueError, KeyError, TypeError) as e:
                raise BadRequest(f"{path}:{lineno}: not a Mooncake trace line ({e}); expected "
                                 "timestamp, input_length, output_length, hash_ids") from None
            if req.input_tokens < 0 or (req.blocks and req.input_tokens > len(req.blocks) * BLOCK_TOKENS):
                raise BadRequest(f"{path}:{lineno}: input_length {req.input_tokens} does not fit "
                                 f"{len(req.blocks)} blocks of {BLOCK_TOKENS} tokens")
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    return out
