"""Packed and padded batches without a [T, T] mask: an attention implementation for transformers.

transformers turns packed ``position_ids`` (documents restarting at 0) and a 2-D ``attention_mask``
into a dense ``[batch, 1, T, T]`` mask for SDPA. ``apply()`` switches a model of a tested family
(integrations._SEGMENT_MASK_MODEL_TYPES) whose attention implementation is ``"sdpa"`` to
``IMPLEMENTATION``, registered here with transformers' ``AttentionMaskInterface`` and
``AttentionInterface``:

- its mask function reads the mask transformers asks for (the mask function it composed from its
  own factories: causal, packed, sliding window) and, where that mask is causal attention within
  runs of tokens (packed documents, the real tokens of a row and its padding), returns the
  ``[batch, T]`` segment ids of ``attention_block`` instead, or ``None`` for plain causal attention.
  Anything else (a sliding window within reach, overlays such as bidirectional image tokens, a
  cache's offsets, real tokens with holes) gets transformers' own dense SDPA mask, and is counted.
  Under torch.compile it always does (dynamo cannot read the factories' closures), uncounted.
- its attention function takes either: segment ids run causal SDPA per segment (for attention
  modules ``attention_block`` does not replace, and their own forwards), anything else goes to
  transformers' SDPA function unchanged.
"""
from __future__ import annotations

import collections
import functools
from typing import Any

import torch

from .attention_block import attention_block_segment_ids

IMPLEMENTATION = "torch_offload_sdpa"

# Why calls got transformers' dense mask, per config (apply() reads and clears its model's).
_FALLBACKS: dict[int, collections.Counter] = {}


def is_segment_ids(mask: Any) -> bool:
    """Whether an attention module's ``attention_mask`` is this implementation's segment ids."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and not mask.is_floating_point() and (
        mask.dtype != torch.bool)


def fallbacks(config: Any) -> collections.Counter:
    """The dense masks built for ``config``'s model so far, by reason."""
    return _FALLBACKS.setdefault(id(config), collections.Counter())


def forget(config: Any) -> None:
    _FALLBACKS.pop(id(config), None)


def _cells(function) -> dict[str, Any]:
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in function.__closure__ or ())))


class _Unknown(Exception):
    pass


@functools.cache
def _factories():
    """The code objects of transformers' mask factories' closures, to recognise what they composed."""
    from transformers import masking_utils as mu

    return {
        "and": mu.and_masks(mu.causal_mask_function).__code__,
        "window": mu.sliding_window_overlay(1).__code__,
        "remap": mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None).__code__,
        "packed": mu.packed_sequence_mask_function(None).__code__,
        "causal": mu.causal_mask_function,
    }


def _describe(mask_function, factories) -> tuple[int | None, torch.Tensor | None]:
    """(sliding window or None, packed-sequence ids or None) of a mask function transformers composed
    from causal, sliding-window and packed-sequence factories; _Unknown for anything else."""
    if mask_function is factories["causal"]:
        return None, None
    if getattr(mask_function, "__code__", None) is not factories["and"]:
        raise _Unknown
    parts = _cells(mask_function)["mask_functions"]
    if len(parts) == 2 and parts[1] is factories["causal"] and parts[0].__code__ is factories["window"]:
        return _cells(parts[0])["sliding_window"], None
    if len(parts) == 2 and parts[0].__code__ is factories["remap"] and parts[1].__code__ is factories["packed"]:
        window, inner_packed = _describe(_cells(parts[0])["mask_function"], factories)
        if inner_packed is not None:
            raise _Unknown
        return window, _cells(parts[1])["packed_sequence_mask"]
    raise _Unknown


def _real_tokens_contiguous(mask: torch.Tensor) -> bool:
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    return bool((starts.sum(1) <= 1).all())


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
         mask_function=None, attention_mask: torch.Tensor | None = None, use_vmap: bool = False,
         config: Any = None, **kwargs):
    """The mask function registered for IMPLEMENTATION: segment ids, None, or SDPA's dense mask."""
    from transformers import masking_utils as mu

    dense = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                 kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                 use_vmap=use_vmap, config=config, **kwargs)
    if torch.compiler.is_compiling():  # dynamo cannot read the factories' closures: SDPA's mask, as before
        return mu.sdpa_mask(**dense)
    reason = None
    try:
        window, packed = _describe(mask_function, _factories())
    except _Unknown:
        reason = "a mask transformers composed from other parts (overlays, chunks, bidirectional blocks)"
    else:
        if use_vmap:
            reason = "a custom mask function"
        elif q_length != kv_length or not isinstance(q_offset, int) or q_offset or kv_offset:
            reason = "a key/value cache (queries offset from keys)"
        elif window is not None and q_length > window:
            reason = f"a sliding window ({window} tokens) shorter than the sequence ({q_length})"
        elif attention_mask is not None and not _real_tokens_contiguous(attention_mask[:, -kv_length:]):
            reason = "an attention_mask whose real tokens are not contiguous in a row"
    if reason is None:
        if packed is not None:
            return packed
        if attention_mask is not None and not bool(attention_mask[:, -kv_length:].all()):
            return attention_block_segment_ids(attention_mask=attention_mask[:, -kv_length:])
        return None
    fallbacks(config)[reason] += 1
    return mu.sdpa_mask(**dense)


def _runs(segment_ids: torch.Tensor) -> list[list[tuple[int, int, tuple[int, int] | None]]]:
    """Each row's runs of equal ids, on the host, as (start, end, keys): keys is the run itself for a
    sequence, the nearest sequence before it for padding (a negative id), None for padding before any."""
    ids = segment_ids.cpu()
    rows = []
    for row in ids:
        cuts = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), row.numel()]
        runs, last_sequence = [], None
        for s, e in zip(cuts[:-1], cuts[1:]):
            if row[s] >= 0:
                last_sequence = (s, e)
            runs.append((s, e, (s, e) if row[s] >= 0 else last_sequence))
        rows.append(runs)
    return rows


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs):
    """The attention function registered for IMPLEMENTATION (query, key, value [B, heads, T, D])."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not is_segment_ids(attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    for b, runs in enumerate(_runs(attention_mask)):
        # Padding sees all of the sequence before it (not causal: every key precedes it), or no key
        # at all, where SDPA gives 0.
        pieces = [query.new_zeros(1, e - s, query.shape[1], value.shape[-1]) if keys is None else
                  sdpa_attention_forward(module, query[b:b + 1, :, s:e], key[b:b + 1, :, keys[0]:keys[1]],
                                         value[b:b + 1, :, keys[0]:keys[1]], None,
                                         is_causal=keys == (s, e), **kwargs)[0]
                  for s, e, keys in runs]
        rows.append(torch.cat(pieces, dim=1))  # [1, T, heads, D], as SDPA's function returns it
    return torch.cat(rows, dim=0), None


def register() -> None:
    """Registers IMPLEMENTATION with transformers (once; registering again changes nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, mask)
