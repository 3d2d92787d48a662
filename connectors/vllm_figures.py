"""What the vLLM connector counts, and the figures it reports to `kvpool stats` under the name of
its engine (``vllm 127.0.0.1:8000 (smollm2)``): requests and prompt tokens, the tokens vLLM took
from the pool, the loads that landed and their tokens, failed loads, those declined by the
break-even, and per tenant its prompt tokens and the tokens vLLM took from the pool for it --
counted as vLLM counts them on its ``/metrics``, so the tenants' add up to the engine's and the
engine's equal vLLM's own counters.
"""

from __future__ import annotations

import os
from typing import Any

MAX_TENANTS_REPORTED = 16  # per-tenant figures in one report (a report holds at most 64 figures)
NO_TENANT = "(none)"  # requests served as no tenant (a request secret that is nobody's): not a tenant id
OTHERS = "(others)"  # the tenants past MAX_TENANTS_REPORTED - 1, summed: not a tenant id
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


def engine_name(model: str, served: str | None = None, dp_rank: int | None = None) -> str:
    """How `kvpool stats` names this engine: its server's address and served model name, else its
    model and process; ``dp_rank``: which of a data-parallel server's engines (each has its own
    scheduler, counts and ``engine`` label on ``/metrics``)."""
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    address = server_address()
    name = f"vllm {address} ({served or model})" if address else f"vllm {model} pid {os.getpid()}"
    if dp_rank is not None:
        name = f"{name} engine {dp_rank}"
    return name[:MAX_NAME]


class Counts:
    """The connector's counters (its stats) and, per tenant, [prompt tokens, tokens from the pool],
    counted where and as vLLM 0.32's scheduler counts its own (``vllm/v1/core/sched/scheduler.py``):

    - ``request``: a request at its first admission (not a preempted request's return): one of
      ``requests``, its ``prompt_tokens`` (``vllm:prompt_tokens_total``, which counts a request once
      its prefill produced a token; one that finished before is taken back: ``unrequest``);
    - ``offered``: the tokens vLLM accepted from the connector at the admission of a request not
      preempted, ``pool_tokens`` (``vllm:prompt_tokens_cached_by_source_total{source="host"}``, the
      same as ``vllm:external_prefix_cache_hits_total``): counted before the load runs, so a load
      that then fails is in them and in ``failed_tokens`` (recomputed);
    - ``loaded``: a load that brought tokens vLLM keeps (a preempted request's reload included:
      ``kvpool:loads_total``, ``kvpool:loaded_tokens_total``)."""

    def __init__(self) -> None:
        self.c: dict[str, int] = {}
        self.tenants: dict[str, list[int]] = {}  # tenant -> [prompt tokens, tokens from the pool]

    def add(self, name: str, n: int = 1) -> None:
        self.c[name] = self.c.get(name, 0) + n

    def _tenant(self, tenant: str) -> list[int]:
        return self.tenants.setdefault(tenant or NO_TENANT, [0, 0])

    def request(self, tenant: str, prompt_tokens: int) -> None:
        """A request's first admission (``tenant`` "": served as no tenant)."""
        self._tenant(tenant)[0] += prompt_tokens
        self.add("requests")
        self.add("prompt_tokens", prompt_tokens)

    def unrequest(self, tenant: str, prompt_tokens: int) -> None:
        """A request that finished before its first token: vLLM never counted its prompt tokens."""
        self._tenant(tenant)[0] -= prompt_tokens
        self.add("prompt_tokens", -prompt_tokens)

    def offered(self, tenant: str, tokens: int) -> None:
        """Tokens vLLM accepted from the pool at an admission (not a preempted request's)."""
        self._tenant(tenant)[1] += tokens
        self.add("pool_tokens", tokens)

    def admitted(self, counted: bool, tenant: str, request: Any, offered: int) -> bool:
        """An admission of vLLM's ``request`` with ``offered`` tokens from the pool (``counted``:
        the request was counted before); whether it is counted now. A preempted request's return
        counts nothing (vLLM: ``PrefixCacheStats.record(preempted=True)``, its prefill stats kept)."""
        if request.num_preemptions > 0:
            return counted
        if not counted:
            self.request(tenant, request.num_prompt_tokens)
        if offered:
            self.offered(tenant, offered)
        return True

    def finished(self, counted: bool, tenant: str, request: Any) -> None:
        """``request`` finished: one that never produced a token still holds its prefill stats,
        which vLLM hands to its metrics with the first token only: its prompt tokens never counted."""
        if counted and getattr(request, "prefill_stats", None) is not None:
            self.unrequest(tenant, request.num_prompt_tokens)

    def loaded(self, tokens: int) -> None:
        """A load that brought ``tokens`` tokens vLLM keeps."""
        self.add("loads")
        self.add("loaded_tokens", tokens)

    def figures(self, breakeven: dict[str, Any], health: dict[str, Any]) -> dict[str, Any]:
        c = self.c
        out = {**breakeven, **health, **{k: c.get(k, 0) for k in (
            "requests", "prompt_tokens", "pool_tokens", "loads", "loaded_tokens", "load_failures", "failed_tokens",
            "degraded_requests", "recomputed_by_breakeven")}}
        shown = sorted(self.tenants.items(), key=lambda kv: (-kv[1][0], kv[0]))
        if len(shown) > MAX_TENANTS_REPORTED:  # the rest summed: the tenants still add up to the engine
            rest = shown[MAX_TENANTS_REPORTED - 1:]
            shown = [*shown[:MAX_TENANTS_REPORTED - 1], (OTHERS, [sum(v[0] for _, v in rest), sum(v[1] for _, v in rest)])]
        for tenant, (prompt, pool) in sorted(shown):
            out[f"tenant {tenant} prompt_tokens"] = prompt
            out[f"tenant {tenant} pool_tokens"] = pool
        return out
