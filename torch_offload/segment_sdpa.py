"""The attention function of masking.IMPLEMENTATION: what transformers' SDPA function computes, with segment ids.

Segment ids (masking.mask's answer for packed documents and padded rows) go to the ``segment_attention`` op,
for attention modules ``attention_block`` does not replace and their own forwards, with the call's
``sliding_window``; so does a causal call without a mask whose value heads are narrower than its query's (multi-head
latent attention), which SDPA would run in its math kernel. Anything else goes to transformers' SDPA function
unchanged. Attention dropout in training is SDPA's, one call per run.
"""

from __future__ import annotations

import torch

from .attention_block import segment_attention
from .masking import is_segment_ids


def attend_segments(query, key, value, segment_ids, **mods) -> torch.Tensor:
    """segment_attention of [B, heads, T, D] query, key and value (key/value heads repeated to the query's) with
    the score mods given, as transformers' attention functions return it: [B, T, heads, D]."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    out = segment_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), segment_ids, **mods)
    return out.transpose(1, 2).contiguous()


def _runs(segment_ids: torch.Tensor) -> list[list[tuple[int, int, tuple[int, int] | None]]]:
    """Each row's runs of equal ids, on the host, as (start, end, keys): keys is the run itself for a
    sequence, the nearest sequence before it for padding (a negative id), None for padding before any."""
    if segment_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        # The copy would fail mid-capture, and a replay would not redo it, as in the ops.
        raise RuntimeError(
            "attention dropout with segment ids cannot run while a CUDA graph is being captured "
            "(its runs are read on the host): set attention dropout to 0 or capture without packed batches"
        )
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


def _causal_with_two_head_dims(module, query, key, value, kwargs) -> bool:
    """Whether a call without a mask is causal attention (as sdpa_attention_forward decides it) whose value head
    dimension is not the query's (DeepSeek-V3's latent attention). SDPA's fused CPU kernel takes one head dimension,
    so there SDPA runs its math kernel, which writes out every head's [T, T] scores; segment_attention with one
    segment per row computes the same without them. Dropout stays SDPA's."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return (
        value.shape[-1] != query.shape[-1]
        and bool(causal)
        and not kwargs.get("dropout", 0.0)
        and query.shape[2] == key.shape[2]
        and query.shape[2] > 1
    )


def _attention_with_dropout_per_run(module, query, key, value, segment_ids, **kwargs):
    """SDPA with dropout, one call per run (eager only: the runs are read on the host)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = []
    for b, runs in enumerate(_runs(segment_ids)):
        # Padding sees all of the sequence before it (not causal: every key precedes it), or no key
        # at all, where SDPA gives 0.
        pieces = [
            query.new_zeros(1, e - s, query.shape[1], value.shape[-1])
            if keys is None
            else sdpa_attention_forward(
                module,
                query[b : b + 1, :, s:e],
                key[b : b + 1, :, keys[0] : keys[1]],
                value[b : b + 1, :, keys[0] : keys[1]],
                None,
                is_causal=keys == (s, e),
                **kwargs,
            )[0]
            for s, e, keys in runs
        ]
        rows.append(torch.cat(pieces, dim=1))  # [1, T, heads, D], as SDPA's function returns it
    return torch.cat(rows, dim=0), None


def dense_mask(segment_ids: torch.Tensor, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The [batch, 1, T, T] boolean mask segment ids (and a sliding window) stand for, and which queries have any
    key (padding before every sequence has none: it attends to itself here, and its output is zeroed after)."""
    starts = torch.nn.functional.pad(segment_ids[:, 1:] != segment_ids[:, :-1], (1, 0), value=True)
    run = starts.long().cumsum(dim=1)  # 1, 2, ... per row
    sequence = segment_ids >= 0
    keys_run = torch.where(sequence, run, 0).cummax(dim=1).values  # own run, or the nearest sequence's; 0: none
    positions = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    allowed = (
        (keys_run[:, :, None] == run[:, None, :])
        & sequence[:, None, :]
        & (positions[None, None, :] <= positions[None, :, None])
    )
    if window is not None:
        allowed &= positions[None, :, None] - positions[None, None, :] < window
    has_keys = keys_run > 0
    allowed |= ~has_keys[:, :, None] & (positions[None, None, :] == positions[None, :, None])
    return allowed[:, None], has_keys


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
):
    """The attention function registered for masking.IMPLEMENTATION (query, key, value [B, heads, T, D]).

    With segment ids: the segment_attention op (no [T, T] tensor; one attention call per run). Attention
    dropout in training is not the op's: eager runs SDPA with dropout per run; under torch.compile,
    which cannot read the runs, SDPA gets the dense mask the ids stand for."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None and _causal_with_two_head_dims(module, query, key, value, kwargs):
        attention_mask = query.new_zeros(query.shape[0], query.shape[2], dtype=torch.long)  # one sequence per row
    if not is_segment_ids(attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    window = kwargs.get("sliding_window")  # the layer's, as its mask has it (passes_window in torch_offload.families)
    if kwargs.get("dropout", 0.0):  # transformers passes the module's dropout in training only
        if not torch.compiler.is_compiling() and window is None:
            return _attention_with_dropout_per_run(module, query, key, value, attention_mask, **kwargs)
        allowed, has_keys = dense_mask(attention_mask, window)
        out, _ = sdpa_attention_forward(module, query, key, value, allowed, is_causal=False, **kwargs)
        return out * has_keys[:, :, None, None], None
    return attend_segments(query, key, value, attention_mask, scale=kwargs.get("scaling"), window=window), None
