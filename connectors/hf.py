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
import os
import time
from dataclasses import dataclass, field

import torch

from kvpool.auth import claimed_tenant
from kvpool.connectors import compress_store
from kvpool.connectors.breakeven import BreakEven
from kvpool.connectors.families import UnsupportedModel, engine_scope, is_latent, layer_kinds, text_config
from kvpool.connectors.pools import PoolHealth, Reporter, check_config, open_pool, spec_for
from kvpool.connectors.weights import (
    check_given,
    config_fields,
    files_fingerprint,
    local_checkpoint,
    tensors_fingerprint,
)
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


def model_spec(model, *, model_id: str | None = None, chunk_tokens: int = 256, revision: str = "main",
               weights: str | None = None, storage_format: str = "raw"):
    """The KV spec of a transformers decoder: its layers' kinds (from the config), the K and V
    shapes its cache really holds (one probe token), and its weights' fingerprint
    (``weights``: None or ``"auto"``, ``"files"``, ``"tensors"``, or your own name for them; see
    :mod:`kvpool.connectors.weights`) and how its chunks are stored (``storage_format``: ``"raw"``,
    or a LOSSY, opt-in format of :mod:`kvpool.codec`). Raises :class:`UnsupportedModel` for a family the
    connector cannot serve correctly."""
    kinds, heads, k_dim, v_dim, dtype = model_layout(model)
    name = model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return spec_for(name, len(kinds), heads, k_dim, dtype, chunk_tokens=chunk_tokens, revision=revision,
                    weights=model_weights(model, weights, revision), layer_kinds=kinds, v_head_dim=v_dim,
                    engine=engine_scope(model.config, "transformers", type(model).__name__),
                    storage_format=storage_format)


def model_layout(model) -> tuple[tuple[str, ...], int, int, int, object]:
    """(layer kinds, KV heads, K width, V width, dtype) of a transformers decoder."""
    kinds = layer_kinds(model.config, engine="transformers connector")
    _check_cache_layers(model, kinds)
    heads, k_dim, v_dim, dtype = _probe_kv(model, len(kinds))
    if is_latent(model.config):
        cfg = text_config(model.config)
        if (heads, k_dim, v_dim) == (1, cfg.kv_lora_rank, cfg.qk_rope_head_dim):
            # NOTE: transformers >= 5.2x caches MLA compressed: per token one normalised latent
            # (the "keys") and one rotated rope key (the "values"), expanded per head at attention.
            kinds = tuple("latent" if k == "full" else k for k in kinds)
    return kinds, heads, k_dim, v_dim, dtype


def _same_layout(spec, model) -> bool:
    kinds, heads, k_dim, v_dim, dtype = model_layout(model)
    other = spec_for(spec.model_id, len(kinds), heads, k_dim, dtype, chunk_tokens=spec.chunk_tokens,
                     revision=spec.model_revision, weights=spec.weights, layer_kinds=kinds, v_head_dim=v_dim,
                     storage_format=spec.storage_format,
                     engine=engine_scope(model.config, "transformers", type(model).__name__))
    return other.fingerprint() == spec.fingerprint()


def model_weights(model, weights: str | None = None, revision: str | None = None) -> str:
    """The weights fingerprint of a loaded model. ``auto``: its checkpoint folder's files when it
    was loaded from one with the folder's own config (so vLLM serving that folder shares its
    chunks), else its tensors."""
    if weights not in (None, "auto", "files", "tensors"):
        return check_given(weights)
    if weights != "tensors":
        source = getattr(model.config, "_name_or_path", "") or ""
        folder = local_checkpoint(source, None if revision in (None, "main") else revision)
        if folder is not None and _config_is_the_folders(model.config, folder):
            return files_fingerprint(folder)
        if weights == "files":
            raise BadRequest(f"weights='files' but {type(model).__name__} was not loaded from a checkpoint folder "
                             f"with its own config ({source!r}): use weights='tensors' or name the weights yourself")
    return tensors_fingerprint(model)


def _config_is_the_folders(config, folder: str) -> bool:
    """Whether the model runs with its folder's config (no override of a field that changes KV)."""
    try:
        disk = type(config).from_pretrained(folder).to_dict()
    except Exception:  # noqa: BLE001 - a folder whose config does not load: not this model's
        return False
    skip = ("dtype", "torch_dtype", "use_cache")
    here = {k: v for k, v in config_fields(config.to_dict()).items() if k not in skip}
    return here == {k: v for k, v in config_fields(disk).items() if k not in skip}


def _check_cache_layers(model, kinds: tuple[str, ...]) -> None:
    """transformers' own cache for the model must agree with the kinds read from its config (a
    layer class or window we did not expect means the model does something we cannot vouch for)."""
    from transformers import DynamicCache

    layers = DynamicCache(config=model.config).layers
    if len(layers) != len(kinds):
        raise UnsupportedModel(f"transformers connector: {type(model).__name__}'s cache has {len(layers)} layers but "
                               f"its config {len(kinds)}: kvpool cannot tell what each layer's KV is")
    for i, (layer, kind) in enumerate(zip(layers, kinds)):
        cls = type(layer).__name__
        window = int(kind.partition(":")[2] or 0)
        ok = (cls == "DynamicLayer" and not window) or (
            cls == "DynamicSlidingWindowLayer" and window and getattr(layer, "sliding_window", None) == window)
        if not ok:
            raise UnsupportedModel(f"transformers connector: layer {i} of {type(model).__name__} caches through "
                                   f"{cls} but its config says {kind!r}; kvpool cannot vouch for reusing its KV. "
                                   "Serve this model without the pool")


def _probe_kv(model, num_layers: int) -> tuple[int, int, int, object]:
    """(KV heads, K width, V width, dtype) that the model's cache holds, from one probe token."""
    from transformers import DynamicCache

    cache = DynamicCache()
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True,
              **{_cache_argument(model): cache})
    shapes = set()
    for layer in range(num_layers):
        if layer >= len(cache.layers) or getattr(cache.layers[layer], "keys", None) is None:
            raise UnsupportedModel(f"transformers connector: {type(model).__name__} left layer {layer} of its cache "
                                   "empty: kvpool cannot rebuild a cache it does not fill")
        k, v = _layer_kv(cache, layer)
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.dtype != v.dtype:
            raise UnsupportedModel(f"transformers connector: layer {layer} caches K {tuple(k.shape)} and V "
                                   f"{tuple(v.shape)}; kvpool stores [batch, heads, tokens, dim] K and V")
        shapes.add((k.shape[1], k.shape[3], v.shape[3], k.dtype))
    if len(shapes) != 1:
        raise UnsupportedModel(f"transformers connector: {type(model).__name__}'s layers cache KV of different shapes "
                               f"{sorted(map(str, shapes))}; kvpool chunks hold one shape for every layer")
    return shapes.pop()


def _cache_argument(model) -> str:
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise BadRequest(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`: "
                     "not a transformers causal LM this connector knows")


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
        self._arg = _cache_argument(model)
        if pool is None:
            self.spec = model_spec(model, model_id=model_id, chunk_tokens=cfg["chunk_tokens"], weights=weights,
                                   storage_format=cfg["storage_format"])
            self.pool = open_pool(self.spec, config)
        else:
            self.spec, self.pool = pool.spec, pool
            if not _same_layout(pool.spec, model):  # NOTE: the weights are the pool's maker's word (model_spec)
                raise BadRequest(f"the pool's spec {pool.spec} does not describe {type(model).__name__}'s KV layout: "
                                 "open the pool with model_spec(model)")
        self.tenant = cfg.get("tenant", tenant)
        self.breakeven = breakeven or BreakEven()
        self.health = PoolHealth(self.pool)  # DEGRADED while a "node" pool does not answer
        self.save_refused = 0  # saves the pool refused (429 quota, 507 full): those chunks stay uncached
        self.load_failed = 0  # loads that failed unexpectedly: the request recomputed its prefix
        self._layers = self.spec.num_layers
        self._windowed = any(k.startswith(("sliding", "chunked")) for k in self.spec.layer_kinds)
        # LOSSY, opt-in: long prompts stored compressed (kvpool.connectors.compress_store)
        self.compress = compress_store.check_compress((config or {}).get("compress"), self.spec)
        # per-chunk attention mass for the `importance` policy (a window's recompute per save)
        self.report_attention = cfg.get("policy") == "importance" and compress_store.takes_attention(self.pool)
        self.reporter = Reporter(self.pool, f"transformers {self.spec.model_id} pid {os.getpid()}", self.figures)

    # ---------------------------------------------------------------- cache <-> chunks
    def _new_cache(self):
        """A cache that keeps every layer's KV of every token (see the class docstring)."""
        from transformers import DynamicCache

        return DynamicCache()

    def _own_cache(self, cache):
        """transformers' own cache holding ``cache``'s KV: once the prompt's chunks are saved, its
        sliding and chunked layers keep only their window again, so decoding costs what it costs
        without the pool."""
        from transformers import DynamicCache

        own = DynamicCache(config=self.model.config)
        for layer in range(self._layers):
            own.update(*_layer_kv(cache, layer), layer)
        assert own.get_seq_length() == cache.get_seq_length()
        return own

    def _cache_from_chunks(self, chunks: list[torch.Tensor], tokens: int):
        """A cache holding the first ``tokens`` tokens of the chunks."""
        cache = self._new_cache()
        if not chunks:
            return cache
        device = next(self.model.parameters()).device
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

    def _chunks_from_cache(self, cache, first: int, count: int) -> list[torch.Tensor]:
        """Chunks ``first .. first+count`` of the cache, in the canonical layout."""
        c = self.spec.chunk_tokens
        lo, hi = first * c, (first + count) * c
        per_layer = []
        for layer in range(self._layers):
            k, v = _layer_kv(cache, layer)
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
        cache, ahead, compressed = None, 0, None
        if use_pool and keys:
            # NOTE: the KV of a token depends only on the tokens before it, so a cached chunk
            # holding the prompt's last token is loaded too and cut just before that token: on a
            # full hit only the last token is computed (it needs logits), not its whole chunk.
            usable = min(self.pool.lookup(tenant, keys), n - 1)
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
            out = self.model(input_ids=ids[:, hit:].to(device), use_cache=True, **pos, **{self._arg: cache})
            timings["prefill_s"] = time.perf_counter() - t2
            self.breakeven.observe_prefill(n - hit, timings["prefill_s"])
            if cache.get_seq_length() + ahead != n:
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
                        chunks = self._chunks_from_cache(cache, len(loaded), whole - len(loaded))
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
            pos = cache.get_seq_length() + first.positions_ahead
            extra = {"position_ids": torch.tensor([[pos]], device=device)} if first.positions_ahead else {}
            out = self.model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True, **extra,
                             **{self._arg: cache})
            nxt = int(out.logits[0, -1].argmax())
        return tokens, first


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # pragma: no cover - older releases


def tiny_llama(seed: int = 0, *, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
               vocab: int = 1024, max_positions: int = 32768, init_range: float = 0.2):
    """A random-weight Llama (no download), deterministic by seed, in fp32 and eval mode.

    NOTE: a larger init than the default 0.02 makes logits depend on the KV (perturbing K moved 0.02's by ~1e-3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      initializer_range=init_range, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    return model
