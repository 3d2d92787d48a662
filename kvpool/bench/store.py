"""``kvpool bench store``: key hashing and chunk-store put/get against a plain copy, and each
eviction policy's cost per access against LRU's (kvpool.bench.policy_cost), same run.

Each trial times, back to back on the same bytes: a numpy copy, a torch copy (which uses every
intra-op thread), the store's put (copy in + xxh3-64), get (copy out + verify) and zero-copy read
(verify in place). Ratios are taken within a trial and the median over trials is reported, so a
noisy neighbour slows both sides of a ratio alike.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kvpool.bench.policy_cost import bench_policy_cost, format_lines
from kvpool.keys import Namespace, chunk_keys
from kvpool.progress import Progress
from kvpool.spec import KVSpec
from kvpool.store import ChunkStore, StoreConfig
from kvpool.tenants import Tenant, TenantRegistry

LLAMA3_8B = KVSpec("meta-llama/Meta-Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128,
                   dtype="bfloat16", block_size=16, chunk_tokens=256)


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def bench_hashing(prompt_tokens: int = 128 * 1024, chunk_tokens: int = 256, reps: int = 30) -> dict:
    ns = Namespace.for_spec(LLAMA3_8B, b"bench")
    tokens = np.random.default_rng(0).integers(0, 128000, prompt_tokens).astype(np.int32)
    as_list = tokens.tolist()
    chunk_keys(tokens, ns, chunk_tokens)
    arr_s = statistics.median(_timed(lambda: chunk_keys(tokens, ns, chunk_tokens)) for _ in range(reps))
    list_s = statistics.median(_timed(lambda: chunk_keys(as_list, ns, chunk_tokens)) for _ in range(max(3, reps // 5)))
    return {
        "hash_prompt_tokens": prompt_tokens,
        "hash_ms": arr_s * 1e3,
        "hash_tokens_per_s": prompt_tokens / arr_s,
        "hash_from_list_ms": list_s * 1e3,
    }


def bench_store(spec: KVSpec = LLAMA3_8B, chunks: int = 8, trials: int = 7, progress: bool = True) -> dict:
    nb = spec.chunk_nbytes
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, nb, dtype=np.uint8)
    srcs = []
    for i in range(chunks):
        s = base.copy()
        s[: 8] = i  # distinct payloads without paying for fresh random bytes each
        srcs.append(s)
    outs = [np.empty(nb, dtype=np.uint8) for _ in range(chunks)]
    t_srcs = [torch.from_numpy(s) for s in srcs]
    t_outs = [torch.from_numpy(o) for o in outs]
    store = ChunkStore(StoreConfig(nb, chunks), TenantRegistry([Tenant("bench")]))
    keys = chunk_keys(np.arange(chunks * spec.chunk_tokens), Namespace.for_spec(spec, b"bench"), spec.chunk_tokens)

    def copy_np():
        for s, o in zip(srcs, outs):
            np.copyto(o, s)

    def copy_torch():
        for s, o in zip(t_srcs, t_outs):
            o.copy_(s)

    def put():
        store.put_many(keys, srcs, "bench")

    def get():
        got = store.get_many(keys, "bench", outs)
        assert all(g is not None for g in got)

    def read():
        for k in keys:
            store.read(k, "bench").release()

    # Warm-up: fault in every page of the slab and the buffers, and check correctness once.
    put(), get(), read(), copy_np(), copy_torch()
    assert np.array_equal(outs[-1], srcs[-1])
    store.remove_many(keys, "bench")

    rows: dict[str, list[float]] = {k: [] for k in ("np", "torch", "put", "get", "read")}
    with Progress(trials, "bench store", enabled=progress) as bar:
        for _ in range(trials):
            rows["np"].append(_timed(copy_np))
            rows["torch"].append(_timed(copy_torch))
            rows["put"].append(_timed(put))
            rows["get"].append(_timed(get))
            rows["read"].append(_timed(read))
            metadata = store.metadata_bytes()
            store.remove_many(keys, "bench")
            bar.advance()
    total = nb * chunks
    med = lambda xs: statistics.median(xs)  # noqa: E731

    def ratio(op: str, base: str) -> float:
        return med([rows[base][i] / rows[op][i] for i in range(trials)])

    def vs_copy(op: str) -> float:  # against the faster plain copy of each trial
        return med([min(rows["np"][i], rows["torch"][i]) / rows[op][i] for i in range(trials)])

    store.close()
    return {
        "chunk_bytes": nb,
        "chunks": chunks,
        "trials": trials,
        "copy_numpy_gbps": total / med(rows["np"]) / 1e9,
        "copy_torch_gbps": total / med(rows["torch"]) / 1e9,
        "torch_threads": torch.get_num_threads(),
        "put_gbps": total / med(rows["put"]) / 1e9,
        "get_gbps": total / med(rows["get"]) / 1e9,
        "read_gbps": total / med(rows["read"]) / 1e9,
        "put_vs_copy": vs_copy("put"),
        "get_vs_copy": vs_copy("get"),
        "read_vs_copy": vs_copy("read"),
        "put_vs_numpy_copy": ratio("put", "np"),
        "get_vs_numpy_copy": ratio("get", "np"),
        "metadata_overhead": metadata / total,
        "metadata_bytes_per_chunk": metadata / chunks,
    }


def run(chunks: int = 8, trials: int = 7, hash_reps: int = 30, progress: bool = True, spec: KVSpec = LLAMA3_8B,
        policy_rounds: int = 3) -> dict:
    out = {"spec": spec.to_dict()}
    out.update(bench_hashing(reps=hash_reps))
    out.update(bench_store(spec, chunks, trials, progress))
    if policy_rounds:
        out.update(bench_policy_cost(rounds=policy_rounds, progress=progress))
    return out


def format_table(r: dict) -> str:
    mib = r["chunk_bytes"] / 2**20
    lines = [
        f"chunk: {mib:.0f} MiB ({r['spec']['model_id']}, {r['spec']['chunk_tokens']} tokens), "
        f"{r['chunks']} chunks x {r['trials']} trials",
        f"{'operation':<34}{'GB/s':>8}{'vs copy':>10}",
        f"{'plain numpy copy':<34}{r['copy_numpy_gbps']:>8.2f}",
        f"{'plain torch copy (' + str(r['torch_threads']) + ' threads)':<34}{r['copy_torch_gbps']:>8.2f}",
        f"{'put (copy in + xxh3-64)':<34}{r['put_gbps']:>8.2f}{r['put_vs_copy']:>10.2f}",
        f"{'get (copy out + verify)':<34}{r['get_gbps']:>8.2f}{r['get_vs_copy']:>10.2f}",
        f"{'read (zero-copy, verify in place)':<34}{r['read_gbps']:>8.2f}{r['read_vs_copy']:>10.2f}",
        f"get vs numpy copy {r['get_vs_numpy_copy']:.2f}, put vs numpy copy {r['put_vs_numpy_copy']:.2f}",
        f"metadata: {r['metadata_bytes_per_chunk']:.0f} B per chunk = {r['metadata_overhead']:.2e} of payload",
        f"key hashing: {r['hash_prompt_tokens']} tokens in {r['hash_ms']:.3f} ms "
        f"({r['hash_tokens_per_s'] / 1e6:.0f} M tokens/s); from a Python list {r['hash_from_list_ms']:.2f} ms",
    ]
    if "policy_cost_blocks" in r:
        lines += format_lines(r)
    return "\n".join(lines)
