"""Knowledge distillation from the LM heads without their [tokens, V] logits: ``token_divergence`` (the
``torch.ops.offload.token_divergence`` op) and ``distillation_loss``, its loss as trainers reduce it."""

from __future__ import annotations

import torch

from . import _require_tensor

__all__ = ["distillation_loss", "token_divergence"]


def token_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_softcap: float = 0.0,
    student_logit_scale: float = 1.0,
    teacher_softcap: float = 0.0,
    teacher_logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the generalized Jensen-Shannon divergence between the student's and the teacher's next-token
    distributions, and the student's entropy, without either model's logits.

    Each head scores as ``token_logprobs`` does: ``p = softmax(cap(logit_scale * F.linear(hidden, weight, bias)) /
    temperature)``, each with its own ``softcap`` and ``logit_scale``, one ``temperature``. ``beta=0`` gives
    ``KL(p_teacher || p_student)`` (forward KL), ``beta=1`` ``KL(p_student || p_teacher)`` (reverse KL), and a
    ``beta`` between ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with ``m = beta p_t + (1 - beta) p_s``: TRL's
    and Liger's generalized JSD. ``student_hidden`` is ``[..., h_s]``, ``teacher_hidden`` ``[..., h_t]`` (the widths
    may differ), the weights ``[V, h]`` with one ``V``, all of one dtype; ``labels`` (``[...]`` int64 or int32)
    marks the tokens to skip with ``ignore_index``, which get 0 and no gradient.

    Returns ``(divergence, entropy)``, each ``[...]``, float32 for bf16/fp16 inputs, else the inputs' dtype.
    Gradients flow from the divergence to the student's hidden states, weight and bias only: the teacher's tensors
    are constants, and the entropy (logged by trainers) has none. The logits exist one tile at a time (those of
    ``linear_cross_entropy_tile``, one per model); backward recomputes both heads' tiles. No double backward.
    """
    for value, arg in (
        (student_hidden, "student_hidden"),
        (student_weight, "student_weight"),
        (teacher_hidden, "teacher_hidden"),
        (teacher_weight, "teacher_weight"),
    ):
        _require_tensor(value, "token_divergence", arg)
    return torch.ops.offload.token_divergence(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        student_bias=student_bias,
        teacher_bias=teacher_bias,
        labels=labels,
        beta=float(beta),
        temperature=float(temperature),
        student_softcap=float(student_softcap),
        student_logit_scale=float(student_logit_scale),
        teacher_softcap=float(teacher_softcap),
        teacher_logit_scale=float(teacher_logit_scale),
        ignore_index=ignore_index,
    )


def distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    reduction: str = "batchmean",
    **options,
) -> torch.Tensor:
    """``token_divergence``'s divergence reduced as TRL's ``generalized_jsd_loss`` reduces it: ``"batchmean"`` (the
    sum over the tokens not ignored, divided by their count; 0, not NaN, when every token is ignored), ``"sum"`` or
    ``"none"`` (per token, 0 where ignored). ``options`` are ``token_divergence``'s (``beta``, ``temperature``,
    the biases, soft-caps and logit scales, ``ignore_index``)."""
    if reduction not in ("batchmean", "sum", "none"):
        raise ValueError(f"distillation_loss: reduction is {reduction!r}; expected 'batchmean', 'sum' or 'none'")
    divergence, _ = token_divergence(
        student_hidden, student_weight, teacher_hidden, teacher_weight, labels=labels, **options
    )
    if reduction == "none":
        return divergence
    if reduction == "sum":
        return divergence.sum()
    ignore_index = options.get("ignore_index", -100)
    counted = divergence.numel() if labels is None else labels.ne(ignore_index).sum()
    return divergence.sum() / (counted.clamp(min=1) if isinstance(counted, torch.Tensor) else max(counted, 1))
