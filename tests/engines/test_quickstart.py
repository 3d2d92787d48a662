"""The README's quickstart, run as written: `kvpool up`, vLLM's own server (`vllm serve`) with the
connector from `kvpool connect vllm`, HTTP requests, a restart, a second server, `kvpool stats`,
`kvpool route` in front of both, `kvpool down`.

The commands come from the README itself (its ```sh blocks between the quickstart markers), run in
one bash (``set -euo pipefail``) from a scratch folder that links the repository's venvs and
top-level entries. Only the ports change (free ones for 8000, 8001 and 8080); ``$HOME`` is
the scratch folder (the pool secret, the engine's credentials, the record of the pool's process),
and ``$KVPOOL_RUN_DIR`` a folder of its own. Then the answers are checked:

- the restarted server's answer loads the prompt's whole chunks from the pool and is vLLM's own
  hit's answer, token for token and log-prob for log-prob, and the cold answer's tokens;
- the second server's answer is the same, from the chunks the first one saved;
- vLLM's metrics count the pool's tokens (``source="host"``) and `kvpool stats` shows the hits;
- the router, tokenizing the text prompt with the model's tokenizer and keying it with the engines'
  spec, expects the prompt's whole chunks from the pool, and its answer is the others'.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest
from conftest import need_engines, vllm_cache_root

need_engines("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
CHUNK = 256  # the connector's default chunk (kvpool connect vllm)
TIMEOUT_S = 1500  # three server starts (~1 min each on a quiet 2-core machine), requests, the pool
MARK = "@@quickstart step {}@@"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quickstart_blocks(text: str) -> list[str]:
    """The ```sh blocks between the README's quickstart markers."""
    m = re.search(r"<!-- quickstart:start -->(.*?)<!-- quickstart:end -->", text, re.S)
    assert m, "README.md has no quickstart (<!-- quickstart:start --> ... <!-- quickstart:end -->)"
    blocks = re.findall(r"```sh\n(.*?)```", m.group(1), re.S)
    assert len(blocks) >= 5, "the quickstart lost its steps"
    return blocks


def test_quickstart_blocks_are_found():
    blocks = quickstart_blocks(open(README).read())
    text = "\n".join(blocks)
    for needed in ("kvpool up", "vllm serve", "kvpool connect vllm", "kvpool stats", "kvpool down", "wait_for_server"):
        assert needed in text, needed


def env_for(home: str, run_dir: str) -> dict:
    drop = ("VLLM_", "RAY_ADDRESS", "KVPOOL_SECRET", "KVPOOL_RUN_DIR", "KVPOOL_LOCAL_RAY_RECORD", "KVPOOL_CREDENTIAL",
            "KVPOOL_POOL_RECORD", "RAY_AUTH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    # NOTE: the SmolLM2 checkpoint is written once per machine under the real home (not per test)
    smollm2 = env.get("KVPOOL_SMOLLM2_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvpool", "smollm2")
    env.update({"HOME": home, "KVPOOL_RUN_DIR": run_dir, "KVPOOL_SMOLLM2_DIR": smollm2,
                "KVPOOL_CACHE_DIR": os.path.join(home, "cache"), "HF_HUB_OFFLINE": "1",
                "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"),
                "VLLM_CACHE_ROOT": vllm_cache_root()})  # vLLM's notes on models, not the pool's: as under the real home
    return env


def own_pids(home: str) -> list[int]:
    """Live processes whose environment names the scratch home (never another pool on the machine)."""
    from kvpool.procs import processes_with_env

    return processes_with_env(f"HOME={home}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("quickstart")
    home, run_dir = str(work / "home"), str(work / "run")
    os.makedirs(home)
    os.makedirs(run_dir)
    # the repository's folder, as a user has it: its venvs, docs and top-level packages (kernels/ among them)
    for name in os.listdir(REPO):
        if name in (".venv", ".venv-engines") or not name.startswith("."):
            os.symlink(os.path.join(REPO, name), work / name)
    ports = {"8000": str(free_port()), "8001": str(free_port()), "8080": str(free_port())}
    steps = []
    for i, block in enumerate(quickstart_blocks(open(README).read()), 1):
        for old, new in ports.items():
            block = re.sub(rf"\b{old}\b", new, block)
        steps.append(f"echo '{MARK.format(i)}'\n{block}")
    script = "set -euo pipefail\n" + "\n".join(steps) + f"\necho '{MARK.format('end')}'\n"
    (work / "quickstart.sh").write_text(script)
    env = env_for(home, run_dir)
    proc = subprocess.Popen(["bash", str(work / "quickstart.sh")], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    left = None
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        time.sleep(1.0)  # what `kvpool down` stopped has exited by now
        left = own_pids(home)  # before the clean-up below: what the quickstart itself left running
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[the quickstart ran past {TIMEOUT_S} s]"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # servers a failed step left behind
        except ProcessLookupError:
            pass
        if MARK.format("end") not in (out if proc.returncode is not None else ""):
            subprocess.run([os.path.join(REPO, ".venv", "bin", "kvpool"), "down"], env=env, cwd=work,
                           capture_output=True, timeout=120)
        for pid in own_pids(home):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def logs() -> str:
        tails = [f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:] for p in work.glob("vllm-*.log")]
        return out[-8000:] + "\n" + "\n".join(tails)

    assert proc.returncode == 0 and MARK.format("end") in out, logs()
    parts = re.split(r"@@quickstart step (\w+)@@\n", out)
    step_out = {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    answers = {name: json.loads((work / f"{name}.json").read_text())
               for name in ("cold", "hit", "pool", "second", "acme", "routed")}
    step_out["left"] = left
    return step_out, answers, logs


def cached(answer: dict) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def tokens_and_logprobs(answer: dict) -> tuple[list, list]:
    lp = answer["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def test_the_pool_hit_after_a_restart_is_vllms_own_hit(run):
    _, a, logs = run
    whole = a["cold"]["usage"]["prompt_tokens"] // CHUNK * CHUNK
    assert whole >= 2 * CHUNK, "the quickstart's prompt should span two chunks"
    assert cached(a["cold"]) == 0, logs()
    assert cached(a["hit"]) >= whole, logs()  # vLLM's own prefix cache
    assert cached(a["pool"]) == whole, logs()  # after the restart: only the pool had it
    # the same KV (saved by the cold request) under the same question: bit-identical
    assert tokens_and_logprobs(a["pool"]) == tokens_and_logprobs(a["hit"])
    assert a["pool"]["choices"][0]["text"] == a["cold"]["choices"][0]["text"]
    assert len(a["pool"]["choices"][0]["logprobs"]["tokens"]) == 32


def test_a_second_server_loads_what_the_first_saved(run):
    _, a, logs = run
    assert cached(a["second"]) == cached(a["pool"]), logs()
    assert tokens_and_logprobs(a["second"]) == tokens_and_logprobs(a["hit"])


def test_another_tenant_finds_nothing(run):
    _, a, logs = run
    assert cached(a["acme"]) == 0, logs()  # neither the pool nor vLLM's own cache (the salt is in its keys)
    assert a["acme"]["choices"][0]["logprobs"]["tokens"] == a["cold"]["choices"][0]["logprobs"]["tokens"]


def test_the_hit_shows_in_vllms_metrics_and_kvpool_stats(run):
    steps, a, logs = run
    out = steps["4"]
    host = re.search(r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="host"[^}]*\} ([0-9.e+]+)$', out, re.M)
    assert host and float(host.group(1)) == cached(a["pool"]), out
    rows = re.findall(r"^\S+\s+dram\s+(\d+)\s+[\d.]+\s+\d+/\d+", out, re.M)
    assert rows and int(rows[0]) >= 2, out  # the prompt's two chunks
    # the restarted engine's own figures: its load, in tokens (same-node hits are read from shared
    # memory, without a call the shard could count)
    loads = [(int(n), int(t)) for n, t in re.findall(r"^\s+(\d+) loads \((\d+) tokens from the pool\)", out, re.M)]
    assert any(n >= 1 and t >= cached(a["pool"]) for n, t in loads), out
    assert re.search(r"^  vllm 127\.0\.0\.1:\d+ \(smollm2\)", out, re.M), out  # named by its server's address
    # the connector's own metrics beside vLLM's: the load that landed, its tokens, nothing failed
    own = {m[1]: float(m[2]) for m in re.finditer(r'^(kvpool:\w+)\{[^}]*\} ([0-9.e+]+)$', out, re.M)}
    assert own["kvpool:loaded_tokens_total"] == cached(a["pool"]) and own["kvpool:loads_total"] == 1, own
    assert own["kvpool:lookups_total"] >= 1 and own["kvpool:load_seconds_count"] == 1, own
    assert not any(k.startswith("kvpool:load_failures") for k in own), own


def test_the_router_finds_the_prompts_chunks_and_answers_the_same(run):
    steps, a, logs = run
    whole = a["cold"]["usage"]["prompt_tokens"] // CHUNK * CHUNK
    tiers = dict(kv.split("=") for kv in re.search(r"^x-kvpool-tiers: (\S+)", steps["6"], re.M | re.I)[1].split(","))
    # the text prompt tokenized as vLLM does (the miss is the rest of the prompt) and keyed as its connector does
    assert int(tiers["node"]) == whole and int(tiers["miss"]) == a["cold"]["usage"]["prompt_tokens"] - whole, steps["6"]
    assert re.search(r"^x-kvpool-instance: http://127\.0\.0\.1:\d+", steps["6"], re.M | re.I), steps["6"]
    assert tokens_and_logprobs(a["routed"]) == tokens_and_logprobs(a["hit"]), logs()


def test_the_printed_config_is_the_one_written_once(run):
    steps, _, _ = run
    printed = [json.loads(line) for line in steps["1"].splitlines() if line.startswith("{")]
    written = re.search(r"^KVCONFIG='(.*)'$", open(README).read(), re.M)[1]
    assert printed == [json.loads(written)], steps["1"]


def test_the_pool_is_gone_and_nothing_of_it_runs(run):
    steps, _, _ = run
    assert "kvpool is down: stopped the pool's process" in steps["7"], steps["7"]
    assert steps["left"] == [], steps["left"]


def test_the_wait_stops_when_the_server_exits(tmp_path):
    """The quickstart's wait for a server: a server that dies at start ends it at once, with its log."""
    define = re.search(r"^(wait_for_server\(\) \{.*?^\})", quickstart_blocks(open(README).read())[0], re.S | re.M)[1]
    (tmp_path / "vllm-8123.log").write_text("ValueError: the pool does not answer\n")
    script = f"{define}\nsleep 0.2 & DEAD=$!\nwait $DEAD\nwait_for_server 8123 $DEAD\n"
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "exited" in r.stdout and "the pool does not answer" in r.stdout, r
