"""``kvpool bench quality``: what the lossy storage formats and token eviction cost in quality.

On the real model (SmolLM2-135M-Instruct, float32, :mod:`kvpool.connectors.demo.smollm2`) and real
English text (Python's reference manual, :mod:`kvpool.connectors.bench.quality_text`), each passage is
cut into a context (``context`` tokens) and a continuation (``scored`` tokens). The reference is
the model's own KV of the context. Each row holds the context's KV another way and measures:

- ``bytes_ratio``: bytes held over the raw KV's bytes. A format: one stored chunk's payloads
  (codes, scales, a header per KV head's slice) over the raw float32 chunk, as the pool pages
  it; ``bytes_ratio_16bit`` the same payload quantized from a 16-bit chunk (what GPU engines hold) over that chunk. An
  eviction method: tokens kept over context tokens (raw KV either way, so both ratios are equal);
- ``ppl_ratio``: perplexity of the continuation with this KV over perplexity with the model's own
  (each continuation token scored given the true tokens before it);
- ``kl``: mean over the scored positions of KL(raw || this) of the next-token distributions;
- ``greedy_match``: each KV generates ``greedy`` tokens greedily from the end of the context, on
  its own (each from its own earlier tokens); the fraction of positions where the two sequences
  hold the same token. ``greedy_prefix``: the fraction before their first difference. Both are
  means over the passages.

Formats go through the pool's own save and load path: one :class:`HFConnector` prefills the
context and saves its whole chunks (quantized by the pool's codec), a second connector on the
same pool serves a fresh request for the context, loading every chunk (the context's tokens but
its last: the connector always computes the last token, whose logits it needs) and computing the
rest (a partial last chunk is never stored). The ``raw`` row is the same path in the exact format:
it should match the reference to float rounding. Eviction rows compress the model's own KV of the
context but its last token with :mod:`kvpool.connectors.compress` to a token budget (per layer and
KV head), then run the last token and the continuation on it at their original positions
(PyramidKV and AdaKV, which keep different counts per layer or head, through its masked
attention: no connector stores those, see that module).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import uuid
from dataclasses import dataclass

import torch

from kvpool.codec import stored_nbytes
from kvpool.connectors.bench import quality_text
from kvpool.connectors.hf import HFConnector
from kvpool.connectors.hf_model import cache_argument, model_spec
from kvpool.errors import BadRequest
from kvpool.progress import Progress

FORMATS = ("fp8", "int8", "int4-kivi", "int2-kivi")
# The targets: format -> (most bytes_ratio, most ppl_ratio).
TARGETS = {"fp8": (0.5, 1.02), "int4-kivi": (0.27, 1.10)}
WEIGHTS = "smollm2-135m-instruct-q4_1-gguf-float32"  # names the weights: no fingerprint pass per connector


@dataclass(frozen=True)
class Settings:
    context: int = 1024  # tokens of each passage before the scored ones
    scored: int = 128  # continuation tokens scored for ppl_ratio and kl
    greedy: int = 64  # tokens each KV generates for greedy_match
    prompts: int = 3  # passages
    chunk_tokens: int = 256
    formats: tuple[str, ...] = FORMATS
    methods: tuple[str, ...] | None = None  # eviction methods; None: all that kvpool.connectors.compress has
    budgets: tuple[float, ...] = (0.5, 0.25, 0.125)  # eviction budgets, as fractions of the context
    # NOTE: torch threads while it runs; on the shared 2-core machine under load, decoding ran 7-10x
    # faster on one thread than on two (the figures do not depend on it; only the time does).
    threads: int = 1

    def check(self) -> Settings:
        for name in ("context", "scored", "greedy", "prompts", "chunk_tokens", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadRequest(f"--{name.replace('_', '-')} must be a whole number >= 1, got {v!r}")
        if self.context <= self.chunk_tokens:
            raise BadRequest(f"--context {self.context} holds no whole chunk of {self.chunk_tokens} tokens: the pool "
                             "would store nothing; raise --context or lower --chunk-tokens")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown:
            raise BadRequest(f"--formats: unknown {unknown}; choose from {', '.join(FORMATS)}")
        if self.methods:
            from kvpool.connectors.compress import METHODS

            if any(m not in METHODS for m in self.methods):
                raise BadRequest(f"--methods: unknown {[m for m in self.methods if m not in METHODS]}; choose from "
                                 f"{', '.join(METHODS)}")
        if any(not 0 < b < 1 for b in self.budgets):
            raise BadRequest(f"--budgets are fractions of the context in (0, 1), got {list(self.budgets)}")
        return self


QUICK = Settings(context=160, scored=16, greedy=8, prompts=1, chunk_tokens=64, budgets=(0.5,))


# ------------------------------------------------------------------------------------- measuring one KV
@dataclass
class Outcome:
    logprobs: torch.Tensor  # [scored, vocab] float64: next-token log-probabilities at the scored positions
    greedy: list[int]


class Continuation:
    """A KV of the context to continue from: ``last`` (the logits after the context) and ``step(ids)``,
    which runs ``ids`` on the KV (growing it) and returns their logits ``[len(ids), vocab]``."""

    def __init__(self, model, cache, last: torch.Tensor | None) -> None:
        self.model, self.cache, self.last = model, cache, last

    def step(self, ids: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_argument(self.model): self.cache})
        return out.logits[0]

    def fork(self) -> Continuation:
        return Continuation(self.model, copy.deepcopy(self.cache), self.last)


@torch.no_grad()
def measure(state: Continuation, continuation: list[int], greedy: int) -> Outcome:
    """The scored log-probabilities of ``continuation`` and ``greedy`` greedy tokens, from ``state``."""
    free = state.fork()
    tokens = [int(free.last.argmax())]
    while len(tokens) < greedy:
        tokens.append(int(free.step(tokens[-1:])[-1].argmax()))
    logits = torch.cat([state.last[None], state.step(continuation[:-1])]) if len(continuation) > 1 else state.last[None]
    return Outcome(torch.log_softmax(logits.double(), dim=-1), tokens)


def compare(ref: Outcome, got: Outcome, targets: list[int]) -> dict:
    """Per-passage sums: NLLs of both, KL(ref || got) and the greedy agreement."""
    idx = torch.tensor(targets)[:, None]
    nll_ref = -ref.logprobs.gather(1, idx).sum().item()
    nll_got = -got.logprobs.gather(1, idx).sum().item()
    kl = (ref.logprobs.exp() * (ref.logprobs - got.logprobs)).sum(-1).sum().item()
    same = [a == b for a, b in zip(ref.greedy, got.greedy)]
    prefix = same.index(False) if False in same else len(same)
    return {"nll_ref": nll_ref, "nll": nll_got, "kl": kl, "match": sum(same) / len(same),
            "prefix": prefix / len(same), "n": len(targets)}


def summarize(parts: list[dict]) -> dict:
    """One row's figures over the passages: perplexities of all scored tokens together."""
    n = sum(p["n"] for p in parts)
    ppl_ratio = torch.tensor((sum(p["nll"] for p in parts) - sum(p["nll_ref"] for p in parts)) / n).exp().item()
    return {"ppl_ratio": round(ppl_ratio, 5), "kl": round(sum(p["kl"] for p in parts) / n, 6),
            "greedy_match": round(sum(p["match"] for p in parts) / len(parts), 4),
            "greedy_prefix": round(sum(p["prefix"] for p in parts) / len(parts), 4)}


# ------------------------------------------------------------------------------------- the KVs measured
def reference(model, ids: list[int]) -> Continuation:
    """The model's own KV of ``ids``."""
    from transformers import DynamicCache

    state = Continuation(model, DynamicCache(), None)
    state.last = state.step(ids)[-1]
    return state


def _cut(cache, tokens: int):
    """A new cache of ``cache``'s first ``tokens`` tokens."""
    from transformers import DynamicCache

    out = DynamicCache()
    for layer, kv in enumerate(cache.layers):
        out.update(kv.keys[:, :, :tokens].clone(), kv.values[:, :, :tokens].clone(), layer)
    return out


class PoolFormat:
    """A storage format through the pool: a saving connector and a loading one on one local pool."""

    def __init__(self, model, fmt: str, s: Settings, model_id: str) -> None:
        chunks = s.prompts * (s.context // s.chunk_tokens) + 1
        probe = model_spec(model, model_id=model_id, chunk_tokens=s.chunk_tokens, weights=WEIGHTS, storage_format=fmt)
        cfg = {"storage_format": fmt, "chunk_tokens": s.chunk_tokens, "pool": f"bench-quality-{fmt}-{uuid.uuid4().hex}",
               "dram_mib": -(-chunks * stored_nbytes(probe) // (1 << 20)) + 1}
        self.fmt, self.model = fmt, model
        self.saver = HFConnector(model, config=cfg, model_id=model_id, weights=WEIGHTS)
        self.loader = HFConnector(model, config=cfg, model_id=model_id, weights=WEIGHTS)
        spec, part = self.saver.spec, self.saver.pool.part.spec  # a chunk is stored as a slice per KV head
        self.bytes_ratio = stored_nbytes(part) * spec.num_kv_heads / spec.chunk_nbytes
        half = dataclasses.replace(part, dtype="float16")
        self.bytes_ratio_16bit = stored_nbytes(half) / half.chunk_nbytes

    def state(self, ids: list[int]) -> Continuation:
        """Saves ``ids``' whole chunks, then loads them through a fresh request of the other connector."""
        c = self.saver.spec.chunk_tokens
        saved = self.saver.prefill(ids, save=True)
        got = self.loader.prefill(ids, save=False)
        want = min(len(ids) // c * c, len(ids) - 1)
        if saved.saved_chunks != len(ids) // c or got.loaded_tokens != want:
            raise RuntimeError(f"{self.fmt}: the pool saved {saved.saved_chunks} chunks and served {got.loaded_tokens} "
                               f"tokens of {len(ids)}, expected {len(ids) // c} and {want}: the row would not measure "
                               "the format")
        return Continuation(self.model, got.cache, got.logits[0, -1])


# ------------------------------------------------------------------------------------- the benchmark
def run(settings: Settings | None = None, *, model=None, tok=None, progress: bool = True) -> dict:
    """Every row of the benchmark (see the module docstring) and what it ran on."""
    s = (settings or Settings()).check()
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        return _run(s, model, tok, progress)
    finally:
        torch.set_num_threads(threads)


def _run(s: Settings, model, tok, progress: bool) -> dict:
    from kvpool.connectors.demo import smollm2

    t0 = time.perf_counter()
    if model is None:
        model, tok = smollm2.load()
    model_id = smollm2.MODEL_ID
    passages = quality_text.passages(tok, s.prompts, s.context + s.scored)
    evict = Eviction(model, s) if s.methods != () else None
    pools = [PoolFormat(model, f, s, model_id) for f in ("raw", *s.formats)]
    kinds = [("raw" if p.fmt == "raw" else "format", p.fmt, None) for p in pools]
    kinds += evict.rows() if evict else []
    parts: dict[tuple, list[dict]] = {k: [] for k in kinds}
    with torch.no_grad(), Progress(len(passages) * (len(kinds) + 1), "bench quality", enabled=progress) as bar:
        for topic, ids in passages:
            ctx, cont = ids[: s.context], ids[s.context:]
            own = reference(model, ctx)
            prefix = _cut(own.cache, s.context - 1) if evict else None  # the model's own KV of ctx[:-1]
            ref = measure(own, cont, s.greedy)
            bar.advance(note=f"{topic}: reference")
            for kind, pool in zip(kinds, pools):
                parts[kind].append(compare(ref, measure(pool.state(ctx), cont, s.greedy), cont))
                bar.advance(note=f"{topic}: {pool.fmt}")
            for kind in kinds[len(pools):]:
                parts[kind].append(compare(ref, evict.outcome(kind, prefix, ctx, cont, s.greedy), cont))
                bar.advance(note=f"{topic}: {kind[1]} {kind[2]}")
    rows = []
    for kind, pool in zip(kinds, pools):
        rows.append({"kind": kind[0], "method": kind[1], "budget": None, "bytes_ratio": round(pool.bytes_ratio, 4),
                     "bytes_ratio_16bit": round(pool.bytes_ratio_16bit, 4), **summarize(parts[kind])})
    for kind in kinds[len(pools):]:
        ratio = round(evict.bytes_ratio(kind), 4)
        rows.append({"kind": "eviction", "method": kind[1], "budget": kind[2], "bytes_ratio": ratio,
                     "bytes_ratio_16bit": ratio, **summarize(parts[kind])})
    return {"model": f"{model_id} (float32)", "text": quality_text.SOURCE, "passages": [t for t, _ in passages],
            "settings": {**dataclasses.asdict(s), "methods": evict.methods if evict else []},
            "path": "pool", "rows": rows, "targets": check_targets(rows),
            "seconds": round(time.perf_counter() - t0, 1)}


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets per format, against the float32 chunk (what this model holds) and a 16-bit one."""
    out = []
    for row in rows:
        if row["kind"] == "format" and row["method"] in TARGETS:
            most_bytes, most_ppl = TARGETS[row["method"]]
            ppl_ok = row["ppl_ratio"] <= most_ppl
            out.append({"format": row["method"], "target": f"bytes_ratio <= {most_bytes}, ppl_ratio <= {most_ppl}",
                        "met_vs_float32": ppl_ok and row["bytes_ratio"] <= most_bytes,
                        "met_vs_16bit": ppl_ok and row["bytes_ratio_16bit"] <= most_bytes})
    return out



# ------------------------------------------------------------------------------------- output
def format_table(result: dict) -> str:
    st = result["settings"]
    lines = [f"{result['model']} on {len(result['passages'])} passages of {result['text']}: {st['context']}-token "
             f"context, {st['scored']} tokens scored, {st['greedy']} greedy tokens ({result['seconds']} s)",
             f"{'kind':<9} {'method':<14} {'budget':>6} {'bytes':>7} {'bytes16':>7} {'ppl_ratio':>9} {'kl':>9} "
             f"{'greedy':>6} {'prefix':>6}"]
    for r in result["rows"]:
        lines.append(f"{r['kind']:<9} {r['method']:<14} {r['budget'] or '':>6} {r['bytes_ratio']:>7.4f} "
                     f"{r['bytes_ratio_16bit']:>7.4f} {r['ppl_ratio']:>9.4f} {r['kl']:>9.5f} {r['greedy_match']:>6.3f} "
                     f"{r['greedy_prefix']:>6.3f}")
    for t in result["targets"]:
        lines.append(f"target {t['format']}: {t['target']}: met against float32 chunks: {t['met_vs_float32']}; "
                     f"against 16-bit chunks: {t['met_vs_16bit']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    """bytes_ratio against ppl_ratio and greedy_match, one series per eviction method, a point per
    format; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    rows = result["rows"]
    for ax, field, label in ((axes[0], "ppl_ratio", "perplexity ratio (loaded / raw KV)"),
                             (axes[1], "greedy_match", f"greedy match ({result['settings']['greedy']} tokens)")):
        for i, r in enumerate(r for r in rows if r["kind"] != "eviction"):
            for x, marker, note in ((r["bytes_ratio"], "o", ""), (r["bytes_ratio_16bit"], "s", " (16-bit)")):
                if note and r["kind"] == "raw":
                    continue
                ax.scatter(x, r[field], marker=marker, color="black" if r["kind"] == "raw" else "tab:blue",
                           facecolors="none" if note else None, zorder=3)
                ax.annotate(r["method"] + note, (x, r[field]), fontsize=7, xytext=(4, 3 - 10 * (i % 2)),
                            textcoords="offset points")
        for method in dict.fromkeys(r["method"] for r in rows if r["kind"] == "eviction"):
            pts = sorted((r["bytes_ratio"], r[field]) for r in rows if r["method"] == method)
            ax.plot(*zip(*pts), marker=".", label=method)
        ax.set_xlabel("bytes held / raw KV bytes (formats: circles vs float32 chunks, squares vs 16-bit)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if field == "ppl_ratio":
            for fmt, (most_bytes, most_ppl) in TARGETS.items():
                ax.plot([most_bytes], [most_ppl], marker="x", color="red")
                ax.annotate(f"{fmt} target", (most_bytes, most_ppl), fontsize=7, color="red", xytext=(4, -9),
                            textcoords="offset points")
    if any(r["kind"] == "eviction" for r in rows):
        axes[1].legend(fontsize=7, title="eviction", title_fontsize=7)
    st = result["settings"]
    fig.suptitle(f"{result['model']}: {st['context']}-token contexts of Python's reference manual, {st['scored']} "
                 f"tokens scored, {len(result['passages'])} passages", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path




class Eviction:
    """Token eviction (:mod:`kvpool.connectors.compress`) of the context's KV but its last token, to
    each budget; the last token and what follows run on it at their original positions (as a request
    that loads a compressed prefix computes its last token)."""

    def __init__(self, model, s: Settings) -> None:
        from kvpool.connectors import compress

        self.model, self.compress = model, compress
        self.methods = list(s.methods if s.methods is not None else compress.METHODS)
        self.budgets = sorted({max(1, round(b * (s.context - 1))) for b in s.budgets}, reverse=True)
        self._kept: dict[tuple, list[float]] = {}

    def rows(self) -> list[tuple]:
        return [("eviction", m, b) for m in self.methods for b in self.budgets]

    def outcome(self, kind: tuple, cache, ctx: list[int], cont: list[int], greedy: int) -> Outcome:
        """What ``cache`` (the model's own KV of ``ctx[:-1]``, left as it is) compressed by ``kind``'s
        method to its budget gives, measured as :func:`measure` measures a KV."""
        _, method, budget = kind
        c = self.compress
        comp = c.compress_cache(self.model, cache, method=method, budget=budget, input_ids=ctx[:-1])
        self._kept.setdefault(kind, []).append(comp.kept_tokens / comp.length)
        logits = c.continue_logits(self.model, comp, ctx[-1:] + cont[:-1])[0]
        return Outcome(torch.log_softmax(logits.double(), dim=-1), c.greedy(self.model, comp, ctx[-1:], greedy))

    def bytes_ratio(self, kind: tuple) -> float:
        """Kept tokens over the compressed context's tokens, mean over the passages (per layer and head
        on average: PyramidKV and AdaKV keep different counts)."""
        return sum(self._kept[kind]) / len(self._kept[kind])
