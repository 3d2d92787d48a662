"""``--json`` prints only JSON on stdout, even when the command's code, a native library or a
child process writes to stdout meanwhile (kvpool.jsonout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Written to stdout in every way an engine or Ray does: print, a logging handler made before the
# redirect (vLLM's, at import), one made during it, descriptor 1 directly (C code), a child process
# (which inherits descriptor 1), and a buffered write left unflushed.
NOISE = textwrap.dedent("""
    import logging, os, subprocess, sys
    early = logging.getLogger("early")
    early.addHandler(logging.StreamHandler(sys.stdout))
    early.propagate = False

    def noise():
        print("noise: print")
        early.warning("noise: early handler")
        late = logging.getLogger("late")
        late.addHandler(logging.StreamHandler(sys.stdout))
        late.propagate = False
        late.warning("noise: late handler")
        os.write(1, b"noise: fd 1\\n")
        subprocess.run([sys.executable, "-c", "print('noise: child')"], check=True)
        sys.__stdout__.write("noise: unflushed")
""")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", NOISE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


def _noise_on_stderr(p: subprocess.CompletedProcess) -> None:
    for what in ("print", "early handler", "late handler", "fd 1", "child", "unflushed"):
        assert f"noise: {what}" in p.stderr, (what, p.stderr[-2000:])


def test_json_stdout_sends_all_else_to_stderr():
    p = _run("""
        from kvpool.jsonout import emit, json_stdout
        with json_stdout():
            noise()
            emit({"ok": [1, 2]})
            noise()
        print("after: plain stdout again")
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    head, tail = p.stdout.split("after: plain stdout again")
    assert json.loads(head) == {"ok": [1, 2]}, p.stdout
    assert tail == "\n"
    _noise_on_stderr(p)


def test_bench_json_stdout_is_only_json():
    """A real ``kvpool bench store --json`` whose benchmark also writes to stdout every way."""
    p = _run("""
        from kvpool.bench import store
        from kvpool.cli import main
        real = store.run

        def noisy(*a, **kw):
            noise()
            return real(*a, **kw)

        store.run = noisy
        sys.exit(main(["bench", "store", "--json", "--chunks", "1", "--trials", "1"]))
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)  # the whole of stdout: nothing else there
    assert out["spec"]["num_layers"] > 0
    _noise_on_stderr(p)


def test_every_bench_command_with_json_runs_redirected():
    from kvpool.cli import build_parser

    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if a.__class__.__name__ == "_SubParsersAction")
    with_json = {name: p for name, p in bench.choices.items()
                 if any("--json" in a.option_strings for a in p._actions)}
    assert {"ttft", "store", "datapath", "quality"} <= set(with_json)
    for name, p in with_json.items():
        assert getattr(p.get_default("func"), "json_stdout", False), f"kvpool bench {name} --json is not redirected"
