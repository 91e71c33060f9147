"""Per-token log-probabilities and entropies from the LM head without its [tokens, V] logits, as RL trainers
(GRPO, DPO) take them: ``token_logprobs`` (the ``torch.ops.offload.token_logprobs`` op)."""

from __future__ import annotations

import torch

from . import _require_tensor

__all__ = ["token_logprob_summaries", "token_logprobs"]


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float = 0.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(scores)`` at ``ids``, without the logits (differentiable), where ``scores =
    cap(logit_scale * F.linear(hidden, weight, bias)) / temperature`` and ``cap(z) = softcap * tanh(z / softcap)``
    with ``softcap > 0`` (Gemma 2's final soft-capping; 0: none), as TRL's fused LM head scores tokens.

    ``hidden`` is ``[..., h]``, ``weight`` ``[V, h]`` (e.g. the tied embedding matrix), ``bias``
    ``[V]``, ``ids`` ``hidden.shape[:-1]`` of token ids in ``[0, V)`` or ``ignore_index`` (int64 or int32), or
    ``hidden.shape[:-1] + (K,)`` for K ids a token (a teacher's candidates) under the one softmax, in the same pass.
    Returns the log-probabilities, ``ids``' shape, and with ``entropy=True`` also each token's entropy of
    ``softmax(scores)`` (``hidden.shape[:-1]``) as a tuple, 0 where the id is ``ignore_index`` (which gets no
    gradient; an entropy where every id of its token is). Both are
    float32 for bf16/fp16 inputs (the GEMMs take the input dtype and keep their products in float32), else
    ``hidden``'s dtype.

    The logits exist one tile at a time (the tile of ``linear_cross_entropy_tile``: at most 1024 tokens x 4096
    vocabulary rows, float32 for bf16/fp16 inputs) with a few float32 temporaries of the tile's size; forward
    keeps each token's log-sum-exp (float64) and entropy. Gradients
    flow to ``hidden``, ``weight`` and ``bias`` from any upstream gradient of either output; they are
    computed in backward, which recomputes every tile's logits (the per-token upstream gradients are
    not known in forward: 4 GEMMs in all, against 3 for ``linear_cross_entropy``'s scalar loss). No
    double backward.
    """
    for value, arg in ((hidden, "hidden"), (weight, "weight"), (ids, "ids")):
        _require_tensor(value, "token_logprobs", arg)
    logprobs, entropies = torch.ops.offload.token_logprobs(
        hidden,
        weight,
        ids,
        bias=bias,
        temperature=float(temperature),
        entropy=entropy,
        softcap=float(softcap),
        logit_scale=float(logit_scale),
        ignore_index=ignore_index,
    )
    return (logprobs, entropies) if entropy else logprobs


def token_logprob_summaries(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float = 0.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, what RL trainers log from the LM head, without the logits and without gradients:
    ``(mean of the scores over the vocabulary, whether the id is the first maximum as argmax counts ties,
    log sum_j p_j^2)``, ``ids``' shape (float32 for bf16/fp16 inputs; the second bool), 0 (False) where the id
    is ``ignore_index``; the scores are ``token_logprobs``'. One pass over the vocabulary in its tiles."""
    for value, arg in ((hidden, "hidden"), (weight, "weight"), (ids, "ids")):
        _require_tensor(value, "token_logprob_summaries", arg)
    return torch.ops.offload.token_logprob_summaries(
        hidden,
        weight,
        ids,
        bias=bias,
        temperature=float(temperature),
        softcap=float(softcap),
        logit_scale=float(logit_scale),
        ignore_index=ignore_index,
    )
