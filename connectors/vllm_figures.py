"""What the vLLM connector counts, and the figures it reports to `kvpool stats` under the name of
its server (``vllm 127.0.0.1:8000 (smollm2)``): requests and prompt tokens, the tokens loaded from
the pool (only loads that succeeded), failed loads, those declined by the break-even, and per
tenant the prompt tokens and those the pool served -- counts that add up, whatever the report
shows them as."""

from __future__ import annotations

import os
from typing import Any

MAX_TENANTS_REPORTED = 16  # per-tenant figures in one report (a report holds at most 64 figures)
MAX_NAME = 256  # an engine's name in a report (kvpool.node.messages)


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


def _is_server(argv: list[str]) -> bool:
    """Whether ``argv`` started vLLM's OpenAI server: ``vllm serve`` (the script itself, or the
    interpreter its ``#!`` line names, then the script), ``python -m vllm.entrypoints.cli.main
    serve``, or ``python -m vllm.entrypoints.openai.api_server``."""
    if any(a.endswith("vllm.entrypoints.openai.api_server") for a in argv):
        return True
    i = argv.index("serve") if "serve" in argv[1:4] else 0
    return i > 0 and (os.path.basename(argv[i - 1]) == "vllm" or argv[i - 1].endswith("vllm.entrypoints.cli.main"))


def _config_file(argv: list[str], pid: int) -> dict[str, Any]:
    """The settings of ``vllm serve --config FILE`` (a YAML file; relative to the server's working
    directory), or {} when there is none or it cannot be read."""
    path = _option(argv, "--config")
    if not path:
        return {}
    try:
        import yaml

        with open(os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)) as f:
            got = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - a name for the figures only: the command line's, then vLLM's defaults
        return {}
    return got if isinstance(got, dict) else {}


def server_address(pid: int | None = None) -> str | None:
    """``host:port`` of the vLLM OpenAI server this process belongs to (it, or the API server that
    started its engine core: the nearest of its ancestors started as ``vllm serve`` or vLLM's
    ``api_server``), as vLLM takes them: the command line's, else its ``--config`` file's, else
    0.0.0.0:8000; None when it runs under no server (an in-process ``LLM``)."""
    pid = os.getpid() if pid is None else pid
    for _ in range(4):
        argv = _cmdline(pid)
        if _is_server(argv):
            file = _config_file(argv, pid)
            host = _option(argv, "--host") or file.get("host") or "0.0.0.0"
            return f"{host}:{_option(argv, '--port') or file.get('port') or '8000'}"
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
    name = f"vllm {address} ({served or model})" if address else f"vllm {model} pid {os.getpid()}"
    return name[:MAX_NAME]


class Counts:
    """The connector's counters (its stats) and its per-tenant tokens. ``loads`` and
    ``loaded_tokens`` count what the worker loaded and vLLM kept (not what was planned), so the
    tenants' tokens from the pool add up to the engine's."""

    def __init__(self) -> None:
        self.c: dict[str, int] = {}
        self.tenants: dict[str, list[int]] = {}  # tenant -> [prompt tokens, tokens loaded from the pool]

    def add(self, name: str, n: int = 1) -> None:
        self.c[name] = self.c.get(name, 0) + n

    def request(self, tenant: str, prompt_tokens: int) -> None:
        """A request admitted (looked up in the pool; the caller counts ``requests``)."""
        self.tenants.setdefault(tenant, [0, 0])[0] += prompt_tokens
        self.add("prompt_tokens", prompt_tokens)

    def loaded(self, tenant: str, tokens: int) -> None:
        """A load that brought ``tokens`` tokens vLLM keeps."""
        self.tenants.setdefault(tenant, [0, 0])[1] += tokens
        self.add("loads")
        self.add("loaded_tokens", tokens)

    def figures(self, breakeven: dict[str, Any], health: dict[str, Any]) -> dict[str, Any]:
        c = self.c
        out = {**breakeven, **health, **{k: c.get(k, 0) for k in (
            "requests", "prompt_tokens", "loads", "loaded_tokens", "load_failures", "failed_tokens",
            "degraded_requests", "recomputed_by_breakeven")}}
        for tenant, (prompt, pool) in sorted(self.tenants.items())[:MAX_TENANTS_REPORTED]:
            out[f"tenant {tenant} prompt_tokens"] = prompt
            out[f"tenant {tenant} pool_tokens"] = pool
        return out
