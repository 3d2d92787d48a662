"""The prompts in what a transformers caller passes as ``input_ids``: one prompt, or a batch.

A batch is served row by row, each row with its own keys and its own hit, so it must first be
cut into the rows' real tokens: a ``[B, n]`` tensor whose ``attention_mask`` (the tokenizer's,
1 for a real token, 0 for padding) says which tokens are real, padded on the left or the right;
or a list of token lists of any lengths (a ragged batch). Padding never enters a key. Shapes
that are not one of these are refused with the fix, never reshaped into one long prompt (that
would answer the rows' concatenation and save it under keys no prompt had).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.errors import BadRequest


def prompt_rows(input_ids, attention_mask=None) -> tuple[list[torch.Tensor], bool]:
    """(the prompts as ``[1, n_i]`` long tensors of their real tokens, whether ``input_ids`` was
    a batch). One prompt: a 1-D sequence or a ``[1, n]`` tensor. A batch: ``[B, n]`` with B > 1,
    or a list of token lists (which takes no ``attention_mask``: each list holds only real tokens)."""
    if _is_ragged(input_ids):
        if attention_mask is not None:
            raise BadRequest("a ragged batch (a list of token lists) takes no attention_mask: give each row's real "
                             "tokens only, or pad the rows into one [batch, tokens] tensor with its mask")
        rows = [_one_row(row, f"input_ids[{i}]") for i, row in enumerate(input_ids)]
        for i, row in enumerate(rows):
            if row.shape[1] == 0:
                raise BadRequest(f"prompt {i} of input_ids is empty: give at least one token")
        return rows, True
    ids = _ids_tensor(input_ids, "input_ids")
    if ids.dim() > 2:
        raise BadRequest(f"input_ids has shape {tuple(ids.shape)}: give one prompt ([tokens] or [1, tokens]) or a "
                         "batch ([batch, tokens] with its attention_mask, or a list of token lists)")
    batched = ids.dim() == 2 and ids.shape[0] > 1
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    if ids.shape[0] == 0:
        raise BadRequest("input_ids is an empty batch: give at least one prompt")
    if attention_mask is None:
        rows = [ids[i: i + 1] for i in range(ids.shape[0])]
    else:
        mask = torch.as_tensor(attention_mask)
        if mask.dim() == 1 and ids.shape[0] == 1:
            mask = mask.reshape(1, -1)
        if tuple(mask.shape) != tuple(ids.shape):
            raise BadRequest(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(ids.shape)}: "
                             "pass the mask the tokenizer returned with these ids")
        rows = [_real_tokens(ids[i], mask[i], i) for i in range(ids.shape[0])]
    for i, row in enumerate(rows):
        if row.shape[1] == 0:
            raise BadRequest(f"prompt {i} of input_ids is empty: give at least one token")
    return rows, batched


def one_prompt(input_ids, what: str = "input_ids") -> torch.Tensor:
    """``input_ids`` as ``[1, n]``, for a function that takes exactly one prompt; a batch is refused."""
    rows, batched = prompt_rows(input_ids)
    if batched:
        raise BadRequest(f"{what} holds a batch of {len(rows)} prompts but this call takes one: call it once per row")
    return rows[0]


def _is_ragged(value) -> bool:
    return isinstance(value, (list, tuple)) and any(_is_sequence(v) for v in value)


def _is_sequence(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes)) or (
        hasattr(value, "shape") and len(getattr(value, "shape", ())) > 0)


def _ids_tensor(value, what: str) -> torch.Tensor:
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise BadRequest(f"{what} must be token ids (a sequence of ints or an integer tensor), got "
                         f"{type(value).__name__}") from None
    if ids.numel() == 0 and ids.dim() > 0:
        return ids.long()  # [] is float to torch: an empty prompt, refused by the caller as empty
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise BadRequest(f"{what} must be integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 0:
        raise BadRequest(f"{what} is one number: give a prompt as a sequence of token ids")
    return ids.long()


def _one_row(row, what: str) -> torch.Tensor:
    ids = _ids_tensor(row, what)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise BadRequest(f"{what} has shape {tuple(ids.shape)}: each row of a ragged batch is one prompt's token ids")
    return ids.reshape(1, -1)


def _real_tokens(ids: torch.Tensor, mask: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i``'s real tokens, ``[1, n]``: the mask's ones must be one run (left or right padding)."""
    if mask.dtype.is_floating_point or not bool(((mask == 0) | (mask == 1)).all()):
        raise BadRequest(f"attention_mask row {i} holds values other than 0 and 1: pass the tokenizer's mask")
    real = mask.nonzero().flatten()
    if real.numel() == 0:
        raise BadRequest(f"attention_mask row {i} marks no real token: drop the row, or give it a prompt")
    first, last = int(real[0]), int(real[-1])
    if last - first + 1 != real.numel():
        raise BadRequest(f"attention_mask row {i} has padding between real tokens: kvpool serves rows padded on the "
                         "left or the right; pass other layouts as a list of each row's token lists")
    return ids[first: last + 1].reshape(1, -1)
