"""Distillation from a teacher that is not in the process (a vLLM server, a precomputed dataset): the teacher is given
as log-probabilities of a few candidate tokens per position (its top-k, or its top-1 and the sampled token), and
the student's head is scored at those candidates by ``token_logprobs``, one pass over the vocabulary without the
student's ``[tokens, V]`` logits. What is left, the divergence over K candidates a token, is a few elementwise
operations on ``[tokens, K]`` tensors, here in PyTorch with autograd."""

from __future__ import annotations

import torch

from . import _require_tensor
from .token_logprobs import token_logprobs

__all__ = ["candidate_divergence"]


def _tail_floor(dtype: torch.dtype) -> float:
    """How far below 0 the candidates' summed log-probability is kept, so that the tail bucket's probability (about
    this much at least) and its log and gradient stay finite where the candidates carry, in rounding, the whole mass.
    float32's is TRL's 1e-7 (about float32's epsilon: below it, 1 - sum is rounding); float64's its own epsilon."""
    return 1e-7 if dtype == torch.float32 else torch.finfo(dtype).eps


def candidate_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    candidate_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    softcap: float = 0.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the generalized Jensen-Shannon divergence between the student's and a teacher's next-token
    distributions over the teacher's candidate tokens, and the student's entropy (over the whole vocabulary).

    ``hidden`` is the student's ``[..., h]``, ``weight`` its head ``[V, h]`` (``bias`` ``[V]``), scored as
    ``token_logprobs`` scores: ``softmax(cap(logit_scale * F.linear(hidden, weight, bias)) / temperature)``.
    ``candidate_ids`` (``hidden.shape[:-1] + (K,)``, int64 or int32) are the teacher's candidates at each position,
    ``ignore_index`` in unused slots; ``teacher_logprobs`` (the same shape) the teacher's log-probabilities of them,
    taken as given (no temperature is applied to them) and as constants (no gradient).

    With ``tail=True`` each side's distribution is its candidates' probabilities and one more outcome, the rest of
    the vocabulary, ``1 - sum`` of them (at least about 1e-7 in float32, as TRL's, and float64's epsilon in float64);
    with ``tail=False`` each side's candidates are renormalized to sum to 1 (a side whose counted candidates all have
    probability 0 then has no distribution: NaN, as eager's 0 / 0). The
    divergence is then ``token_divergence``'s over those outcomes: ``beta=0`` ``KL(p_teacher || p_student)``,
    ``beta=1`` ``KL(p_student || p_teacher)``, between them ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with
    ``m = beta p_t + (1 - beta) p_s`` (the sparse-teacher losses of TRL's server and async distillation trainers).

    Returns ``(divergence, entropy)``, each ``hidden.shape[:-1]``, float32 for bf16/fp16 ``hidden``, else its dtype;
    both 0 at a token none of whose candidates counts. Gradients flow from the divergence to ``hidden``, ``weight``
    and ``bias`` through ``token_logprobs``' backward (one more pass over the vocabulary); the entropy has none.
    A candidate listed twice counts twice (as a gather would): give each once. Where a divergence is infinite in
    exact arithmetic (``beta=1`` with a teacher log-probability of -inf at a counted candidate, ``beta=0`` with
    the student's), it is inf here, not TRL's ``nan_to_num`` of it: give such candidates ``ignore_index``.
    ``candidate_ids``' values are checked by ``token_logprobs`` (its errors name them ``ids``).
    """
    for value, arg in (
        (hidden, "hidden"),
        (weight, "weight"),
        (candidate_ids, "candidate_ids"),
        (teacher_logprobs, "teacher_logprobs"),
    ):
        _require_tensor(value, "candidate_divergence", arg)
    if candidate_ids.dim() != hidden.dim() or candidate_ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"candidate_divergence: candidate_ids has shape {tuple(candidate_ids.shape)}; expected hidden's shape "
            f"without h, then K candidates a token: {tuple(hidden.shape[:-1])} + (K,)"
        )
    if teacher_logprobs.shape != candidate_ids.shape:
        raise ValueError(
            f"candidate_divergence: teacher_logprobs has shape {tuple(teacher_logprobs.shape)}; expected "
            f"candidate_ids' shape {tuple(candidate_ids.shape)}"
        )
    if candidate_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"candidate_divergence: candidate_ids has dtype {candidate_ids.dtype}; expected int64 or int32"
        )
    if not teacher_logprobs.is_floating_point():
        raise ValueError(f"candidate_divergence: teacher_logprobs has dtype {teacher_logprobs.dtype}; expected floats")
    if teacher_logprobs.device != hidden.device:
        raise ValueError(
            f"candidate_divergence: teacher_logprobs is on {teacher_logprobs.device} but hidden is on {hidden.device}; "
            "expected hidden's device (a server's answer arrives on the CPU: move it once, with the batch)"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"candidate_divergence: beta is {beta}; expected a value in [0, 1]")
    student, entropy = token_logprobs(
        hidden,
        weight,
        candidate_ids,
        bias=bias,
        temperature=temperature,
        entropy=True,
        softcap=softcap,
        logit_scale=logit_scale,
        ignore_index=ignore_index,
    )
    counted = candidate_ids.ne(ignore_index)
    teacher = teacher_logprobs.detach().to(student.dtype)
    log_student, support = _outcomes(student, counted, tail)
    log_teacher, _ = _outcomes(teacher, counted, tail)
    divergence = _divergence(log_student, log_teacher, support, beta).sum(-1)
    divergence = divergence.masked_fill(counted.any(-1).logical_not(), 0)
    return divergence, entropy.detach()


def _outcomes(logprobs: torch.Tensor, counted: torch.Tensor, tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probabilities of one side's outcomes ([..., K + 1] with the tail, else the candidates renormalized,
    [..., K]) and which of them count. Slots that do not count hold 0 and are never read."""
    masked = logprobs.masked_fill(counted.logical_not(), float("-inf"))
    # A token whose candidates all have probability 0 (none counted, or a bias masking them) sums to 0: logsumexp's
    # backward over only -inf is NaN, so it runs on finite stand-ins there and its result is replaced by -inf.
    some = masked.isfinite().any(-1, keepdim=True)
    log_sum = torch.logsumexp(torch.where(some, masked, torch.zeros_like(masked)), dim=-1, keepdim=True)
    log_sum = torch.where(some, log_sum, torch.full_like(log_sum, float("-inf")))
    if tail:
        log_sum = log_sum.clamp(max=-_tail_floor(logprobs.dtype))
        outcomes = torch.cat([logprobs, torch.log(-torch.expm1(log_sum))], dim=-1)
        support = torch.cat([counted, torch.ones_like(counted[..., :1])], dim=-1)
    else:
        outcomes, support = logprobs - log_sum, counted
    return outcomes.masked_fill(support.logical_not(), 0), support


def _divergence(log_s: torch.Tensor, log_t: torch.Tensor, support: torch.Tensor, beta: float) -> torch.Tensor:
    """Each outcome's term of the generalized JSD; p log(p / q) is 0 where p is 0."""
    p_s = torch.where(support, log_s.exp(), torch.zeros_like(log_s))
    p_t = torch.where(support, log_t.exp(), torch.zeros_like(log_t))

    def kl_term(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        # The gap masked before the product: p = 0 beside log_p = -inf (a logit masked by a bias) would give 0 * inf.
        return p * torch.where(p > 0, log_p - log_q, torch.zeros_like(p))

    if beta == 0.0:
        return kl_term(p_t, log_t, log_s)
    if beta == 1.0:
        return kl_term(p_s, log_s, log_t)
    mixture = beta * p_t + (1 - beta) * p_s
    log_m = torch.log(torch.where(mixture > 0, mixture, torch.ones_like(mixture)))
    return beta * kl_term(p_t, log_t, log_m) + (1 - beta) * kl_term(p_s, log_s, log_m)
