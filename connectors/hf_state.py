"""Recurrent state in the pool: where a state-space or linear-attention layer's state goes in a chunk.

A recurrent layer (Mamba-2, Qwen3-Next's gated DeltaNet) keeps no per-token KV but one fixed-size
state (a convolution window and a recurrent matrix) that sums up every token before it. The state
after chunk ``i`` is a function of the prefix through chunk ``i``, exactly as that chunk's KV is,
so it is stored in the chunk, under the chunk's key: the transformers connector runs a prompt's
new chunks one at a time and takes each recurrent layer's state at each chunk's end. A chunk is
then ``[storage layers, 2, chunk_tokens, kv_heads, head_dim]`` as ever: an attention layer's KV
in one storage layer, a recurrent layer's state (conv then recurrent, flattened, zero-padded) in
as many storage layers (kind ``state``) as it fills. A hit restores the attention layers' KV of
every loaded token and the recurrent layers' state at the last loaded chunk's end, and the model
runs on from that chunk's boundary (a hit is whole chunks: no state exists between boundaries).
A model without attention layers stores its state as one head of ``head_dim`` wide enough for
its largest layer.

Only families whose transformers code continues a prompt from a state exactly (its scan takes the
previous state for a many-token forward, and the prefill of a chunk equals the same tokens in a
longer prefill within fp32 rounding, tests/test_model_zoo_state.py) are served (:data:`STATEFUL`);
the chunk size must be a multiple of the model's own scan chunk (its ``chunk_size``, 64 for
gated DeltaNet), where the rounding is smallest. Every other recurrent family stays refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpool.connectors.families import STATEFUL, UnsupportedModel

DELTANET_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk_size (transformers' Qwen3-Next)


@dataclass(frozen=True)
class StateLayout:
    """Where each model layer of a stateful model goes in a chunk (``storage[layer]``: its
    storage layers) and the shapes of its state."""

    kinds: tuple[str, ...]  # one per storage layer: the attention layers' kinds, "state" for the rest
    storage: tuple[tuple[int, ...], ...]  # per model layer
    shapes: dict  # model layer -> (conv shape, recurrent shape)
    heads: int
    dim: int
    dtype: torch.dtype
    chunk_tokens: int

    @property
    def attention(self) -> list[int]:
        return [i for i in range(len(self.storage)) if i not in self.shapes]

    def pack(self, kv: dict, states: dict) -> torch.Tensor:
        """One chunk: ``kv[layer] = (k, v)`` (``[chunk_tokens, heads, dim]`` each) of the attention
        layers, ``states[layer] = (conv, recurrent)`` at the chunk's end."""
        out = torch.zeros((len(self.kinds), 2, self.chunk_tokens, self.heads, self.dim), dtype=self.dtype)
        for layer, where in enumerate(self.storage):
            if layer in self.shapes:
                conv, rec = states[layer]
                flat = torch.cat([conv.reshape(-1), rec.reshape(-1)]).to(self.dtype)
                out[where[0]: where[-1] + 1].view(-1)[: flat.numel()] = flat
            else:
                out[where[0], 0], out[where[0], 1] = kv[layer]
        return out

    def unpack(self, chunk: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s (conv, recurrent) state stored in ``chunk``."""
        conv, rec = self.shapes[layer]
        where = self.storage[layer]
        flat = chunk[where[0]: where[-1] + 1].reshape(-1)
        nc = math.prod(conv)
        return flat[:nc].reshape(conv).clone(), flat[nc: nc + math.prod(rec)].reshape(rec).clone()


def snapshot(cache, layout: StateLayout) -> dict:
    """Every recurrent layer's state in ``cache`` now (copies)."""
    return {i: (cache.layers[i].conv_states[0].detach().clone(), cache.layers[i].recurrent_states[0].detach().clone())
            for i in layout.shapes}


def restore(cache, layer: int, conv: torch.Tensor, rec: torch.Tensor, tokens: int) -> None:
    """Puts a state into ``cache``'s layer ``layer`` as if its ``tokens``-token prefix had just been run."""
    lay = cache.layers[layer]
    lay.lazy_initialization(conv_states=conv, recurrent_states=rec, conv_kernel_size=conv.shape[-1])
    lay.conv_states[0].copy_(conv)
    lay.recurrent_states[0].copy_(rec)
    lay.has_previous_state[0] = True
    # NOTE: transformers >= 5.25 counts the tokens a recurrent layer has seen, and a model whose first layer is
    # recurrent takes the next token's position from that count (cache.get_seq_length() reads layer 0)
    seen = getattr(lay, "cumulative_length_linear", None)
    if seen is not None:
        seen.fill_(tokens)


def state_layout(model, kinds: tuple[str, ...], chunk_tokens: int, forward) -> StateLayout:
    """The layout of a model whose ``kinds`` (kvpool.connectors.families.layer_kinds with
    ``states=True``) name recurrent layers ``state``; ``forward(ids, cache)`` runs the model.
    Raises UnsupportedModel for a family or chunk size whose state cannot be continued exactly."""
    from transformers import DynamicCache

    arch = type(model).__name__
    if arch not in STATEFUL:
        raise UnsupportedModel(f"transformers connector: {arch}'s linear_attention layers keep a recurrent state that "
                               "kvpool has not verified it can continue exactly from a checkpoint (stored states are "
                               f"served for {sorted(STATEFUL)}). Serve this model without the pool")
    own = getattr(model.config, STATEFUL[arch], None) if STATEFUL[arch] else DELTANET_CHUNK
    if own and chunk_tokens % int(own):
        raise UnsupportedModel(f"transformers connector: {arch} scans in chunks of {own} tokens: set chunk_tokens to a "
                               f"multiple of {own} (now {chunk_tokens}), where a stored state continues exactly")
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with torch.no_grad():
        forward(torch.zeros((1, 1), dtype=torch.long, device=device), cache)
    shapes, kv = {}, set()
    for i, kind in enumerate(kinds):
        lay = cache.layers[i]
        if kind == "state":
            conv, rec = lay.conv_states.get(0), lay.recurrent_states.get(0)
            if conv is None or rec is None or getattr(lay, "number_of_states", 1) != 1:
                raise UnsupportedModel(f"transformers connector: layer {i} of {arch} does not keep one conv and one "
                                       "recurrent state: kvpool cannot store it")
            shapes[i] = (tuple(conv.shape), tuple(rec.shape))
            kv.add(("state", conv.dtype, rec.dtype))
        else:
            k, v = lay.keys, lay.values
            if k is None or k.shape != v.shape:
                raise UnsupportedModel(f"transformers connector: attention layer {i} of {arch} caches K and V of "
                                       "different shapes beside recurrent layers: not stored")
            kv.add((k.shape[1], k.shape[3], k.dtype))
    dtypes = {d for t in kv for d in t if isinstance(d, torch.dtype)}
    if len(dtypes) != 1:
        raise UnsupportedModel(f"transformers connector: {arch} keeps its state and KV in {sorted(map(str, dtypes))}; "
                               "kvpool stores one dtype a chunk (a state cast to another would not continue exactly)")
    heads_dims = {(h, d) for h, d, _ in (t for t in kv if t[0] != "state")}
    if len(heads_dims) > 1:
        raise UnsupportedModel(f"transformers connector: {arch}'s attention layers cache KV of different shapes")
    biggest = max(math.prod(c) + math.prod(r) for c, r in shapes.values())
    heads, dim = heads_dims.pop() if heads_dims else (1, -(-biggest // (2 * chunk_tokens)))
    slot = 2 * chunk_tokens * heads * dim
    storage, out = [], []
    for i, kind in enumerate(kinds):
        n = -(-(math.prod(shapes[i][0]) + math.prod(shapes[i][1])) // slot) if i in shapes else 1
        storage.append(tuple(range(len(out), len(out) + n)))
        out += [kind] * n
    return StateLayout(tuple(out), tuple(storage), shapes, heads, dim, dtypes.pop(), chunk_tokens)
