"""``kvpool bench index``: prefix lookup of a 128K-token prompt (512 chunk keys; ``--keys 4096``:
the same prompt's per-head slices of an 8-KV-head model, what a connector asks for) against Redis,
beside a plain MGET of the same keys (the floor: one round trip, no decoding) measured in the same
run, interleaved (a lookup of more than ``MAX_LOOKUP`` keys is asked in batches of it, as an
engine's client asks; the MGET takes them all in one); and publish throughput, pipelined in batches."""

from __future__ import annotations

import statistics
import time
import uuid

from kvpool.index.base import MAX_LOOKUP, IndexEntry
from kvpool.index.redis_index import RedisIndex
from kvpool.keys import Namespace, chunk_keys
from kvpool.progress import Progress
from kvpool.spec import KVSpec


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(url: str = "redis://127.0.0.1:6379/0", prompt_chunks: int = 512, reps: int = 2000,
        publish_chunks: int = 100_000, batch: int = 512, progress: bool = True) -> dict:
    idx = RedisIndex(url, prefix=f"kvpbench{uuid.uuid4().hex[:8]}", timeout_s=5.0, read_timeout_s=5.0)
    try:
        spec = KVSpec("bench", 32, 8, 128)
        keys = chunk_keys(range(prompt_chunks * 256), Namespace.for_spec(spec, b"bench"), 256)
        idx.add_tenant("bench")
        idx.register_shard("node-0", ttl_s=600)
        idx.publish([IndexEntry(k, "node-0", "dram", 32 << 20, "bench", i) for i, k in enumerate(keys)])
        raw_keys = [idx.keys.chunk(k) for k in keys]
        r = idx._r
        lookup, mget = [], []
        with Progress(reps, "bench index: lookup", enabled=progress) as bar:
            for i in range(reps):
                t0 = time.perf_counter()
                count = 0
                for j in range(0, len(keys), MAX_LOOKUP):  # as an engine's client asks: MAX_LOOKUP keys a call
                    count += idx.lookup(keys[j: j + MAX_LOOKUP]).count
                t1 = time.perf_counter()
                r.mget(raw_keys)
                t2 = time.perf_counter()
                assert count == prompt_chunks, count
                lookup.append(t1 - t0)
                mget.append(t2 - t1)
                if i % 100 == 99:
                    bar.advance(100)
        pub_keys = chunk_keys(range(publish_chunks), Namespace.for_spec(spec, b"pub"), 1)
        entries = [IndexEntry(k, "node-0", "dram", 1024, "bench", i) for i, k in enumerate(pub_keys)]
        t0 = time.perf_counter()
        with Progress(len(entries) // batch + 1, "bench index: publish", enabled=progress) as bar:
            pipe_batches = [entries[i : i + batch] for i in range(0, len(entries), batch)]
            for b in pipe_batches:
                idx.publish(b)
                bar.advance()
        pub_s = time.perf_counter() - t0
        return {
            "prompt_chunks": prompt_chunks,
            "reps": reps,
            "lookup_p50_ms": statistics.median(lookup) * 1e3,
            "lookup_p99_ms": _pct(lookup, 0.99) * 1e3,
            "mget_p50_ms": statistics.median(mget) * 1e3,
            "mget_p99_ms": _pct(mget, 0.99) * 1e3,
            "lookup_vs_mget_p50": statistics.median(lookup) / statistics.median(mget),
            "publish_per_s": len(entries) / pub_s,
            "publish_batch": batch,
            "url": idx.url,
        }
    finally:
        idx.flush()
        idx.close()


def format_table(r: dict) -> str:
    return "\n".join([
        f"index at {r['url']}: prefix lookup of {r['prompt_chunks']} keys, {r['reps']} reps",
        f"{'':<22}{'p50 ms':>10}{'p99 ms':>10}",
        f"{'kvpool lookup':<22}{r['lookup_p50_ms']:>10.3f}{r['lookup_p99_ms']:>10.3f}",
        f"{'plain MGET (floor)':<22}{r['mget_p50_ms']:>10.3f}{r['mget_p99_ms']:>10.3f}",
        f"lookup / MGET at p50: {r['lookup_vs_mget_p50']:.2f}x",
        f"publish: {r['publish_per_s']:,.0f} chunks/s (batches of {r['publish_batch']}, one Lua call each)",
    ])
