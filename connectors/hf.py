"""The transformers connector: Hugging Face causal LMs on the pool.

Before a prefill it loads the longest cached prefix of whole chunks into a ``DynamicCache`` and
runs the model on the rest only; after the prefill it saves the prompt's new whole chunks. Any
decoder whose config gives its layers, KV heads and head dim works (:mod:`kvpool.connectors.hf_model`
reads them, and refuses what it cannot serve). A batch of prompts is served row by row, each with
its own keys and hit (:mod:`kvpool.connectors.hf_batch`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from kvpool.auth import claimed_tenant
from kvpool.connectors import compress_store, hf_state
from kvpool.connectors.breakeven import BreakEven
from kvpool.connectors.hf_batch import prompt_rows
from kvpool.connectors.hf_model import cache_argument, layer_kv, model_spec, model_states, same_layout
from kvpool.connectors.pools import PoolHealth, Reporter, as_sliced, check_config, open_pool
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
    # Positions the cache is short of (a compressed prefix holds fewer entries than its tokens): the
    # next token's position is cache.get_seq_length() + positions_ahead (position_ids, decoding yourself).
    positions_ahead: int = 0


class HFConnector:
    """One model's view of the pool. ``config`` is the pool config of ``kvpool.connectors.pools``;
    ``weights`` names the weights (see :func:`model_spec`).

    Sliding-window and chunked-attention layers: the connector runs the model on a cache that
    keeps every layer's KV of the whole prompt (the model's masks still apply the window), so a
    saved chunk holds its tokens' KV for every layer and any prefix of whole chunks can be
    loaded. transformers' own cache would have dropped a sliding layer's tokens older than the
    window, leaving nothing correct to save for them.
    Once the prompt's chunks are saved, the request goes on with transformers' own cache (sliding
    layers back to their window), so decoding costs what it costs without the pool.
    NOTE: what it costs: the pool stores every layer of every chunk, where a window-aware store
    would keep a sliding layer's chunks only inside its window (measured by ``kvpool bench
    sliding``); prefill computes the same attention either way (transformers' first forward also
    sees every key), and holds the whole prompt's KV until the save.
    """

    def __init__(self, model, pool=None, *, config: dict | None = None, model_id: str | None = None,
                 tenant: str = "default", breakeven: BreakEven | None = None, weights: str | None = None) -> None:
        cfg = check_config(config or {})
        self.model = model
        self._arg = cache_argument(model)
        if pool is None:
            self.spec = model_spec(model, model_id=model_id, chunk_tokens=cfg["chunk_tokens"], weights=weights,
                                   storage_format=cfg["storage_format"])
            self.pool = open_pool(self.spec, config)
        else:
            self.spec, self.pool = pool.spec, as_sliced(pool)
            if not same_layout(pool.spec, model):  # NOTE: the weights are the pool's maker's word (model_spec)
                raise BadRequest(f"the pool's spec {pool.spec} does not describe {type(model).__name__}'s KV layout: "
                                 "open the pool with model_spec(model)")
        self.tenant = cfg.get("tenant", tenant)
        self.breakeven = breakeven or BreakEven()
        self.health = PoolHealth(self.pool)  # DEGRADED while a "node" pool does not answer
        self.save_refused = 0  # saves the pool refused (429 quota, 507 full): those chunks stay uncached
        self.load_failed = 0  # loads that failed unexpectedly: the request recomputed its prefix
        # recurrent layers: their state at each chunk's end is in the chunk (kvpool.connectors.hf_state)
        self.states = model_states(model, chunk_tokens=self.spec.chunk_tokens) if "state" in self.spec.layer_kinds \
            else None
        self._layers = self.spec.num_layers if self.states is None else len(self.states.storage)
        self._windowed = any(k.startswith(("sliding", "chunked")) for k in self.spec.layer_kinds)
        # LOSSY, opt-in: long prompts stored compressed (kvpool.connectors.compress_store)
        self.compress = compress_store.check_compress((config or {}).get("compress"), self.spec)
        if self.states is not None and self.compress is not None:
            raise BadRequest(f"{type(model).__name__} keeps recurrent state: token eviction (compress) cannot apply")
        # per-chunk attention mass for the `importance` policy (a window's recompute per save)
        self.report_attention = (cfg.get("policy") == "importance" and compress_store.takes_attention(self.pool)
                                 and self.states is None)
        self.reporter = Reporter(self.pool, f"transformers {self.spec.model_id} pid {os.getpid()}", self.figures)

    # ---------------------------------------------------------------- cache <-> chunks
    def _new_cache(self):
        """A cache that keeps every layer's KV of every token (see the class docstring)."""
        from transformers import DynamicCache

        return DynamicCache() if self.states is None else DynamicCache(config=self.model.config)

    def _own_cache(self, cache):
        """transformers' own cache holding ``cache``'s KV: once the prompt's chunks are saved, its
        sliding and chunked layers keep only their window again, so decoding costs what it costs
        without the pool."""
        from transformers import DynamicCache

        own = DynamicCache(config=self.model.config)
        for layer in range(self._layers):
            own.update(*layer_kv(cache, layer), layer)
        assert own.get_seq_length() == cache.get_seq_length()
        return own

    def _cache_from_chunks(self, chunks: list[torch.Tensor], tokens: int):
        """A cache holding the first ``tokens`` tokens of the chunks."""
        cache = self._new_cache()
        if not chunks:
            return cache
        device = next(self.model.parameters()).device
        if self.states is not None:  # the attention layers' KV, and every recurrent layer's state at the last's end
            assert tokens == len(chunks) * self.spec.chunk_tokens, (tokens, len(chunks))
            att = [self.states.storage[layer][0] for layer in self.states.attention]
            kv = torch.cat([ch[att] for ch in chunks], dim=2) if att else None  # the attention layers only
            for layer, where in enumerate(self.states.storage):
                if layer in self.states.shapes:
                    hf_state.restore(cache, layer, *(t.to(device) for t in self.states.unpack(chunks[-1], layer)), tokens)
                else:
                    k, v = kv[att.index(where[0]), 0], kv[att.index(where[0]), 1]
                    cache.update(k.permute(1, 0, 2).unsqueeze(0).to(device), v.permute(1, 0, 2).unsqueeze(0).to(device),
                                 layer)
            return cache
        kd = self.spec.head_dim
        if self.spec.v_head_dim:  # [layers, tokens, heads, kd + vd]
            kv = torch.cat(chunks, dim=1)[:, :tokens]
            pairs = [(kv[layer, :, :, :kd], kv[layer, :, :, kd:]) for layer in range(self._layers)]
        else:  # [layers, 2, tokens, heads, dim]
            kv = torch.cat(chunks, dim=2)[:, :, :tokens]
            pairs = [(kv[layer, 0], kv[layer, 1]) for layer in range(self._layers)]
        for layer, (k, v) in enumerate(pairs):
            cache.update(k.permute(1, 0, 2).unsqueeze(0).to(device), v.permute(1, 0, 2).unsqueeze(0).to(device), layer)
        return cache

    def _chunks_from_cache(self, cache, first: int, count: int, states: dict | None = None) -> list[torch.Tensor]:
        """Chunks ``first .. first+count`` of the cache, in the canonical layout (``states[i]``: the
        recurrent layers' state at chunk ``i``'s end, of a stateful model)."""
        c = self.spec.chunk_tokens
        lo, hi = first * c, (first + count) * c
        if self.states is not None:
            out = []
            for i in range(first, first + count):
                kv = {layer: tuple(t[0, :, i * c: (i + 1) * c].transpose(0, 1).cpu() for t in layer_kv(cache, layer))
                      for layer in self.states.attention}
                out.append(self.states.pack(kv, {k: tuple(t.cpu() for t in v) for k, v in states[i].items()}))
            return out
        per_layer = []
        for layer in range(self._layers):
            k, v = layer_kv(cache, layer)
            if k.shape[2] < hi or v.shape[2] < hi:
                raise RuntimeError(f"layer {layer} of the cache holds {k.shape[2]} tokens, not the {hi} saved: the "
                                   "cache dropped tokens (a sliding window?) and its chunks cannot be stored")
            k, v = k[0, :, lo:hi].transpose(0, 1), v[0, :, lo:hi].transpose(0, 1)  # [tokens, heads, dim]
            per_layer.append(torch.cat([k, v], dim=-1) if self.spec.v_head_dim else torch.stack([k, v]))
        kv = torch.stack(per_layer).contiguous().cpu()
        axis = 1 if self.spec.v_head_dim else 2
        return [kv.narrow(axis, i * c, c).contiguous() for i in range(count)]

    def _load(self, tenant: str, keys: list, usable: int):
        """(chunks, cache) for the leading ``usable`` tokens; any failure is a miss, never a crash."""
        c = self.spec.chunk_tokens
        try:
            loaded = self.pool.load(tenant, keys[: -(-usable // c)])  # a miss on the way shortens the run
            return loaded, self._cache_from_chunks(loaded, min(len(loaded) * c, usable))
        except Exception as e:  # noqa: BLE001 - the pool must never fail a request: recompute instead
            log.warning("transformers connector: load for tenant %s failed (%s: %s); recomputing the prefix",
                        claimed_tenant(tenant), type(e).__name__, e)  # never the credential
            self.load_failed += 1
            return [], self._new_cache()

    def figures(self) -> dict:
        """What ``kvpool stats`` shows (Reporter): break-even (``loads`` that returned KV), DEGRADED."""
        return {**self.breakeven.stats(self.spec.chunk_nbytes // self.spec.chunk_tokens), **self.health.figures(),
                "load_failures": self.load_failed}

    # ---------------------------------------------------------------- the request
    @torch.no_grad()
    def prefill(self, input_ids, *, attention_mask=None, **kw) -> PrefillResult | list[PrefillResult]:
        """Runs the prompt, reusing the pool's longest whole-chunk prefix (at least one token is
        always computed, so the last position's logits exist). A batch (``[B, n]`` with its
        ``attention_mask``, padded left or right, or a list of token lists) is run row by row: a
        list of one result per row, each with its own hit (:mod:`kvpool.connectors.hf_batch`).
        ``kw``: ``tenant``, ``save`` (store the new whole chunks), ``use_pool`` (False: recompute
        everything, store nothing), ``extra_keys`` and ``shared`` (the keys' namespace)."""
        rows, batched = prompt_rows(input_ids, attention_mask)
        results = [self._prefill_one(row, **kw) for row in rows]
        return results if batched else results[0]

    def _prefill_one(self, ids: torch.Tensor, *, tenant: str | None = None, save: bool = True, use_pool: bool = True,
                     extra_keys=(), shared: bool = False) -> PrefillResult:
        """One prompt's prefill: ``ids`` is ``[1, n]``, every token real (prompt_rows made it so)."""
        assert ids.dim() == 2 and ids.shape[0] == 1 and ids.shape[1] > 0, tuple(ids.shape)
        tenant = tenant or self.tenant
        n = ids.shape[1]
        t0 = time.perf_counter()
        c = self.spec.chunk_tokens
        keys = self.pool.keys(tenant, ids[0].tolist(), extra_keys=extra_keys, shared=shared)
        timings = {}
        request = None
        loaded: list[torch.Tensor] = []
        cache, ahead, compressed = None, 0, None
        if use_pool and keys:
            # NOTE: the KV of a token depends only on the tokens before it, so a cached chunk
            # holding the prompt's last token is loaded too and cut just before that token: on a
            # full hit only the last token is computed (it needs logits), not its whole chunk.
            usable = min(self.pool.lookup(tenant, keys), n - 1)
            if self.states is not None:  # a state exists at chunk boundaries only
                usable -= usable % c
            if usable and self.breakeven.should_load(usable, -(-usable // c) * self.spec.chunk_nbytes):
                request = self.pool.begin(tenant, keys)
                t1 = time.perf_counter()
                loaded, cache = self._load(tenant, keys, usable)
                if loaded:
                    self.breakeven.observe_load(len(loaded) * self.spec.chunk_nbytes, time.perf_counter() - t1)
                else:  # nothing came back (failed, or evicted since the lookup): not a load
                    self.breakeven.loaded -= 1
                timings["load_s"] = time.perf_counter() - t1
            if self.compress is not None:
                compressed = compress_store.load_compressed(self, tenant, keys, n, min(len(loaded) * c, n - 1))
        try:
            hit = min(len(loaded) * c, n - 1)
            cache = cache if cache is not None else self._new_cache()
            if compressed is not None:  # a compressed prefix of `hit` tokens held in fewer entries
                cache, hit, entries = compressed
                ahead = hit - entries
            t2 = time.perf_counter()
            device = next(self.model.parameters()).device
            pos = {"position_ids": torch.arange(hit, n, device=device)[None]} if ahead else {}
            states = {}
            if self.states is not None and save and use_pool and n // c > hit // c:
                out, states = self._run_by_chunk(ids, hit, cache)  # each new chunk's state at its end
            else:
                out = self.model(input_ids=ids[:, hit:].to(device), use_cache=True, **pos, **{self._arg: cache})
            timings["prefill_s"] = time.perf_counter() - t2
            self.breakeven.observe_prefill(n - hit, timings["prefill_s"])
            if (self.states is None or self.states.attention) and cache.get_seq_length() + ahead != n:
                raise RuntimeError(f"the model did not fill the cache it was given ({cache.get_seq_length()} of {n} "
                                   f"tokens): its forward ignored `{self._arg}=`; this transformers version is not "
                                   "supported")
            saved = 0
            whole = n // c
            if save and use_pool and compressed is None and whole > len(loaded):
                try:
                    if self.compress is not None and whole * c > self.compress.budget:  # LOSSY, opt-in
                        saved = compress_store.save_compressed(self.model, self.pool, self.spec, self.compress, tenant,
                                                               keys, cache, ids, whole, shared=shared)
                    else:
                        chunks = self._chunks_from_cache(cache, len(loaded), whole - len(loaded), states)
                        att = {"attention": compress_store.save_attention(self.model, cache, ids, c)
                               } if self.report_attention else {}
                        saved = self.pool.save(tenant, keys, chunks, start=len(loaded), request=request, shared=shared,
                                               **att)
                except KvPoolError as e:  # a full pool or a spent quota: a future miss, not a failed request
                    log.warning("transformers connector: save for tenant %s refused (%s)", claimed_tenant(tenant), e)
                    self.save_refused += 1
        finally:
            if request is not None:
                self.pool.end(request)  # its chunks (loaded and saved) may be evicted again
        if self._windowed:
            cache = self._own_cache(cache)
        return PrefillResult(out.logits, cache, n, hit, saved, time.perf_counter() - t0, timings, ahead)

    def _run_by_chunk(self, ids: torch.Tensor, hit: int, cache):
        """The model on ``ids[hit:]`` one chunk at a time up to the last whole chunk, then the rest:
        (its output, whose logits are every computed token's, and the recurrent layers' state at
        each new chunk's end, by chunk index)."""
        c, n = self.spec.chunk_tokens, ids.shape[1]
        device = next(self.model.parameters()).device
        logits, states, out = [], {}, None
        bounds = [*range(hit, n // c * c + 1, c)]
        for lo, hi in zip(bounds, [*bounds[1:], n]):
            if lo == hi:
                continue
            out = self.model(input_ids=ids[:, lo:hi].to(device), use_cache=True, **{self._arg: cache})
            logits.append(out.logits)
            if hi % c == 0:
                states[hi // c - 1] = hf_state.snapshot(cache, self.states)
        out.logits = torch.cat(logits, dim=1)
        return out, states

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int = 8, *, attention_mask=None, **kw):
        """Greedy decoding after a pooled prefill: (the new tokens, the prefill's result); for a
        batch (as :meth:`prefill` takes it), (each row's new tokens, each row's result)."""
        rows, batched = prompt_rows(input_ids, attention_mask)
        out = [self._generate_one(row, max_new_tokens, **kw) for row in rows]
        if batched:
            return [tokens for tokens, _ in out], [result for _, result in out]
        return out[0]

    def _generate_one(self, ids: torch.Tensor, max_new_tokens: int, **kw) -> tuple[list[int], PrefillResult]:
        first = self._prefill_one(ids, **kw)
        cache, tokens = first.cache, []
        nxt = int(first.logits[0, -1].argmax())
        device = next(self.model.parameters()).device
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            extra = {"position_ids": torch.tensor([[cache.get_seq_length() + first.positions_ahead]], device=device)
                     } if first.positions_ahead else {}
            out = self.model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True, **extra,
                             **{self._arg: cache})
            nxt = int(out.logits[0, -1].argmax())
        return tokens, first
