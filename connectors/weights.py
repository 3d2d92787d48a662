"""The weights' fingerprint: keys bound to what a checkpoint holds, not to what it is called.

A model's name and path are not its identity: a fine-tune saved over its base, two checkpoints
written one after the other to one folder, or two unnamed models of one shape would otherwise
load each other's KV. So every spec carries ``weights``, a content fingerprint:

- **files** (a checkpoint folder on disk, the usual case for every engine): xxh3-128 over each
  weight file and ``config.json`` (the architecture: windows, rope), combined in name order.
  transformers and vLLM that load one folder get one fingerprint and share chunks. A file's
  digest is cached under ``$KVPOOL_CACHE_DIR`` (default ``~/.cache/kvpool``) by its identity
  (real path, size, inode, device, mtime and ctime in ns): a restart pays a ``stat`` per file,
  and a file rewritten in place (new ctime) is hashed again.
- **tensors** (a model built or changed in memory, or one whose in-memory config differs from
  its folder's): xxh3-128 over every parameter and buffer (name, dtype, shape, bytes) and the
  config, in name order. Such a model shares chunks only with itself.
- an explicit string, for users who know better (``weights=`` / ``model_weights``).

The files describe the model only if they still hold what it loaded, so each engine checks that:

- transformers: a sample of the files' tensors must equal the loaded model's
  (:mod:`kvpool.connectors.weights_sample`), else the model is keyed by its tensors (a warning
  says why). A model changed in memory after loading (a training step, merged adapters) is caught
  the same way, as long as the sample sees the change: pass ``weights="tensors"`` to be sure.
- vLLM and SGLang (whose connectors never see the weights): no checkpoint file may have changed
  since the engine began loading it: :func:`note_loading` records the files just before the
  engine reads them (kvpool's vLLM plugin does it in every vLLM process; an embedder that loads a
  model in-process calls it itself), and without that record, since this process started. A
  change is refused at start with the fix (restart the engine, or name the weights).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time

import msgpack
import xxhash

from kvpool.errors import BadRequest
from kvpool.progress import Progress

log = logging.getLogger("kvpool.connectors.weights")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5", ".msgpack")
CONFIG_FILES = ("config.json",)
_READ = 16 << 20  # bytes per read while hashing
_SHOW_PROGRESS = 1 << 30  # a progress bar once a checkpoint holds this many bytes to hash
_CACHE_NAME = "weights-v1.json"
_lock = threading.Lock()


def checkpoint_files(folder: str) -> list[str]:
    """The files of a checkpoint folder that define its KV: weights (any depth) and config.json."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if name.endswith(WEIGHT_SUFFIXES) or rel in CONFIG_FILES:
                out.append(rel)
    return sorted(out)


def is_checkpoint(folder: object) -> bool:
    """Whether ``folder`` is a local folder holding at least one weight file."""
    return (isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder)
            and any(f.endswith(WEIGHT_SUFFIXES) for f in checkpoint_files(os.fspath(folder))))


def cache_dir() -> str:
    return os.environ.get("KVPOOL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvpool")


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


def _load_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache, or a damaged one: hash again


def _save_cache(path: str, data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".weights-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: every start hashes, nothing is wrong
        log.warning("kvpool: cannot write the weights fingerprint cache %s (%s); the next start hashes again", path, e)


def hash_file(path: str, progress: Progress | None = None) -> str:
    """xxh3-128 of a file's bytes, hex."""
    h = xxhash.xxh3_128()
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            if progress is not None:
                progress.advance(n)
    return h.hexdigest()


def files_fingerprint(folder: str | os.PathLike, *, use_cache: bool = True) -> str:
    """The fingerprint of a checkpoint folder's content (see the module docstring)."""
    folder = os.path.realpath(os.fspath(folder))
    files = checkpoint_files(folder)
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        raise BadRequest(f"{folder} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}): give the checkpoint folder, "
                         "or name the weights yourself (weights='my-model@sha')")
    cache_path = os.path.join(cache_dir(), _CACHE_NAME)
    with _lock:
        cache = _load_cache(cache_path) if use_cache else {}
        stats = {rel: os.stat(os.path.join(folder, rel)) for rel in files}
        todo = [rel for rel in files
                if (cache.get(os.path.join(folder, rel)) or [None])[:-1] != _identity(stats[rel])]
        total = sum(stats[rel].st_size for rel in todo)
        with Progress(total, f"kvpool: fingerprinting the weights in {folder}",
                      enabled=total >= _SHOW_PROGRESS) as bar:
            for rel in todo:
                path = os.path.join(folder, rel)
                digest = hash_file(path, bar)
                after = os.stat(path)
                if _identity(after) != _identity(stats[rel]):
                    raise BadRequest(f"{path} changed while it was being fingerprinted: start again once the "
                                     "checkpoint is written")
                cache[path] = [*_identity(after), digest]
        if todo and use_cache:
            _save_cache(cache_path, cache)
    parts = [[rel, stats[rel].st_size, cache[os.path.join(folder, rel)][-1]] for rel in files]
    return "files:" + xxhash.xxh3_128_hexdigest(msgpack.packb(parts))


def tensors_fingerprint(model) -> str:
    """The fingerprint of a torch module's parameters, buffers and config (see the module docstring)."""
    import torch

    h = xxhash.xxh3_128()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        h.update(json.dumps(config_fields(config.to_dict()), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach()
        h.update(msgpack.packb([name, str(t.dtype), list(t.shape)]))
        data = t.contiguous().cpu()
        if data.numel():
            h.update(data.reshape(-1).view(torch.uint8).numpy())
    return "tensors:" + h.hexdigest()


def config_fields(d: dict) -> dict:
    """A config's fields that describe the model (not where it came from or which library wrote it)."""
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in ("transformers_version", "name_or_path")}


def local_checkpoint(name_or_path: str, revision: str | None = None) -> str | None:
    """The local folder of a model: the path itself, or a Hugging Face hub id already in the local
    cache (never downloads); None when neither."""
    if is_checkpoint(name_or_path):
        return os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or name_or_path.count("/") != 1 or os.path.exists(name_or_path):
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name_or_path, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, no hub library, a bad id: no local checkpoint
        return None
    return folder if is_checkpoint(folder) else None


def weights_of_folder(name_or_path: str, revision: str | None, given: str | None, *, engine: str) -> str:
    """The weights fingerprint for an engine that serves ``name_or_path``: ``given`` when the user
    named the weights, else the folder's files, refused when a file changed since the engine
    loaded it (see the module docstring); refuses a model it cannot fingerprint."""
    if given:
        return check_given(given)
    folder = local_checkpoint(name_or_path, revision)
    if folder is None:
        raise BadRequest(f"kvpool cannot fingerprint the weights of {name_or_path!r} ({engine}): it is not a local "
                         "checkpoint folder nor in the local Hugging Face cache. Serve it from a folder, or name "
                         "its weights yourself (model_weights='<name>@<commit or hash>')")
    fingerprint = files_fingerprint(folder)
    changed, since = _changed_since_load(folder)  # after hashing: unchanged now means hashed as loaded
    if changed:
        raise BadRequest(f"{engine}: the checkpoint {folder} changed after this engine {since} "
                         f"({', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}), so its files may not "
                         "be the weights the engine holds and kvpool cannot key its KV by them. Restart the engine "
                         "once the checkpoint is written (or serve each checkpoint from its own folder), or name the "
                         "weights yourself (model_weights='<name>@<commit or hash>')")
    return fingerprint


# real path of a checkpoint folder -> its files' identities just before an engine in this process read them
_before_load: dict[str, dict[str, list[int]]] = {}


def note_loading(name_or_path: str, revision: str | None = None) -> None:
    """Records a checkpoint's files just before an engine in this process loads them (kvpool's vLLM
    plugin calls it; call it yourself before loading a model in-process for SGLang's backend)."""
    folder = local_checkpoint(name_or_path, None if revision in (None, "main") else revision)
    if folder is not None:
        real = os.path.realpath(folder)
        _before_load[real] = _identities(real)


def _identities(folder: str) -> dict[str, list[int]]:
    return {rel: _identity(os.stat(os.path.join(folder, rel))) for rel in checkpoint_files(folder)}


def _changed_since_load(folder: str) -> tuple[list[str], str]:
    """(the checkpoint's files that changed since this process's engine loaded them, what "since" is)."""
    real = os.path.realpath(folder)
    now = _identities(real)
    before = _before_load.get(real)
    if before is not None:
        return sorted(rel for rel in set(now) | set(before) if now.get(rel) != before.get(rel)), "began loading it"
    started = process_start_ns()
    return sorted(rel for rel, ident in now.items() if ident[-1] > started), "process started"


def process_start_ns() -> int:
    """When this process started, in ns since the epoch (from /proc, to 10 ms; 0 where unknown)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # no /proc: every file counts as changed, which refuses rather than guesses
    return time.time_ns() - int((uptime - ticks / os.sysconf("SC_CLK_TCK")) * 1e9)


def verified_files_fingerprint(folder: str, model) -> tuple[str | None, str | None]:
    """(the folder's files fingerprint, None) when a sample of its files equals ``model``'s
    parameters; (None, why not) else (:mod:`kvpool.connectors.weights_sample`)."""
    from kvpool.connectors.weights_sample import mismatch

    real = os.path.realpath(folder)
    fingerprint = files_fingerprint(real)
    why = mismatch(real, checkpoint_files(real), model)
    if why is None and files_fingerprint(real) != fingerprint:
        why = "its files changed while they were compared"
    return (fingerprint, None) if why is None else (None, why)


def check_given(weights: object) -> str:
    if not isinstance(weights, str) or not weights.strip():
        raise BadRequest(f"weights must name the model's weights (a non-empty string), got {weights!r}")
    return "given:" + weights
