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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(F.linear(hidden, weight, bias) / temperature)`` at ``ids``, without the logits (differentiable).

    ``hidden`` is ``[..., h]``, ``weight`` ``[V, h]`` (e.g. the tied embedding matrix), ``bias``
    ``[V]``, ``ids`` ``hidden.shape[:-1]`` of token ids in ``[0, V)`` (int64 or int32). Returns the
    log-probabilities, ``ids``' shape, and with ``entropy=True`` also each token's entropy of
    ``softmax(logits / temperature)`` as a tuple. Both are float32 for bf16/fp16 inputs (the logits'
    GEMMs run in the input dtype, everything after in float32), else ``hidden``'s dtype.

    The logits exist one tile at a time (the tile of ``linear_cross_entropy_tile``: 8 MiB of logits in the
    input dtype, at most 1024 tokens x 4096 vocabulary rows) with a few float32 temporaries of the tile's
    size; forward keeps each token's log-sum-exp (and entropy). Gradients
    flow to ``hidden``, ``weight`` and ``bias`` from any upstream gradient of either output; they are
    computed in backward, which recomputes every tile's logits (the per-token upstream gradients are
    not known in forward: 4 GEMMs in all, against 3 for ``linear_cross_entropy``'s scalar loss). No
    double backward.
    """
    for value, arg in ((hidden, "hidden"), (weight, "weight"), (ids, "ids")):
        _require_tensor(value, "token_logprobs", arg)
    logprobs, entropies = torch.ops.offload.token_logprobs(
        hidden, weight, ids, bias=bias, temperature=float(temperature), entropy=entropy
    )
    return (logprobs, entropies) if entropy else logprobs


def token_logprob_summaries(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, what RL trainers log from the LM head, without the logits and without gradients:
    ``(mean of logits / temperature over the vocabulary, whether the id is the first maximum as argmax
    counts ties, log sum_j p_j^2)``, ``ids``' shape (float32 for bf16/fp16 inputs; the second bool). One
    pass over the vocabulary in ``token_logprobs``' tiles."""
    for value, arg in ((hidden, "hidden"), (weight, "weight"), (ids, "ids")):
        _require_tensor(value, "token_logprob_summaries", arg)
    return torch.ops.offload.token_logprob_summaries(hidden, weight, ids, bias=bias, temperature=float(temperature))
