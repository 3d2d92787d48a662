"""Whether a checkpoint folder still holds the weights a loaded model has: a sample of both.

A folder's files fingerprint names what is on disk *now*; a model loaded from it earlier holds
what was on disk *then*. A fine-tune saved over its base in between would lend the base model the
fine-tune's fingerprint, and each would load the other's KV. So before the transformers
connector keys a model by its folder's files, it compares a sample of the files' tensors with
the model's own: from every parameter, 4 runs of 16 elements at positions derived from the
tensor's name (a few hundred small reads for a whole checkpoint, whatever its size). A changed
tensor differs almost everywhere, so a sample tells two checkpoints apart.

The folder vouches for the model only when **every** parameter of the model is found in its
files (by name, shape and readable dtype) and every sampled element is equal once cast to the
model's dtype (the cast the loader made). Anything else (a parameter the files lack, renamed on
load, quantized, sharded, offloaded; a file format read here only as bytes) is "cannot vouch",
and the model is keyed by its tensors instead: a miss for cross-engine sharing, never wrong KV.
Readable formats: safetensors, and torch's zip checkpoints (``.bin``, ``.pt``, ``.pth``).
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys

import torch
import xxhash

RUNS = 4  # sampled runs per tensor
RUN = 16  # elements per run
_HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def sample_positions(name: str, numel: int) -> list[int]:
    """Where the runs of ``name`` start: fixed by the name, so both sides read the same elements."""
    span = max(1, numel - RUN + 1)
    return sorted({xxhash.xxh3_64_intdigest(f"{name}#{i}".encode()) % span for i in range(RUNS)})


def mismatch(folder: str, files: list[str], model) -> str | None:
    """None when a sample of ``folder``'s weight ``files`` equals ``model``'s parameters and covers
    all of them; else why the folder cannot vouch for the model."""
    params, names = _parameters(model)
    if not params:
        return f"{type(model).__name__} has no parameters to compare"
    prefix = getattr(model, "base_model_prefix", "") or ""
    renames = _renames(model)
    seen: set[str] = set()
    for rel in files:
        reader = _READERS.get(os.path.splitext(rel)[1])
        if reader is None:
            continue
        try:
            for tname, shape, runs in reader(os.path.join(folder, rel)):
                name = _match(tname, names, prefix, renames)
                if name is None or tuple(params[name].shape) != shape or params[name].device.type == "meta":
                    continue
                if runs:  # one gather and one comparison per tensor
                    where = torch.cat([torch.arange(pos, pos + v.numel()) for pos, v in runs])
                    mine = params[name].detach().reshape(-1)[where.to(params[name].device)].cpu()
                    theirs = torch.cat([v for _, v in runs]).to(mine.dtype)
                    if not torch.equal(_bits(theirs), _bits(mine)):
                        return f"parameter {name} differs from {rel}"
                seen.add(name)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError, struct.error) as e:
            return f"{rel} cannot be read as a checkpoint ({type(e).__name__}: {e})"
    missing = [n for n in params if n not in seen]
    if missing:
        return f"{len(missing)} of its {len(params)} parameters are not in the folder's files (e.g. {missing[0]})"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (equal bits, so NaNs and signed zeros compare as they are stored)."""
    return t.contiguous().view(torch.uint8)


def _parameters(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the model's parameters by name, one name per storage; every name of a parameter -> that
    one name: tied weights are one parameter under two names). Buffers are left out: they come
    from the config (masks, rotary tables), not the checkpoint."""
    params, names, by_storage = {}, {}, {}
    for name, t in model.named_parameters(remove_duplicate=False):
        key = (t.device.type, t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t),
               t.storage_offset(), tuple(t.shape))
        first = by_storage.setdefault(key, name)
        names[name] = first
        if first == name:
            params[name] = t  # on "meta" (offloaded, not materialized): never read, so never matched
    return params, names


def _renames(model) -> list[tuple[re.Pattern, str]]:
    """The renames transformers applies to a checkpoint's names when it loads this model (e.g.
    GPT-NeoX's ``embed_out`` is its ``lm_head``). Its merges (MoE experts fused into one tensor)
    are not followed: those parameters stay unmatched, and the folder cannot vouch."""
    if "transformers.modeling_utils" not in sys.modules:
        return []  # not a transformers model (its loading imported that), and importing it costs seconds
    try:
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping

        rules = get_model_conversion_mapping(model) or []
    except Exception:  # noqa: BLE001 - another transformers, or none: names as they are
        return []
    out = []
    for rule in rules:
        if isinstance(rule, WeightRenaming):
            for src, dst in zip(rule.source_patterns, rule.target_patterns):
                out.append((re.compile(src), dst))
    return out


def _match(name: str, names: dict[str, str], prefix: str, renames: list[tuple[re.Pattern, str]]) -> str | None:
    """The model's parameter a file's tensor is: its name, as transformers renames it on load, or
    either with the model's base prefix added or removed (a base checkpoint under a head model)."""
    renamed = name
    for pattern, target in renames:
        renamed = pattern.sub(target, renamed)
    for base in dict.fromkeys((name, renamed)):
        for cand in (base, f"{prefix}.{base}" if prefix else None,
                     base[len(prefix) + 1:] if prefix and base.startswith(prefix + ".") else None):
            if cand is not None and cand in names:
                return names[cand]
    return None


def _safetensors_runs(path: str):
    """(tensor name, shape, [(position, values)]) for each tensor of a safetensors file, read with
    a few small preads (the header, then each run)."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > min(_HEADER_MAX, size - 8):
            raise ValueError(f"a header of {n} bytes in a file of {size}")
        header = json.loads(os.pread(fd, n, 8))
        for tname, meta in header.items():
            dtype = _ST_DTYPES.get(meta.get("dtype")) if tname != "__metadata__" else None
            if dtype is None:
                continue
            shape = tuple(int(d) for d in meta["shape"])
            numel = _numel(shape)
            item = torch.empty((), dtype=dtype).element_size()
            start, end = (int(x) for x in meta["data_offsets"])
            if end - start != numel * item or 8 + n + end > size:
                raise ValueError(f"tensor {tname} spans bytes {start}..{end}, not {numel} x {item} inside the file")
            runs = []
            for pos in sample_positions(tname, numel) if numel else ():
                count = min(RUN, numel - pos)
                raw = os.pread(fd, count * item, 8 + n + start + pos * item)
                runs.append((pos, torch.frombuffer(bytearray(raw), dtype=dtype)))
            yield tname, shape, runs


def _torch_runs(path: str):
    """The same for torch's zip checkpoints, memory-mapped (only the sampled pages are read)."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a state dict")
    for tname, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        flat = t.reshape(-1)
        runs = [(pos, flat[pos: pos + RUN].clone()) for pos in (sample_positions(tname, t.numel()) if t.numel() else ())]
        yield tname, tuple(t.shape), runs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_READERS = {".safetensors": _safetensors_runs, **{s: _torch_runs for s in _TORCH_SUFFIXES}}
