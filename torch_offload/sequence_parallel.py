"""Sequence parallelism: attention over a sequence split across the ranks of a process group (Ulysses).

Each rank holds a contiguous chunk of every row's tokens. ``ulysses_attention`` exchanges q, k and v
with one all-to-all each so that every rank holds all of the tokens for a share of the heads, runs
``segment_attention`` there (causal within the segments of the whole rows), and sends the outputs back
with one more all-to-all. The collectives are torch.distributed's functional ones (Gloo on CPUs, NCCL
on GPUs), differentiable, and traced by dynamo.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from .attention_block import segment_attention

IGNORE_INDEX = -100
# What shard_batch splits along the tokens, and the value it pads each with (position_ids: continued).
_SEQUENCE_KEYS = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": None}

__all__ = ["shard_batch", "ulysses_attention"]


def _ready(t: torch.Tensor) -> torch.Tensor:
    """t as a plain tensor: eager functional collectives return an AsyncCollectiveTensor, whose views
    stay one (a leaf's .grad, or a tensor the caller saves, would keep it), waited for here."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _Ready(torch.autograd.Function):
    """The identity, with _ready() on the way forward and on the gradient's way back."""

    @staticmethod
    def forward(ctx, t):
        return _ready(t).view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return _ready(grad)


def _all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single over dim 0 of a contiguous [ranks, ...], differentiable; the result and the
    input's gradient are plain tensors."""
    return _Ready.apply(funcol.all_to_all_single_autograd(_Ready.apply(chunks), None, None, group))


def _heads_to_tokens(t: torch.Tensor, ranks: int, group) -> torch.Tensor:
    """[B, heads, tokens / ranks, D] on each rank -> [B, heads / ranks, tokens, D]: rank r keeps the
    r-th share of the heads, for the tokens of every rank in rank order."""
    batch, heads, local, dim = t.shape
    chunks = t.reshape(batch, ranks, heads // ranks, local, dim).transpose(0, 1).contiguous()
    exchanged = _all_to_all(chunks, group)  # [ranks (source), B, h, local, D]
    return exchanged.permute(1, 2, 0, 3, 4).reshape(batch, heads // ranks, ranks * local, dim)


def _tokens_to_heads(t: torch.Tensor, ranks: int, group) -> torch.Tensor:
    """_heads_to_tokens' inverse: [B, heads / ranks, tokens, D] -> [B, heads, tokens / ranks, D]."""
    batch, heads, tokens, dim = t.shape
    chunks = t.reshape(batch, heads, ranks, tokens // ranks, dim).permute(2, 0, 1, 3, 4).contiguous()
    exchanged = _all_to_all(chunks, group)  # [ranks (source), B, h, local, D]
    return exchanged.transpose(0, 1).reshape(batch, ranks * heads, tokens // ranks, dim)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segment_ids: torch.Tensor,
                      group: dist.ProcessGroup | None = None, *, scale: float | None = None) -> torch.Tensor:
    """Causal attention of a sequence split over ``group``'s ranks, each rank holding a contiguous chunk.

    ``query`` ``[batch, heads, tokens / ranks, head_dim]`` and ``key``, ``value`` ``[batch, kv_heads,
    tokens / ranks, head_dim]`` are this rank's chunk (rank r holds tokens ``[r * tokens / ranks,
    (r + 1) * tokens / ranks)`` of every row); ``segment_ids`` ``[batch, tokens]`` describe the whole rows
    as ``attention_block``'s do (so packed documents may cross ranks). Returns this rank's chunk of the
    output, ``[batch, heads, tokens / ranks, head_dim]``: what ``segment_attention`` gives on the whole
    rows, sliced. ``heads`` must be a multiple of the number of ranks; key/value heads that are not are
    repeated to the query heads (grouped-query attention with fewer key/value heads than ranks).
    Differentiable; every rank must call it with the same shapes.
    """
    ranks = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % ranks:
        raise ValueError(f"ulysses_attention: {heads} query heads cannot be split over {ranks} ranks; "
                         "the query heads must be a multiple of the number of ranks")
    if heads % kv_heads:
        raise ValueError(f"ulysses_attention: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    if segment_ids.dim() != 2 or segment_ids.shape[1] != ranks * query.shape[2]:
        raise ValueError(f"ulysses_attention: segment_ids has shape {list(segment_ids.shape)}; expected the whole "
                         f"rows, [batch, {ranks} ranks x {query.shape[2]} tokens]")
    if kv_heads % ranks:
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    q, k, v = (_heads_to_tokens(t, ranks, group) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]  # the query heads of this rank's share that use each key/value head
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out = segment_attention(q, k, v, segment_ids, scale=scale)
    return _tokens_to_heads(out, ranks, group)


def shard_batch(batch: dict, group: dist.ProcessGroup | None = None) -> dict:
    """This rank's part of a whole batch, for a model whose sequence is split over ``group``'s ranks.

    ``batch`` is what a collator gives a causal LM: ``input_ids`` ``[batch, T]`` and any of ``labels``,
    ``attention_mask``, ``position_ids`` (``[1 or batch, T]``), ``num_items_in_batch``; every rank passes
    the same batch. T is padded to a multiple of the ranks N (input ids and the mask with 0, labels with
    -100, positions continued), so the padding comes after every real token and no real token sees it.
    Rank r gets tokens ``[r * T / N, (r + 1) * T / N)`` of each of them, with:

    - ``shift_labels``: the labels shifted by one token over the whole rows, so a chunk's last token is
      labelled with the next rank's first token (transformers' causal-LM loss takes them instead of
      shifting ``labels`` itself, which is also kept, for the model to compute a loss at all);
    - ``position_ids``: the whole rows' positions (0..T-1 if the batch has none), so the rotary embedding
      sees global positions and packed documents stay packed across ranks;
    - ``num_items_in_batch``: the number of labelled tokens of the whole batch (if the batch does not give
      one already, e.g. counted over accumulation steps): each rank's loss is then its share of the whole
      batch's, and the ranks' losses add up to it.
    Other entries are passed on as they are; another tensor shaped like the tokens (``inputs_embeds``) is
    refused by name, as it would go unsplit.
    """
    return _shard(batch, dist.get_rank(group), dist.get_world_size(group))


def _shard(batch: dict, rank: int, ranks: int) -> dict:
    if "input_ids" not in batch:
        raise ValueError("shard_batch: the batch has no input_ids; expected a causal LM batch (input_ids [batch, T])")
    if "shift_labels" in batch:
        raise ValueError("shard_batch: the batch has shift_labels; pass labels, which shard_batch shifts over the "
                         "whole rows")
    tokens = batch["input_ids"].shape[-1]
    for name, value in batch.items():
        if name not in _SEQUENCE_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 2 and (
                value.shape[1] == tokens):
            raise ValueError(f"shard_batch: {name} has shape {list(value.shape)}, one entry per token, and is not "
                             f"one shard_batch splits ({', '.join(_SEQUENCE_KEYS)})")
        if name in _SEQUENCE_KEYS and (not isinstance(value, torch.Tensor) or value.shape[-1] != tokens):
            raise ValueError(f"shard_batch: {name} has shape {list(getattr(value, 'shape', []))}; expected "
                             f"[batch, {tokens}] like input_ids")
    padding = -tokens % ranks
    local = (tokens + padding) // ranks
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(tokens, device=batch["input_ids"].device)[None]
    if "labels" in batch:
        labels = batch["labels"]
        out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1 + padding), value=IGNORE_INDEX)
        if "num_items_in_batch" not in batch:
            out["num_items_in_batch"] = (labels[:, 1:] != IGNORE_INDEX).sum()
    for name in (*_SEQUENCE_KEYS, "shift_labels"):
        if name not in out:
            continue
        value = out[name]
        if name == "position_ids":
            value = torch.cat([value, value[:, -1:] + torch.arange(1, padding + 1, device=value.device)], dim=1)
        elif name != "shift_labels":
            value = torch.nn.functional.pad(value, (0, padding), value=_SEQUENCE_KEYS[name])
        out[name] = value[:, rank * local:(rank + 1) * local].contiguous()  # transformers views them flat
    return out
