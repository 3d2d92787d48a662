"""``--json`` prints only JSON on stdout, whatever else the command runs.

Engines and Ray log to stdout: vLLM's logger writes to the ``sys.stdout`` it found when it was
imported, native code and child processes write to file descriptor 1. :func:`json_stdout` points
descriptor 1 at stderr for as long as the command runs (``os.dup2``, so C code and every process
started meanwhile inherit it) and ``sys.stdout`` at ``sys.stderr``; :func:`emit` writes the
command's JSON to the real stdout, saved aside. Outside :func:`json_stdout`, :func:`emit` is a
plain ``print`` of the JSON.

    with json_stdout(args.json):
        result = run_the_benchmark()   # anything it prints lands on stderr
        emit(result) if args.json else print(format_table(result))
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

_real_stdout: int | None = None  # the saved descriptor of the real stdout while redirected


@contextlib.contextmanager
def json_stdout(enabled: bool = True) -> Iterator[None]:
    """While inside: descriptor 1 and ``sys.stdout`` go to stderr, :func:`emit` to the real
    stdout. Nests (the inner one changes nothing); ``enabled=False`` does nothing."""
    global _real_stdout
    if not enabled or _real_stdout is not None:
        yield
        return
    before = sys.stdout
    _flush(before)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        _real_stdout, sys.stdout = saved, sys.stderr
        yield
    finally:
        # NOTE: whatever a library buffered in the original sys.stdout object (a handler that
        # kept it from before) is flushed while descriptor 1 is still stderr: never after the JSON
        _flush(before)
        _flush(sys.stderr)
        sys.stdout = before
        _real_stdout = None
        os.dup2(saved, 1)
        os.close(saved)


def emit(obj: Any, *, indent: int | None = 2, default: Callable[[Any], Any] | None = None) -> None:
    """Writes ``obj`` as JSON and a newline to the real stdout (also inside :func:`json_stdout`)."""
    text = json.dumps(obj, indent=indent, default=default) + "\n"
    if _real_stdout is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    data = memoryview(text.encode())
    while data:
        n = os.write(_real_stdout, data)
        data = data[n:]


def json_command(func: Callable[[Any], int]) -> Callable[[Any], int]:
    """A CLI command ``func(args)`` run under :func:`json_stdout` when ``args.json`` is set (the
    command writes its JSON with :func:`emit`)."""

    @functools.wraps(func)
    def run(args: Any) -> int:
        with json_stdout(bool(getattr(args, "json", False))):
            return func(args)

    run.json_stdout = True  # type: ignore[attr-defined]  # the CLI's tests check every --json command has it
    return run


def _flush(stream: Any) -> None:
    with contextlib.suppress(Exception):  # a closed or detached stream has nothing to flush
        stream.flush()


def show(args, result, table) -> None:
    """The result as JSON on the real stdout (``--json``; the command runs under
    :func:`kvpool.jsonout.json_command`, so anything else printed meanwhile goes to stderr), else
    ``table(result)``."""
    if args.json:
        emit(result)
    else:
        print(table(result))
