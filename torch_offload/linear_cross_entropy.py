"""The LM head's cross-entropy computed in tiles of tokens x vocabulary, so that its [tokens, V]
logits never exist: ``linear_cross_entropy`` (the ``torch.ops.offload.linear_cross_entropy`` op)."""
from __future__ import annotations

import torch

from . import _require_tensor

__all__ = ["linear_cross_entropy", "linear_cross_entropy_tile"]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    tile_tokens: int = 0,
    tile_vocab: int = 0,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the logits (differentiable).

    ``hidden`` is ``[..., h]``, ``weight`` ``[V, h]`` (e.g. the tied embedding matrix),
    ``bias`` ``[V]``, ``target`` ``hidden.shape[:-1]`` of class indices (int64 or int32).
    ``softcap`` replaces the logits by ``softcap * tanh(logits / softcap)`` (Gemma 2);
    ``z_loss`` adds ``z_loss * logsumexp(logits) ** 2`` to each counted token's loss
    (PaLM, OLMo); ``ignore_index`` and ``label_smoothing`` are ``F.cross_entropy``'s.
    ``reduction``: ``"mean"`` over the tokens not ignored (nan when all are), ``"sum"``,
    or ``"none"`` (``target``'s shape, 0 where ignored). The loss is float32 for bf16/fp16
    inputs (as transformers' loss, which upcasts the logits), else ``hidden``'s dtype.

    Forward streams over tiles of ``tile_tokens`` tokens x ``tile_vocab`` vocabulary
    rows with an online log-sum-exp and saves only the inputs and a float32 log-sum-exp
    per token; backward recomputes each tile's logits and computes only the gradients
    that are needed (a frozen head gets none), bf16/fp16 ones added up in float32.
    ``tile_* <= 0`` picks the tile from a memory budget (see ``linear_cross_entropy_tile``).
    """
    for value, arg in ((hidden, "hidden"), (weight, "weight"), (target, "target")):
        _require_tensor(value, "linear_cross_entropy", arg)
    return torch.ops.offload.linear_cross_entropy(
        hidden, weight, bias, target, ignore_index, label_smoothing, softcap or 0.0, z_loss, reduction,
        tile_tokens, tile_vocab)


def linear_cross_entropy_tile(tokens: int, vocab: int, *, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """The tile ``(tile_tokens, tile_vocab)`` that ``linear_cross_entropy`` picks for ``tile_* <= 0``.

    Token tiles hold at most 1024 tokens; vocabulary tiles fill an 8 MiB logits buffer
    in ``dtype``, between 256 and 4096 rows of the weight (fewer when the vocabulary is
    smaller); both split their extent evenly. It depends on the shapes and the dtype
    only, so every rank with the same shapes picks the same tile.
    """
    return tuple(torch.ops.offload.linear_cross_entropy_tile(tokens, vocab, dtype))
