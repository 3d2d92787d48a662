"""``kvpool bench weights``: what binding keys to the weights costs an engine's start.

A checkpoint of about ``--size-gib`` is simulated by one safetensors file shaped like Llama-3-8B
(32 layers of 9 tensors plus embeddings, 291 bf16 tensors, the hidden size scaled to the size;
random bytes), and the model loaded from it by tensors memory-mapped from that file. Each round,
side by side on that file:

- ``read``: reading it once from disk (the page cache dropped first): the baseline, what loading
  the checkpoint costs anyway;
- ``first start``: what the transformers connector does with an empty fingerprint cache (page
  cache dropped): the files fingerprint (every byte read and hashed) and the check that a sample
  of the files equals the model's tensors (:mod:`kvpool.connectors.weights_sample`);
- ``later start``: the same call with the fingerprint cache written by the first (a ``stat`` per
  file, then the sample), with the file in the page cache (an engine that has just loaded it) and
  with the page cache dropped (the sample's worst case: a few hundred reads from disk).

The page cache is dropped with ``posix_fadvise(DONTNEED)`` on the (fsynced, so clean) file: no
root needed, and nothing else on the machine is touched.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
import time
import types

import torch

from kvpool.connectors import weights as W
from kvpool.progress import Progress

_BLOCK = 64 << 20
LAYERS = 32


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def llama_shapes(size: int) -> dict[str, tuple[int, ...]]:
    """Llama-3-8B's tensors (GQA 4:1, MLP 3.5x, vocabulary 31.3x the hidden size) with the hidden
    size that makes them about ``size`` bytes in bf16 (a multiple of 128, at least 128)."""
    per_h2 = LAYERS * (2 + 2 / 4 + 3 * 3.5) + 2 * 31.3  # elements per hidden**2
    h = max(128, int((size / 2 / per_h2) ** 0.5) // 128 * 128)
    kv, mlp, vocab = h // 4, int(3.5 * h) // 128 * 128, int(31.3 * h) // 128 * 128
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (mlp, h), p + "mlp.up_proj.weight": (mlp, h),
                       p + "mlp.down_proj.weight": (h, mlp), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (vocab, h)})
    return shapes


def _write(path: str, shapes: dict[str, tuple[int, ...]], progress: bool) -> int:
    """A safetensors file of bf16 ``shapes`` holding random bytes; its size."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = os.urandom(_BLOCK)
    with open(path, "wb") as f, Progress(offset, f"writing a {offset / 2**30:.1f} GiB checkpoint",
                                         enabled=progress) as p:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            n = min(left, _BLOCK)
            f.write(block[:n] if n < _BLOCK else block)
            left -= n
            p.advance(n)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _loaded_model(path: str, shapes: dict[str, tuple[int, ...]]):
    """The model as the check sees one (its named parameters), each tensor memory-mapped from the
    file: the weights a loader put in memory, without holding the whole checkpoint in RAM here."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    params = [(name, torch.frombuffer(mapped, dtype=torch.bfloat16, count=_numel(shape),
                                      offset=8 + n + header[name]["data_offsets"][0]).view(shape))
              for name, shape in shapes.items()]
    return types.SimpleNamespace(named_parameters=lambda remove_duplicate=False: iter(params), mapped=mapped)


def _read(path: str) -> None:
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def run(size_gib: float = 16.0, rounds: int = 3, folder: str | None = None, progress: bool = True) -> dict:
    size = int(size_gib * (1 << 30))
    if size <= 0 or rounds <= 0:
        raise ValueError("--size-gib and --rounds must be positive")
    base = tempfile.mkdtemp(prefix="kvpool-bench-weights-", dir=folder or "/var/tmp")
    ckpt, cache = os.path.join(base, "ckpt"), os.path.join(base, "cache")
    os.makedirs(ckpt)
    saved_env = os.environ.get("KVPOOL_CACHE_DIR")
    os.environ["KVPOOL_CACHE_DIR"] = cache
    rows = []
    try:
        path = os.path.join(ckpt, "model.safetensors")
        shapes = llama_shapes(size)
        if shutil.disk_usage(base).free < size * 1.1:
            raise ValueError(f"{base} has {shutil.disk_usage(base).free >> 30} GiB free; the benchmark writes "
                             f"{size_gib} GiB: pass --dir on a larger disk or a smaller --size-gib")
        written = _write(path, shapes, progress)
        with open(os.path.join(ckpt, "config.json"), "w") as f:
            f.write('{"architectures": ["LlamaForCausalLM"]}')
        model = _loaded_model(path, shapes)
        for r in range(rounds):
            _drop_page_cache(path)
            read_s = _timed(_read, path)
            shutil.rmtree(cache, ignore_errors=True)
            _drop_page_cache(path)
            first_s, first = _timed_check(ckpt, model)
            later_s, later = _timed_check(ckpt, model)
            _drop_page_cache(path)
            cold_s, cold = _timed_check(ckpt, model)
            assert first == later == cold and first.startswith("files:")
            rows.append({"round": r + 1, "read_s": read_s, "first_start_s": first_s, "later_start_s": later_s,
                         "later_cold_s": cold_s, "first_vs_read": first_s / read_s,
                         "first_gbps": written / first_s / 1e9, "read_gbps": written / read_s / 1e9})
            if progress:
                print(f"round {r + 1}/{rounds}: read {read_s:.1f} s, first start {first_s:.1f} s, later start "
                      f"{later_s * 1e3:.2f} ms ({cold_s * 1e3:.1f} ms from disk)", file=sys.stderr, flush=True)
        model.mapped.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if saved_env is None:
            os.environ.pop("KVPOOL_CACHE_DIR", None)
        else:
            os.environ["KVPOOL_CACHE_DIR"] = saved_env
    return {"size_gib": size_gib, "bytes": written, "tensors": len(shapes), "hidden": shapes["model.norm.weight"][0],
            "rounds": rows}


def _timed(fn, *args) -> float:
    gc.collect()  # NOTE: a pending collection of the whole heap (0.1-0.2 s here) is not the call's cost
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _timed_check(ckpt: str, model) -> tuple[float, str]:
    """What the transformers connector pays to key a model by its folder (the fingerprint, then the sample)."""
    gc.collect()
    t = time.perf_counter()
    fingerprint, why = W.verified_files_fingerprint(ckpt, model)
    assert why is None, why
    return time.perf_counter() - t, fingerprint


def format_table(result: dict) -> str:
    rows = result["rounds"]
    lines = [f"weights fingerprint and sample check of a {result['bytes'] / 2**30:.1f} GiB checkpoint "
             f"({result['tensors']} bf16 tensors, hidden {result['hidden']}; {len(rows)} rounds)",
             f"{'round':>5} {'read (s)':>9} {'first start (s)':>16} {'first/read':>10} {'GB/s':>6} "
             f"{'later start (ms)':>17} {'later, from disk (ms)':>22}"]
    for r in rows:
        lines.append(f"{r['round']:>5} {r['read_s']:>9.1f} {r['first_start_s']:>16.1f} {r['first_vs_read']:>10.2f} "
                     f"{r['first_gbps']:>6.2f} {r['later_start_s'] * 1e3:>17.2f} {r['later_cold_s'] * 1e3:>22.1f}")
    return "\n".join(lines)
