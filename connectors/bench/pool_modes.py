"""`kvpool bench pool-modes`: the single-node pool (`kvpool up`: one process, no Ray) beside the
pool on a local Ray head (`kvpool up --ray-address local`) on the same machine, in one run.

For each mode, in a home and run dir of its own, the real commands as a user types them: `kvpool
up` (its wall time: the start), the processes the pool then runs once their set settles (every
process whose environment names that home and, on Ray, every process of the head's session and
below it: the pool's process, or the Ray head's daemons, agents, workers and shard) with their
memory before any engine attaches (RSS and PSS from /proc, the DRAM slab included: it is committed
at start; also PSS less the slab), `kvpool stats` (wall time, median of 3), `kvpool connect vllm`
for the engine's config, then the TTFT of a pool hit after a restart of vLLM's OpenAI server
(connectors/bench/vllm_server.py: cold, pool hit and vLLM's own hit, medians over the repeats,
hits checked with vLLM's own counters), and `kvpool down` (`--stop-ray` for Ray): its wall time
and what is left running after it (nothing, or the run fails).
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
    """(RSS, PSS) of a process in KiB (smaps_rollup; RSS from status and PSS 0 where that is unreadable)."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return rss, pss


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) a process has used so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


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
        self.head: tuple[str, str] | None = None  # the Ray head's (session dir, address), from its record
        self._cpu_at_start: dict[int, float] = {}
        self._started: float | None = None
        self.figures: dict[str, Any] = {"mode": mode}

    def _kvpool(self, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        r = subprocess.run([pool_bin("kvpool"), *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        took = time.monotonic() - t0
        if r.returncode:
            raise RuntimeError(f"kvpool {' '.join(args)} ({self.mode}) failed:\n{(r.stdout + r.stderr)[-3000:]}")
        return r, took

    def pids(self) -> list[int]:
        """The pool's live processes (never this one): those whose environment names this pool's home
        and, on Ray, every process of the head's session (its directory or address on the command
        line, as `kvpool down --stop-ray` finds them) and all below them: the raylet's agents do not
        carry the home in their environment."""
        from kvpool.procs import processes_naming, processes_with_env, with_descendants, zombie

        found = set(processes_with_env(f"HOME={self.home}"))
        if self.head is None and self.mode == "ray":
            try:
                with open(os.path.join(self.home, ".kvpool", "local-ray.json")) as f:
                    rec = json.load(f)
                self.head = (rec["session_dir"], rec.get("address") or "")
            except (OSError, ValueError, KeyError):
                pass
        if self.head is not None:
            session, address = self.head
            roots = processes_naming(session) + (processes_naming(address + "\0") if address else [])
            found.update(p for p in with_descendants(roots) if not zombie(p))
        return sorted(found)

    def _settled_pids(self, timeout_s: float = 20.0) -> list[int]:
        """The pool's processes once their set has stayed the same for 2 s (Ray's raylet starts its
        agents and idle workers after `ray start` returns)."""
        pids, since, deadline = self.pids(), time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() - since < 2.0 and time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.pids()
            if now != pids:
                pids, since = now, time.monotonic()
        return pids

    def start(self) -> None:
        up = ["up", "--page-size", str(self.page_bytes), "--dram-pages", str(self.dram_pages), "--tenant", TENANT]
        if self.mode == "ray":
            up[1:1] = ["--ray-address", "local"]
        log(f"{self.mode}: kvpool {' '.join(up)}", self.progress, "pool-modes")
        _, self.figures["up_s"] = self._kvpool(*up)
        pids = self._settled_pids()
        mem = {p: _proc_kib(p) for p in pids}
        from kvpool.procs import describe

        slab = self.page_bytes * self.dram_pages / 2**20
        self.figures.update({"processes": len(pids), "rss_mib": sum(m[0] for m in mem.values()) / 1024,
                             "pss_mib": sum(m[1] for m in mem.values()) / 1024, "slab_mib": slab,
                             "process_list": [{"pid": p, "what": describe(p), "rss_mib": m[0] / 1024,
                                               "pss_mib": m[1] / 1024} for p, m in mem.items()]})
        self.figures["pss_less_slab_mib"] = self.figures["pss_mib"] - slab
        self._cpu_at_start, self._started = {p: _cpu_s(p) for p in pids}, time.monotonic()
        self.figures["load_at_start"] = os.getloadavg()[0]  # a shared machine: how busy it was, beside the figures
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
        if "down_s" not in self.figures and self._started is not None:
            # NOTE: what the pool's processes cost the machine while the engine ran beside them (on
            # 2 cores, a Ray head's daemons polling compete with vLLM): CPU time since the start
            # was measured, of the processes alive now (those born since counted whole)
            now = self.pids()
            self.figures["cpu_s"] = sum(_cpu_s(p) - self._cpu_at_start.get(p, 0.0) for p in now)
            self.figures["cpu_over_s"] = time.monotonic() - self._started
            self.figures["load_at_down"] = os.getloadavg()[0]
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
    keys = ("up_s", "processes", "rss_mib", "pss_mib", "pss_less_slab_mib", "stats_s", "down_s", "cpu_s")
    out["ray_vs_single_node"] = {k: y[k] / s[k] for k in keys if s.get(k) and k in y}
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
            ("PSS (MiB)", "pss_mib", ".0f"), ("PSS less the slab (MiB)", "pss_less_slab_mib", ".0f"),
            ("kvpool stats (s)", "stats_s", ".2f"), ("pool CPU, engine beside (s)", "cpu_s", ".1f"),
            ("kvpool down (s)", "down_s", ".1f"),
            ("left after down", "left_running", "d")]
    lines = [f"one pool shard on this machine, {s['slab_mib']:.0f} MiB DRAM slab (in RSS/PSS); vLLM's OpenAI server, "
             f"{out['context']} tokens, medians of {out['repeats']}",
             f"{'':<28}{'single-node':>14}{'Ray':>14}{'Ray/single':>12}"]
    for name, key, fmt in rows:
        ratio = f"{q[key]:.2f}x" if key in q else ""
        one, two = (format(m[key], fmt) if key in m else "-" for m in (s, y))
        lines.append(f"{name:<28}{one:>14}{two:>14}{ratio:>12}")
    for name, key in (("TTFT pool hit, restart (s)", "ttft_pool_s"), ("TTFT vLLM's own hit (s)", "ttft_native_s"),
                      ("TTFT cold (s)", "ttft_cold_s")):
        ratio = f"{q['ttft_pool']:.2f}x" if key == "ttft_pool_s" else ""
        lines.append(f"{name:<28}{s[key]['median']:>14.3f}{y[key]['median']:>14.3f}{ratio:>12}")
    lines.append(f"{'pool hit / own hit':<28}{s['pool_vs_native']['median']:>13.2f}x{y['pool_vs_native']['median']:>13.2f}x")
    lines.append("pool hit range (s): " + ", ".join(
        f"{name} {m['ttft_pool_s']['min']:.3f}-{m['ttft_pool_s']['max']:.3f}" for name, m in (("single-node", s), ("Ray", y))))
    if "cpu_over_s" in s and "cpu_over_s" in y:
        lines.append(f"pool CPU: the pool's processes from the start measured to `kvpool down`, while vLLM's servers "
                     f"ran beside them ({s['cpu_over_s']:.0f} s single-node, {y['cpu_over_s']:.0f} s Ray)")
    if "load_at_down" in s and "load_at_down" in y:
        lines.append(f"load average (1 min) at start / at down: single-node {s['load_at_start']:.1f} / "
                     f"{s['load_at_down']:.1f}, Ray {y['load_at_start']:.1f} / {y['load_at_down']:.1f}")
    lines.append(f"valid hits and same answers: single-node {s['valid'] and s['same_answers']}, "
                 f"Ray {y['valid'] and y['same_answers']}")
    return "\n".join(lines)
