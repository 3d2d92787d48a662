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
