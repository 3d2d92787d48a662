"""Finding this machine's processes by what their command line names (a Ray head's processes all
name its session or temp directory): to stop exactly the processes one started, never another's."""

from __future__ import annotations

import os


def processes_naming(text: str) -> list[int]:
    """The processes (not this one) whose command line contains ``text``; none for an empty text."""
    if not text:
        return []
    needle, found = text.encode(), []
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _ppids() -> dict[int, int]:
    out = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                out[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def with_descendants(roots: list[int]) -> list[int]:
    """``roots`` and every process below them (a Ray head's raylet starts its workers and agents,
    whose command lines name nothing of the head), never this process or one of its ancestors."""
    ppids = _ppids()
    mine, p = set(), os.getpid()
    while p > 1 and p not in mine:
        mine.add(p)
        p = ppids.get(p, 1)
    found, todo = set(), [r for r in roots if r not in mine]
    while todo:
        pid = todo.pop()
        if pid in found or pid in mine:
            continue
        found.add(pid)
        todo.extend(c for c, parent in ppids.items() if parent == pid)
    return sorted(found)


RAY_PARTS = (("gcs_server", "gcs server"), ("raylet/raylet", "raylet"), ("ray.util.client.server", "ray client server"),
             ("dashboard/agent.py", "dashboard agent"), ("dashboard/dashboard.py", "dashboard"),
             ("runtime_env/agent", "runtime-env agent"), ("log_monitor.py", "log monitor"),
             ("autoscaler/_private/monitor.py", "autoscaler monitor"), ("ray::DashboardAgent", "dashboard agent"),
             ("ray::RuntimeEnvAgent", "runtime-env agent"), ("ray::", "worker"))


def _cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def ray_role(pid: int) -> str | None:
    """What one of a Ray node's own processes is ("raylet", "ray client server", "worker ray::IDLE",
    ...); None for any other process."""
    cmd = _cmdline(pid)
    for part, name in RAY_PARTS if cmd else ():
        if part in cmd:
            return f"{name} {cmd.split()[0]}" if part == "ray::" else name
    return None


def describe(pid: int) -> str:
    """What a Ray head's process is, in a few words (its command line's first part otherwise)."""
    cmd = _cmdline(pid)
    if cmd is None:
        return "gone"
    return ray_role(pid) or (os.path.basename(cmd.split()[0]) if cmd else "?")


def zombie(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def processes_with_env(entry: str) -> list[int]:
    """The live processes (not this one) whose environment holds ``entry`` (``NAME=value``), e.g. the
    HOME of a scratch folder a benchmark or test ran a pool in."""
    needle, found = entry.encode() + b"\0", []
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read():
                    continue
        except OSError:
            continue
        if not zombie(int(pid)):
            found.append(int(pid))
    return found
