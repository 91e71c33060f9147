"""The LM head's cross-entropy computed in tiles of tokens x vocabulary, so that its [tokens, V]
logits never exist: ``linear_cross_entropy`` (the ``torch.ops.offload.linear_cross_entropy`` op, and
``linear_cross_entropy_with_statistics`` for the z-loss term, accuracy and entropy from the same pass)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _require_tensor

__all__ = ["CrossEntropyStatistics", "linear_cross_entropy", "linear_cross_entropy_tile"]


class CrossEntropyStatistics(NamedTuple):
    """What ``linear_cross_entropy(..., return_statistics=True)`` returns beside the loss, without gradient, each
    reduced as the loss (the mean over the tokens not ignored, their sum, or one per token with 0 where ignored)."""

    z_loss: torch.Tensor
    """The z-loss term, ``z_loss * logsumexp(logits) ** 2``: the part of the loss that ``z_loss`` adds."""
    accuracy: torch.Tensor
    """Whether the target is ``logits.argmax(-1)`` (1 or 0; of tied logits, the first counts, as argmax)."""
    entropy: torch.Tensor
    """The entropy of ``softmax(logits)`` (after ``softcap``)."""


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
    filter_eps: float | str | None = None,
    gradients_in_forward: bool | None = None,
    return_statistics: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, CrossEntropyStatistics]:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the logits (differentiable).

    ``hidden`` is ``[..., h]``, ``weight`` ``[V, h]`` (e.g. the tied embedding matrix),
    ``bias`` ``[V]``, ``target`` ``hidden.shape[:-1]`` of class indices (int64 or int32).
    ``softcap`` replaces the logits by ``softcap * tanh(logits / softcap)`` (Gemma 2);
    ``z_loss`` adds ``z_loss * logsumexp(logits) ** 2`` to each counted token's loss
    (PaLM, OLMo); ``ignore_index`` and ``label_smoothing`` are ``F.cross_entropy``'s.
    ``reduction``: ``"mean"`` over the tokens not ignored (nan when all are), ``"sum"``,
    or ``"none"`` (``target``'s shape, 0 where ignored). The loss is float32 for bf16/fp16
    inputs (as transformers' loss, which upcasts the logits), else ``hidden``'s dtype.

    When a gradient is needed it takes one of two paths, each computing only the gradients
    that are needed (a frozen head gets none), bf16/fp16 ones added up in float32:

    - gradients in forward (3 GEMMs): for each tile of tokens, its logits over the whole
      vocabulary go into one reused slab of at most 64 MiB or 512 tokens, whichever is
      more (``tile_tokens`` tokens when fewer), become the loss's gradient by them on the spot,
      and give hidden's and the weight's gradients; backward only scales those by the incoming
      gradient.
    - recompute (4 GEMMs): forward streams over tiles of ``tile_tokens`` tokens x
      ``tile_vocab`` vocabulary rows with an online log-sum-exp and saves the inputs and a
      float32 log-sum-exp per token; backward recomputes each tile's logits.
      ``tile_* <= 0`` picks the tile from a memory budget (see ``linear_cross_entropy_tile``).

    ``gradients_in_forward=None`` takes the first wherever it applies: ``reduction`` "mean"
    or "sum", no ``filter_eps``, no ``softcap``, and float32/float64 or bfloat16 on a GPU
    (float16's small gradients would underflow in the slab before the loss scale; on a CPU
    bf16/fp16 operands are converted to float32). ``True`` asks for it (a ``ValueError``
    where it does not apply), ``False`` for the recompute. Without a gradient to compute,
    only the forward runs. Neither path has a double backward.

    ``filter_eps`` turns on gradient filtering (Cut Cross-Entropy's), an approximation that
    is off by default: backward skips the two gradient GEMMs of every tile in which each
    gradient entry is at most ``filter_eps`` times its token's weight in the reduction (for
    plain cross-entropy: every softmax probability at most ``filter_eps``), so those tiles add
    nothing. ``"auto"`` is ``torch.finfo(hidden.dtype).eps / 32``, below the dtype's
    resolution. Not with ``label_smoothing``, whose gradient reaches every logit. It pays
    where whole tiles of the vocabulary are improbable for a whole tile of tokens (see
    BENCHMARKS.md); on CUDA each tile's check costs a device synchronization.

    ``return_statistics=True`` returns ``(loss, CrossEntropyStatistics(z_loss, accuracy, entropy))``, the
    statistics that trainers log, computed from the same logits tiles as the loss (no second pass over the
    vocabulary, no second GEMM): each tile is read once more, through a scratch buffer of at most 8 MiB (or one
    row of the vocabulary). The statistics have no gradient.
    """
    for value, arg in ((hidden, "hidden"), (weight, "weight"), (target, "target")):
        _require_tensor(value, "linear_cross_entropy", arg)
    op = (
        torch.ops.offload.linear_cross_entropy_with_statistics
        if return_statistics
        else torch.ops.offload.linear_cross_entropy
    )
    result = op(
        hidden,
        weight,
        bias,
        target,
        ignore_index,
        label_smoothing,
        softcap or 0.0,
        z_loss,
        reduction,
        tile_tokens,
        tile_vocab,
        _filter_threshold(filter_eps, hidden.dtype),
        gradients_in_forward,
    )
    if return_statistics:
        loss, z_loss_term, accuracy, entropy = result
        return loss, CrossEntropyStatistics(z_loss_term, accuracy, entropy)
    return result


def _filter_threshold(filter_eps: float | str | None, dtype: torch.dtype) -> float:
    # The op's filter_eps: 0 turns filtering off.
    if filter_eps is None:
        return 0.0
    if filter_eps == "auto":
        return torch.finfo(dtype).eps / 32
    if isinstance(filter_eps, str):
        raise RuntimeError(f'linear_cross_entropy: filter_eps is {filter_eps!r}; expected None, "auto" or a float')
    return float(filter_eps)


def linear_cross_entropy_tile(tokens: int, vocab: int, *, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """The tile ``(tile_tokens, tile_vocab)`` that ``linear_cross_entropy`` picks for ``tile_* <= 0``.

    Token tiles hold at most 1024 tokens; vocabulary tiles fill an 8 MiB logits buffer
    in ``dtype``, between 256 and 4096 rows of the weight (fewer when the vocabulary is
    smaller); both split their extent evenly. It depends on the shapes and the dtype
    only, so every rank with the same shapes picks the same tile.
    """
    return tuple(torch.ops.offload.linear_cross_entropy_tile(tokens, vocab, dtype))
