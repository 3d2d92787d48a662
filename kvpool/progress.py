"""A dependency-free progress bar for long operations (benchmarks, demo, warm-up)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "label") as p: ... p.advance()``. Draws on stderr; when stderr is not
    a terminal it prints a line at every tenth of the way instead of redrawing."""

    def __init__(self, total: int, label: str, stream=None, enabled: bool = True) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1
        self._t0 = time.perf_counter()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        frac = self.done / self.total
        if self._tty:
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {note}\x1b[K")
            self.stream.flush()
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(f"{self.label}: {self.done}/{self.total} ({frac:.0%}) {note}\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self._tty:
            secs = time.perf_counter() - self._t0
            self.stream.write(f"\r{self.label} [{'#' * 30}] {self.done}/{self.total} in {secs:.1f}s\x1b[K\n")
            self.stream.flush()
