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

__all__ = ["ulysses_attention"]


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
