"""How `kvpool stats` names a vLLM engine (connectors/vllm_figures.py): by the address of the
OpenAI server whose engine core it is, found from the server's command line, as vLLM's own
processes run: `vllm serve` is a script that the interpreter of its ``#!`` line runs, and the
engine core (where the connector's reporter lives) is a child of that server process."""

from __future__ import annotations

import os
import subprocess
import sys

NAME = "from kvpool.connectors.vllm_figures import engine_name; print(engine_name('/models/m', ['smol']))"

# `vllm serve ...` as the kernel runs it (argv: the interpreter, the script, "serve", ...), starting
# its engine core as a child process
SERVER = """#!{python}
import subprocess, sys
sys.exit(subprocess.run([{python!r}, "-c", {name!r}]).returncode)
"""


def _vllm_script(folder) -> str:
    path = os.path.join(folder, "vllm")
    with open(path, "w") as f:
        f.write(SERVER.format(python=sys.executable, name=NAME))
    os.chmod(path, 0o755)
    return path


def _run(*argv: str, cwd=None) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, cwd=cwd)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_an_engine_under_vllm_serve_is_named_by_its_servers_address(tmp_path):
    vllm = _vllm_script(tmp_path)
    assert _run(vllm, "serve", "/models/m", "--host", "127.0.0.9", "--port", "8123") == "vllm 127.0.0.9:8123 (smol)"
    assert _run(vllm, "serve", "/models/m", "--port=8124") == "vllm 0.0.0.0:8124 (smol)"  # vLLM's default host
    assert _run(vllm, "serve", "/models/m") == "vllm 0.0.0.0:8000 (smol)"  # and port
    # the same script, run by name through its interpreter
    assert _run(sys.executable, vllm, "serve", "/models/m", "--port", "9000") == "vllm 0.0.0.0:9000 (smol)"


def test_a_port_set_in_the_servers_config_file_names_it(tmp_path):
    vllm = _vllm_script(tmp_path)
    (tmp_path / "serve.yaml").write_text("host: 127.0.0.7\nport: 8321\nmax-model-len: 1024\n")
    # the file relative to the server's working directory, as vLLM opens it
    assert _run(vllm, "serve", "/models/m", "--config", "serve.yaml", cwd=tmp_path) == "vllm 127.0.0.7:8321 (smol)"
    # the command line wins over the file, as in vLLM
    assert _run(vllm, "serve", "/models/m", f"--config={tmp_path / 'serve.yaml'}", "--port", "9001") == \
        "vllm 127.0.0.7:9001 (smol)"
    # a file that cannot be read: vLLM's defaults (vLLM itself would not have started)
    assert _run(vllm, "serve", "/models/m", "--config", "missing.yaml", cwd=tmp_path) == "vllm 0.0.0.0:8000 (smol)"


def test_an_engine_under_no_server_is_named_by_model_and_process(tmp_path):
    vllm = _vllm_script(tmp_path)
    out = _run(vllm, "bench", "/models/m", "--port", "8123")  # another vllm subcommand: no server
    assert out.startswith("vllm /models/m pid ") and int(out.rsplit(" ", 1)[1]) > 0, out
    out = _run(sys.executable, "-c", NAME)  # an in-process LLM
    assert out.startswith("vllm /models/m pid "), out
