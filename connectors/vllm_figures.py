"""What the vLLM connector counts, and the figures it reports to `kvpool stats` under the name of
its server (``vllm 127.0.0.1:8000 (smollm2)``): requests and prompt tokens, the tokens loaded from
the pool (only loads that succeeded), failed loads, those declined by the break-even, and per
tenant the prompt tokens and those the pool served -- counts that add up, whatever the report
shows them as."""

from __future__ import annotations

import os
from typing import Any

MAX_TENANTS_REPORTED = 16  # per-tenant figures in one report (a report holds at most 64 figures)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 1


def _option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def server_address(pid: int | None = None) -> str | None:
    """``host:port`` of the vLLM OpenAI server this process belongs to (it, or the API server that
    started its engine core: the nearest of its ancestors started as ``vllm serve`` or vLLM's
    ``api_server``); None when it runs under no server (an in-process ``LLM``)."""
    pid = os.getpid() if pid is None else pid
    for _ in range(4):
        argv = _cmdline(pid)
        if any(a == "serve" for a in argv[1:3]) and "vllm" in os.path.basename(argv[0] if argv else "") or \
                any(a.endswith("vllm.entrypoints.openai.api_server") for a in argv):
            host = _option(argv, "--host") or "0.0.0.0"
            return f"{host}:{_option(argv, '--port') or '8000'}"
        if pid <= 1:
            return None
        pid = _ppid(pid)
    return None


def engine_name(model: str, served: str | None = None) -> str:
    """How `kvpool stats` names this engine: its server's address and served model name, else its
    model and process."""
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    address = server_address()
    return f"vllm {address} ({served or model})" if address else f"vllm {model} pid {os.getpid()}"


class Counts:
    """The connector's counters (its stats) and its per-tenant tokens."""

    def __init__(self) -> None:
        self.c: dict[str, int] = {}
        self.tenants: dict[str, list[int]] = {}  # tenant -> [prompt tokens, tokens planned from the pool]

    def add(self, name: str, n: int = 1) -> None:
        self.c[name] = self.c.get(name, 0) + n

    def request(self, tenant: str, prompt_tokens: int, pool_tokens: int) -> None:
        t = self.tenants.setdefault(tenant, [0, 0])
        t[0] += prompt_tokens
        t[1] += pool_tokens
        self.add("prompt_tokens", prompt_tokens)

    def figures(self, breakeven: dict[str, Any], health: dict[str, Any]) -> dict[str, Any]:
        c = self.c
        out = {**breakeven, **health, **{k: c.get(k, 0) for k in (
            "requests", "prompt_tokens", "loaded_tokens", "load_failures", "failed_tokens", "degraded_requests",
            "recomputed_by_breakeven")}}
        for tenant, (prompt, pool) in sorted(self.tenants.items())[:MAX_TENANTS_REPORTED]:
            out[f"tenant {tenant} prompt_tokens"] = prompt
            out[f"tenant {tenant} pool_tokens"] = pool
        return out
