"""Keys bound to the weights: two checkpoints that differ in any tensor never share a chunk,
whatever their names and paths; the same weights always do; the fingerprint of a checkpoint
folder is paid once per file and cached by the file's identity."""

from __future__ import annotations

import json
import os

import pytest
import torch
import zoo

from kvpool.connectors import weights as W
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.pools import close_local_pools
from kvpool.errors import BadRequest

POOL = {"chunk_tokens": zoo.CHUNK, "dram_mib": 16, "pool": "weights"}


@pytest.fixture(autouse=True)
def fresh_pool():
    close_local_pools()
    yield
    close_local_pools()


def load(folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def loaded_tokens(model, ids, **kw) -> int:
    return HFConnector(model, config=POOL, model_id="org/same-name", **kw).prefill(ids).loaded_tokens


def test_a_checkpoint_saved_over_another_misses_and_the_same_weights_hit(tmp_path):
    folder = str(tmp_path / "ckpt")
    ids = zoo.prompt(3 * zoo.CHUNK + 2, seed=1)
    zoo.build("llama", seed=0).save_pretrained(folder)
    base = load(folder)
    assert loaded_tokens(base, ids) == 0
    assert loaded_tokens(load(folder), ids) == 3 * zoo.CHUNK  # the same folder, reloaded: a hit
    zoo.build("llama", seed=1).save_pretrained(folder)  # a fine-tune saved over its base: same name, path, shape
    tuned = load(folder)
    assert loaded_tokens(tuned, ids) == 0
    spec = HFConnector(tuned, config=POOL, model_id="org/same-name").spec
    assert spec.weights == W.files_fingerprint(folder) and spec.weights.startswith("files:")


def test_unnamed_models_of_one_shape_never_share_and_identical_ones_do():
    ids = zoo.prompt(2 * zoo.CHUNK + 3, seed=2)
    assert loaded_tokens(zoo.build("llama", seed=0), ids) == 0
    assert loaded_tokens(zoo.build("llama", seed=5), ids) == 0  # same class, config, name: other tensors
    assert loaded_tokens(zoo.build("llama", seed=0), ids) == 2 * zoo.CHUNK  # the same tensors: a hit
    changed = zoo.build("llama", seed=0)
    with torch.no_grad():
        changed.model.norm.weight[0] += 1e-3  # one element of one tensor
    assert loaded_tokens(changed, ids) == 0


def test_a_model_whose_config_differs_from_its_folder_is_fingerprinted_by_its_tensors(tmp_path):
    folder = str(tmp_path / "ckpt")
    zoo.build("mistral", seed=0).save_pretrained(folder)
    plain = HFConnector(load(folder), config=POOL).spec
    other = HFConnector(load(folder, sliding_window=zoo.WINDOW + 8), config=POOL).spec
    assert plain.weights.startswith("files:") and other.weights.startswith("tensors:")
    assert plain.fingerprint() != other.fingerprint()


def test_users_who_know_better_name_the_weights_themselves():
    ids = zoo.prompt(2 * zoo.CHUNK + 1, seed=3)
    assert loaded_tokens(zoo.build("llama", seed=0), ids, weights="org/model@abc123") == 0
    # NOTE: the override is trusted: another model under the same name loads these chunks.
    assert loaded_tokens(zoo.build("llama", seed=0), ids, weights="org/model@abc123") == 2 * zoo.CHUNK
    assert loaded_tokens(zoo.build("llama", seed=0), ids, weights="org/model@def456") == 0
    with pytest.raises(BadRequest, match="weights"):
        HFConnector(zoo.build("llama"), config=POOL, weights="files")  # not loaded from a folder


def test_the_fingerprint_is_cached_by_file_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model-1.safetensors").write_bytes(os.urandom(1 << 20))
    (folder / "model-2.safetensors").write_bytes(os.urandom(1 << 20))
    (folder / "tokenizer.json").write_text("{}")  # not a weight: never read
    hashed = []
    real = W.hash_file
    monkeypatch.setattr(W, "hash_file", lambda path, progress=None: hashed.append(os.path.basename(path)) or
                        real(path, progress))
    first = W.files_fingerprint(folder)
    assert sorted(hashed) == ["config.json", "model-1.safetensors", "model-2.safetensors"]
    hashed.clear()
    assert W.files_fingerprint(folder) == first and hashed == []  # a restart: stat only
    (folder / "tokenizer.json").write_text('{"x": 1}')
    assert W.files_fingerprint(folder) == first and hashed == []
    data = bytearray((folder / "model-2.safetensors").read_bytes())
    data[12345] ^= 1  # one bit, rewritten in place
    (folder / "model-2.safetensors").write_bytes(bytes(data))
    second = W.files_fingerprint(folder)
    assert second != first and hashed == ["model-2.safetensors"]
    (folder / "config.json").write_text('{"a": 2}')  # the architecture changed: another fingerprint
    assert W.files_fingerprint(folder) not in (first, second)
    cache = tmp_path / "cache" / "weights-v1.json"
    cache.write_text("{not json")  # a damaged cache is hashed again, never trusted
    hashed.clear()
    assert W.files_fingerprint(folder) == W.files_fingerprint(folder, use_cache=False)
    assert len(hashed) == 6 and json.loads(cache.read_text())


def test_a_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadRequest, match="no weight files"):
        W.files_fingerprint(tmp_path)
    with pytest.raises(BadRequest, match="model_weights"):
        W.weights_of_folder(str(tmp_path), None, None, engine="vLLM")
    assert W.weights_of_folder("org/not-cached", None, "mine", engine="vLLM") == "given:mine"


def test_an_engine_refuses_a_checkpoint_that_changed_since_it_loaded_it(tmp_path):
    """vLLM and SGLang never see the weights: the files fingerprint is theirs only if no file
    changed since the engine began loading (noted by kvpool's vLLM plugin), or, with no note,
    since the process started."""
    folder = str(tmp_path / "ckpt")
    zoo.build("llama", seed=0).save_pretrained(folder)
    # written after this process started, and no engine noted loading it: refused, with the fix
    with pytest.raises(BadRequest, match="changed after this engine process started.*model_weights"):
        W.weights_of_folder(folder, None, None, engine="vLLM")
    W.note_loading(folder)  # what the plugin does as vLLM starts loading
    first = W.weights_of_folder(folder, None, None, engine="vLLM")
    assert first == W.files_fingerprint(folder)
    zoo.build("llama", seed=1).save_pretrained(folder)  # a fine-tune saved over it while the engine runs
    with pytest.raises(BadRequest, match="changed after this engine began loading it.*Restart the engine"):
        W.weights_of_folder(folder, None, None, engine="vLLM")
    W.note_loading(folder)  # the engine restarted and loaded the new checkpoint
    assert W.weights_of_folder(folder, None, None, engine="vLLM") not in (first, None)
    assert W.weights_of_folder(folder, None, "mine@abc", engine="vLLM") == "given:mine@abc"  # named: trusted


def test_the_process_start_is_read_from_proc():
    import subprocess
    import sys
    import time

    assert 0 < time.time_ns() - W.process_start_ns() < 24 * 3600 * 10**9
    # a child's start, as it reads it, lies between the moments before and after it was started
    before = time.time_ns()
    out = subprocess.run([sys.executable, "-c", "from kvpool.connectors.weights import process_start_ns as p;"
                          "print(p())"], capture_output=True, text=True, check=True).stdout
    assert before - 50_000_000 <= int(out) <= time.time_ns()


def test_vllms_loaders_note_the_checkpoint_before_loading(tmp_path, monkeypatch):
    """kvpool's vLLM plugin (run by vLLM in each of its processes) wraps every model loader so that
    it notes the folder on entry, once, and still returns what the loader returns."""
    import types

    from kvpool.connectors import vllm_plugin

    class Base:
        def load_model(self, vllm_config, model_config, prefix=""):
            return ("loaded", model_config.model, dict(W._before_load))

    class Tensorizer(Base):
        def load_model(self, vllm_config, model_config, prefix=""):
            return super().load_model(vllm_config, model_config, prefix)

    loader_mod = types.ModuleType("vllm.model_executor.model_loader")
    loader_mod._LOAD_FORMAT_TO_MODEL_LOADER = {"auto": Base, "tensorizer": Tensorizer}
    base_mod = types.ModuleType("vllm.model_executor.model_loader.base_loader")
    base_mod.BaseModelLoader = Base
    for name, mod in [("vllm", types.ModuleType("vllm")), ("vllm.model_executor", types.ModuleType("vllm.model_executor")),
                      ("vllm.model_executor.model_loader", loader_mod),
                      ("vllm.model_executor.model_loader.base_loader", base_mod)]:
        monkeypatch.setitem(__import__("sys").modules, name, mod)
    monkeypatch.setattr(W, "_before_load", {})
    folder = str(tmp_path / "ckpt")
    zoo.build("llama", seed=0).save_pretrained(folder)
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins more than once: wrapped once
    calls = []
    real = W.note_loading
    monkeypatch.setattr(vllm_plugin, "note_loading", lambda *a: calls.append(a) or real(*a))
    config = types.SimpleNamespace(model=folder, revision=None)
    out = Tensorizer().load_model(vllm_config=None, model_config=config)
    assert out[0] == "loaded" and len(calls) == 1  # the subclass calling its base is noted once
    assert os.path.realpath(folder) in out[2]  # noted before the loader ran
    assert W.weights_of_folder(folder, None, None, engine="vLLM") == W.files_fingerprint(folder)


def test_a_loaded_models_folder_is_checked_by_a_sample_not_read_again(tmp_path, monkeypatch):
    """The check that a folder still holds a loaded model's weights reads a few runs of each
    tensor: a later start hashes nothing and reads a few KiB, whatever the checkpoint's size; a
    changed element the sample covers is found."""
    from kvpool.connectors import weights_sample

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    folder = str(tmp_path / "ckpt")
    zoo.build("llama", seed=0).save_pretrained(folder)
    model = load(folder)
    first, why = W.verified_files_fingerprint(folder, model)
    assert why is None and first == W.files_fingerprint(folder)
    hashed, read = [], []
    real_hash, real_pread = W.hash_file, os.pread
    monkeypatch.setattr(W, "hash_file", lambda *a: hashed.append(a) or real_hash(*a))
    monkeypatch.setattr(weights_sample.os, "pread", lambda fd, n, off: read.append(n) or real_pread(fd, n, off))
    assert W.verified_files_fingerprint(folder, model) == (first, None)
    params = len(list(model.parameters()))
    assert hashed == [] and sum(read) <= 8 + 64 * 1024 + params * weights_sample.RUNS * weights_sample.RUN * 4
    name, param = next((n, p) for n, p in model.named_parameters() if p.numel() > 1000)
    pos = weights_sample.sample_positions(name, param.numel())[0]
    with torch.no_grad():
        param.view(-1)[pos] += 1.0  # the model changed in memory where the sample looks
    fingerprint, why = W.verified_files_fingerprint(folder, model)
    assert fingerprint is None and name in why
