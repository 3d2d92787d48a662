"""The transformers connector: Hugging Face causal LMs on the pool.

Before a prefill it loads the longest cached prefix of whole chunks into a ``DynamicCache`` and
runs the model on the rest only; after the prefill it saves the prompt's new whole chunks. Any
decoder whose config gives its layers, KV heads and head dim works.

NOTE: transformers renamed the forward argument that carries the cache (``past_key_values`` in
5.0-5.23, ``cache`` from 5.24), and an argument a model does not know is swallowed by its
``**kwargs``: the prefix would be silently recomputed and the suffix attend to nothing. So the
name is read from the model's signature, and after every forward the cache we passed must have
grown by exactly the tokens we ran, or the call fails loudly.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field

import torch

from kvpool.connectors.breakeven import BreakEven
from kvpool.connectors.pools import check_config, open_pool, spec_for
from kvpool.errors import BadRequest, KvPoolError

log = logging.getLogger("kvpool.connectors.hf")


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, new tokens, vocab]: logits of the tokens that were computed
    cache: object  # the DynamicCache holding the whole prompt
    prompt_tokens: int
    loaded_tokens: int  # prefix tokens whose KV came from the pool
    saved_chunks: int
    seconds: float
    timings: dict = field(default_factory=dict)


def model_spec(model, *, model_id: str | None = None, chunk_tokens: int = 256, revision: str = "main"):
    """The KV spec of a transformers decoder (from its config and parameter dtype)."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    name = model_id or getattr(cfg, "_name_or_path", "") or type(model).__name__
    return spec_for(name, cfg.num_hidden_layers, heads, head_dim, next(model.parameters()).dtype,
                    chunk_tokens=chunk_tokens, revision=revision)


def _cache_argument(model) -> str:
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise BadRequest(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`: "
                     "not a transformers causal LM this connector knows")


class HFConnector:
    """One model's view of the pool. ``config`` is the pool config of ``kvpool.connectors.pools``."""

    def __init__(self, model, pool=None, *, config: dict | None = None, model_id: str | None = None,
                 tenant: str = "default", breakeven: BreakEven | None = None) -> None:
        cfg = check_config(config or {})
        self.model = model
        self.spec = model_spec(model, model_id=model_id, chunk_tokens=cfg["chunk_tokens"]) if pool is None else pool.spec
        self.pool = pool if pool is not None else open_pool(self.spec, config)
        self.tenant = cfg.get("tenant", tenant)
        self.breakeven = breakeven or BreakEven()
        self._arg = _cache_argument(model)
        self.save_refused = 0  # saves the pool refused (429 quota, 507 full): those chunks stay uncached
        self._layers = self.spec.num_layers

    # ---------------------------------------------------------------- cache <-> chunks
    def _cache_from_chunks(self, chunks: list[torch.Tensor], tokens: int):
        """A DynamicCache holding the first ``tokens`` tokens of the chunks."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if not chunks:
            return cache
        kv = torch.cat(chunks, dim=2)[:, :, :tokens]  # [layers, 2, tokens, heads, dim]
        device = next(self.model.parameters()).device
        for layer in range(self._layers):
            k = kv[layer, 0].permute(1, 0, 2).unsqueeze(0).to(device)  # [1, heads, tokens, dim]
            v = kv[layer, 1].permute(1, 0, 2).unsqueeze(0).to(device)
            cache.update(k, v, layer)
        return cache

    def _chunks_from_cache(self, cache, first: int, count: int) -> list[torch.Tensor]:
        """Chunks ``first .. first+count`` of the cache, in the canonical layout."""
        c = self.spec.chunk_tokens
        lo, hi = first * c, (first + count) * c
        per_layer = []
        for layer in range(self._layers):
            k, v = _layer_kv(cache, layer)
            per_layer.append(torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]]))  # [2, heads, tokens, dim]
        kv = torch.stack(per_layer).permute(0, 1, 3, 2, 4).contiguous().cpu()  # [layers, 2, tokens, heads, dim]
        return [kv[:, :, i * c : (i + 1) * c].contiguous() for i in range(count)]

    # ---------------------------------------------------------------- the request
    @torch.no_grad()
    def prefill(self, input_ids, *, tenant: str | None = None, save: bool = True, use_pool: bool = True,
                extra_keys=(), shared: bool = False) -> PrefillResult:
        """Runs the prompt, reusing the pool's longest whole-chunk prefix (at least one token is
        always computed, so the last position's logits exist)."""
        tenant = tenant or self.tenant
        ids = torch.as_tensor(input_ids).reshape(1, -1)
        n = ids.shape[1]
        if n == 0:
            raise BadRequest("empty prompt: give at least one token")
        t0 = time.perf_counter()
        c = self.spec.chunk_tokens
        keys = self.pool.keys(tenant, ids[0].tolist(), extra_keys=extra_keys, shared=shared)
        timings = {}
        request = None
        loaded: list[torch.Tensor] = []
        if use_pool and keys:
            # NOTE: the KV of a token depends only on the tokens before it, so a cached chunk
            # holding the prompt's last token is loaded too and cut just before that token: on a
            # full hit only the last token is computed (it needs logits), not its whole chunk.
            usable = min(self.pool.lookup(tenant, keys), n - 1)
            if usable and self.breakeven.should_load(usable, -(-usable // c) * self.spec.chunk_nbytes):
                request = self.pool.begin(tenant, keys)
                t1 = time.perf_counter()
                loaded = self.pool.load(tenant, keys[: -(-usable // c)])  # a miss on the way shortens the run
                if loaded:
                    self.breakeven.observe_load(len(loaded) * self.spec.chunk_nbytes, time.perf_counter() - t1)
                timings["load_s"] = time.perf_counter() - t1
        try:
            hit = min(len(loaded) * c, n - 1)
            cache = self._cache_from_chunks(loaded, hit)
            t2 = time.perf_counter()
            out = self.model(input_ids=ids[:, hit:].to(next(self.model.parameters()).device), use_cache=True,
                             **{self._arg: cache})
            timings["prefill_s"] = time.perf_counter() - t2
            self.breakeven.observe_prefill(n - hit, timings["prefill_s"])
            self.breakeven.maybe_report(self.pool, f"transformers {self.spec.model_id} pid {_pid()}",
                                        self.spec.chunk_nbytes // self.spec.chunk_tokens)
            if cache.get_seq_length() != n:
                raise RuntimeError(f"the model did not fill the cache it was given ({cache.get_seq_length()} of {n} "
                                   f"tokens): its forward ignored `{self._arg}=`; this transformers version is not "
                                   "supported")
            saved = 0
            whole = n // c
            if save and use_pool and whole > len(loaded):
                chunks = self._chunks_from_cache(cache, len(loaded), whole - len(loaded))
                try:
                    saved = self.pool.save(tenant, keys, chunks, start=len(loaded), request=request, shared=shared)
                except KvPoolError as e:  # a full pool or a spent quota: a future miss, not a failed request
                    log.warning("transformers connector: save for tenant %s refused (%s)", tenant, e)
                    self.save_refused += 1
        finally:
            if request is not None:
                self.pool.end(request)  # its chunks (loaded and saved) may be evicted again
        return PrefillResult(out.logits, cache, n, hit, saved, time.perf_counter() - t0, timings)

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int = 8, **kw) -> tuple[list[int], PrefillResult]:
        """Greedy decoding after a pooled prefill; the new tokens and the prefill's result."""
        first = self.prefill(input_ids, **kw)
        cache, tokens = first.cache, []
        nxt = int(first.logits[0, -1].argmax())
        device = next(self.model.parameters()).device
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True, **{self._arg: cache})
            nxt = int(out.logits[0, -1].argmax())
        return tokens, first


def _pid() -> int:
    import os

    return os.getpid()


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # pragma: no cover - older releases


def tiny_llama(seed: int = 0, *, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
               vocab: int = 1024, max_positions: int = 32768, init_range: float = 0.2):
    """A random-weight Llama (no download), deterministic by seed, in fp32 and eval mode.

    NOTE: a larger init than the default 0.02 makes logits depend strongly on the KV: with the
    default, perturbing K moved logits by only ~1e-3, too little for a reuse test to see."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      initializer_range=init_range, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    return model
