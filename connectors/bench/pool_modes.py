"""`kvpool bench pool-modes`: the single-node pool (`kvpool up`: one process, no Ray) beside the
pool on a local Ray head (`kvpool up --ray-address local`) on the same machine, in one run.

For each mode, in a home and run dir of its own, the real commands as a user types them: `kvpool
up` (its wall time: the start), the processes the pool then runs (every process whose environment
names that home: the pool's process, or the Ray head's daemons, agents, workers and shard) with
their memory (RSS and PSS from /proc, the DRAM slab included: it is committed at start), `kvpool
stats` (wall time, median of 3), `kvpool connect vllm` for the engine's config, then the TTFT of
a pool hit after a restart of vLLM's OpenAI server (connectors/bench/vllm_server.py: cold, pool hit
and vLLM's own hit, medians over the repeats, hits checked with vLLM's own counters), and `kvpool
down` (`--stop-ray` for Ray): its wall time and what is left running after it (nothing, or the
run fails).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from statistics import median
from typing import Any

from kvpool.connectors.bench.node_pool_proc import CHUNK_TOKENS, TENANT, log, pool_bin

MODES = ("single-node", "ray")


def _proc_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB (smaps_rollup; RSS from status where that is unreadable)."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


class CliPool:
    """A pool started with the CLI in a home of its own; the interface of node_pool_proc.NodePool
    that the server benchmark uses (``start``, ``connector_config``, ``close``, ``index``)."""

    def __init__(self, mode: str, page_bytes: int, dram_pages: int, progress: bool = True) -> None:
        assert mode in MODES, mode
        self.mode, self.page_bytes, self.dram_pages, self.progress = mode, page_bytes, dram_pages, progress
        self.home = tempfile.mkdtemp(prefix=f"kvpool-modes-{mode}-")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.run_dir = tempfile.mkdtemp(prefix="kvpool-modes-run-", dir=shm)
        drop = ("VLLM_", "KVPOOL_", "RAY_ADDRESS", "RAY_AUTH", "PYTHONPATH")
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(drop)},
                    "HOME": self.home, "KVPOOL_RUN_DIR": self.run_dir, "RAY_USAGE_STATS_ENABLED": "0"}
        self.index = "embedded"
        self.figures: dict[str, Any] = {"mode": mode}

    def _kvpool(self, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        r = subprocess.run([pool_bin("kvpool"), *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        took = time.monotonic() - t0
        if r.returncode:
            raise RuntimeError(f"kvpool {' '.join(args)} ({self.mode}) failed:\n{(r.stdout + r.stderr)[-3000:]}")
        return r, took

    def pids(self) -> list[int]:
        """Live processes whose environment names this pool's home: the pool's (never this one)."""
        from kvpool.procs import processes_with_env

        return processes_with_env(f"HOME={self.home}")

    def start(self) -> None:
        up = ["up", "--page-size", str(self.page_bytes), "--dram-pages", str(self.dram_pages), "--tenant", TENANT]
        if self.mode == "ray":
            up[1:1] = ["--ray-address", "local"]
        log(f"{self.mode}: kvpool {' '.join(up)}", self.progress, "pool-modes")
        _, self.figures["up_s"] = self._kvpool(*up)
        time.sleep(2.0)  # what the start left running settles (Ray starts its agents and workers)
        pids = self.pids()
        mem = [_proc_kib(p) for p in pids]
        self.figures.update({"processes": len(pids), "rss_mib": sum(m[0] for m in mem) / 1024,
                             "pss_mib": sum(m[1] for m in mem) / 1024,
                             "slab_mib": self.page_bytes * self.dram_pages / 2**20})
        stats = []
        for _ in range(3):
            r, took = self._kvpool("stats", "--json")
            stats.append(took)
        self.figures["stats_s"] = median(stats)
        self.figures["stats_mode"] = json.loads(r.stdout).get("mode")
        log(f"{self.mode}: up in {self.figures['up_s']:.1f} s, {len(pids)} processes, "
            f"{self.figures['pss_mib']:.0f} MiB PSS, kvpool stats {self.figures['stats_s']:.2f} s", self.progress,
            "pool-modes")

    def connector_config(self, chunk_tokens: int = CHUNK_TOKENS, **more: Any) -> dict[str, Any]:
        """What `kvpool connect vllm` prints for this pool (its run dir and credentials file named:
        the servers run in the benchmark's own environment)."""
        creds = os.path.join(self.home, "engine-credentials.json")
        r, _ = self._kvpool("connect", "vllm", "--tenant", TENANT, "--chunk-tokens", str(chunk_tokens), "--run-dir",
                            self.run_dir, "--credentials-file", creds)
        return {**json.loads(r.stdout)["kv_connector_extra_config"], **more}

    def close(self) -> None:
        if "down_s" not in self.figures:
            try:
                _, self.figures["down_s"] = self._kvpool("down", *(["--stop-ray"] if self.mode == "ray" else []))
            except RuntimeError as e:
                self.figures["down_error"] = str(e)[-500:]
            time.sleep(1.0)
            left = self.pids()
            self.figures["left_running"] = len(left)
            for pid in left:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)


def run(context: int = 4096, repeats: int = 5, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """Each mode in turn (never both at once on a small machine), the same server benchmark on each."""
    from kvpool.connectors.bench import vllm_server

    out: dict[str, Any] = {"context": context, "repeats": repeats, "modes": {}}
    for mode in MODES:
        made: list[CliPool] = []

        def factory(page_bytes: int, dram_pages: int, progress: bool, mode=mode, made=made) -> CliPool:
            made.append(CliPool(mode, page_bytes, dram_pages, progress))
            return made[-1]

        r = vllm_server.run(context, repeats, ("node",), progress=progress, seed=seed, pool_factory=factory)
        node = r["backends"]["node"]
        out["modes"][mode] = {**made[0].figures, "ttft_pool_s": node["pool_s"], "ttft_native_s": node["native_s"],
                              "ttft_cold_s": node["cold_s"], "pool_vs_native": node["pool_vs_native"],
                              "cold_vs_pool": node["cold_vs_pool"], "valid": node["valid"],
                              "same_answers": node["same_answers"], "server_start_s": node["server_start_s"]}
        out["model"] = r["model"]
    s, y = out["modes"]["single-node"], out["modes"]["ray"]
    out["ray_vs_single_node"] = {k: y[k] / s[k] for k in ("up_s", "processes", "rss_mib", "pss_mib", "stats_s", "down_s")
                                 if s.get(k)}
    out["ray_vs_single_node"]["ttft_pool"] = y["ttft_pool_s"]["median"] / s["ttft_pool_s"]["median"]
    return out


def failures(out: dict[str, Any]) -> list[str]:
    why = []
    for mode, m in out["modes"].items():
        if not (m["valid"] and m["same_answers"]):
            why.append(f"{mode}: the restart hits were not all pool hits with the same answers: INVALID run")
        if m.get("left_running") or m.get("down_error"):
            why.append(f"{mode}: `kvpool down` left {m.get('left_running')} processes running {m.get('down_error', '')}")
    return why


def format_table(out: dict[str, Any]) -> str:
    s, y, q = out["modes"]["single-node"], out["modes"]["ray"], out["ray_vs_single_node"]
    rows = [("kvpool up (s)", "up_s", ".1f"), ("processes", "processes", "d"), ("RSS (MiB)", "rss_mib", ".0f"),
            ("PSS (MiB)", "pss_mib", ".0f"), ("kvpool stats (s)", "stats_s", ".2f"), ("kvpool down (s)", "down_s", ".1f"),
            ("left after down", "left_running", "d")]
    lines = [f"one pool shard on this machine, {s['slab_mib']:.0f} MiB DRAM slab (in RSS/PSS); vLLM's OpenAI server, "
             f"{out['context']} tokens, medians of {out['repeats']}",
             f"{'':<28}{'single-node':>14}{'Ray':>14}{'Ray/single':>12}"]
    for name, key, fmt in rows:
        ratio = f"{q[key]:.2f}x" if key in q else ""
        lines.append(f"{name:<28}{format(s.get(key, 0), fmt):>14}{format(y.get(key, 0), fmt):>14}{ratio:>12}")
    for name, key in (("TTFT pool hit, restart (s)", "ttft_pool_s"), ("TTFT vLLM's own hit (s)", "ttft_native_s"),
                      ("TTFT cold (s)", "ttft_cold_s")):
        ratio = f"{q['ttft_pool']:.2f}x" if key == "ttft_pool_s" else ""
        lines.append(f"{name:<28}{s[key]['median']:>14.3f}{y[key]['median']:>14.3f}{ratio:>12}")
    lines.append(f"{'pool hit / own hit':<28}{s['pool_vs_native']['median']:>13.2f}x{y['pool_vs_native']['median']:>13.2f}x")
    lines.append(f"valid hits and same answers: single-node {s['valid'] and s['same_answers']}, "
                 f"Ray {y['valid'] and y['same_answers']}")
    return "\n".join(lines)
