"""token_divergence (knowledge distillation's generalized JSD from two LM heads) against eager PyTorch on the
whole logits in float64, gradcheck, opcheck, bf16 against float64 with eager's error as the scale, and an allocation
trace with no [tokens, V] tensor."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

# 8229 rows: three vocabulary tiles at these token counts (linear_cross_entropy_tile's at most 4096 columns).
MULTI_TILE_VOCAB = 8229


def log_probs(hidden, weight, bias, temperature, softcap, logit_scale):
    """Eager PyTorch's log-softmax of a head's whole scores (in float32 for bf16/fp16 logits)."""
    logits = F.linear(hidden, weight, bias)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.log_softmax(logits / temperature, dim=-1)


def reference(student, teacher, labels=None, *, beta=0.5, temperature=1.0, ignore_index=-100):
    """TRL's generalized_jsd_loss per token (reduction none), and the student's entropy, on the whole logits.
    student and teacher: (hidden, weight, bias, softcap, logit_scale)."""
    (hs, ws, bs, s_cap, s_scale), (ht, wt, bt, t_cap, t_scale) = student, teacher
    ls = log_probs(hs, ws, bs, temperature, s_cap, s_scale)
    lt = log_probs(ht, wt, bt, temperature, t_cap, t_scale)
    if beta == 0:
        divergence = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        divergence = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    else:
        lm = torch.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        divergence = beta * F.kl_div(lm, lt, reduction="none", log_target=True).sum(-1) + (1 - beta) * F.kl_div(
            lm, ls, reduction="none", log_target=True
        ).sum(-1)
    entropy = -(ls.exp() * ls).sum(-1)
    if labels is not None:
        ignored = labels.eq(ignore_index)
        divergence, entropy = divergence.masked_fill(ignored, 0), entropy.masked_fill(ignored, 0)
    return divergence, entropy


def make_heads(shape=(2, 3), vocab=19, student_width=8, teacher_width=12, *, bias=False, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, dtype=torch.float64) * scale).to(dtype)

    student = [randn(*shape, student_width), randn(vocab, student_width, scale=0.5), None]
    teacher = [randn(*shape, teacher_width), randn(vocab, teacher_width, scale=0.5), None]
    if bias:
        student[2], teacher[2] = randn(vocab), randn(vocab)
    for t in student:
        if t is not None:
            t.requires_grad_(True)
    labels = torch.randint(0, vocab, shape, generator=generator)
    return student, teacher, labels


def op_options(student_scores=(0.0, 1.0), teacher_scores=(0.0, 1.0), **options):
    return dict(
        student_softcap=student_scores[0],
        student_logit_scale=student_scores[1],
        teacher_softcap=teacher_scores[0],
        teacher_logit_scale=teacher_scores[1],
        **options,
    )


def run_op(student, teacher, labels=None, student_scores=(0.0, 1.0), teacher_scores=(0.0, 1.0), **options):
    (hs, ws, bs), (ht, wt, bt) = student, teacher
    return torch_offload.token_divergence(
        hs,
        ws,
        ht,
        wt,
        student_bias=bs,
        teacher_bias=bt,
        labels=labels,
        **op_options(student_scores, teacher_scores, **options),
    )


def run_reference(student, teacher, labels=None, student_scores=(0.0, 1.0), teacher_scores=(0.0, 1.0), **options):
    return reference((*student, *student_scores), (*teacher, *teacher_scores), labels, **options)


def gradients(output, upstream, inputs):
    return torch.autograd.grad(output, [t for t in inputs if t is not None], upstream)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.1])
@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("vocab", [19, MULTI_TILE_VOCAB])
def test_divergence_entropy_and_gradients_match_eager_float64(beta, temperature, vocab):
    student, teacher, labels = make_heads(vocab=vocab, bias=True)
    labels[0, 1] = -100
    ours, ours_entropy = run_op(student, teacher, labels, beta=beta, temperature=temperature)
    want, want_entropy = run_reference(student, teacher, labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours_entropy, want_entropy.detach(), rtol=1e-10, atol=1e-12)
    assert not ours_entropy.requires_grad
    assert ours[0, 1] == 0 and ours_entropy[0, 1] == 0
    upstream = torch.randn_like(ours)
    for got, expected in zip(gradients(ours, upstream, student), gradients(want, upstream, student)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_soft_caps_logit_scales_and_widths_of_each_head(beta):
    student, teacher, labels = make_heads(vocab=MULTI_TILE_VOCAB, student_width=6, teacher_width=16, bias=True)
    scores = dict(student_scores=(3.0, 0.7), teacher_scores=(5.0, 1.3))
    ours, entropy = run_op(student, teacher, labels, beta=beta, temperature=0.8, **scores)
    want, want_entropy = run_reference(student, teacher, labels, beta=beta, temperature=0.8, **scores)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-10, atol=1e-12)
    upstream = torch.randn_like(ours)
    for got, expected in zip(gradients(ours, upstream, student), gradients(want, upstream, student)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gradcheck_float64(beta):
    student, teacher, labels = make_heads(vocab=7, student_width=3, teacher_width=4, bias=True)
    labels[1, 2] = -100
    (hs, ws, bs), (ht, wt, bt) = student, teacher

    def divergence(hs, ws, bs):
        return torch_offload.token_divergence(
            hs,
            ws,
            ht,
            wt,
            student_bias=bs,
            teacher_bias=bt,
            labels=labels,
            beta=beta,
            temperature=0.7,
            student_softcap=2.0,
            student_logit_scale=1.1,
        )[0]

    assert torch.autograd.gradcheck(divergence, (hs, ws, bs))


def test_the_teacher_and_the_entropy_get_no_gradient():
    student, teacher, labels = make_heads(bias=True)
    for t in teacher:
        t.requires_grad_(True)
    divergence, entropy = run_op(student, teacher, labels)
    grads = torch.autograd.grad(divergence.sum(), [*student, *teacher], allow_unused=True)
    assert all(g is not None for g in grads[:3]) and all(g is None for g in grads[3:])
    assert not entropy.requires_grad


def test_distillation_loss_reduces_as_trl_and_gives_zero_for_an_all_ignored_batch():
    student, teacher, labels = make_heads(bias=False)
    (hs, ws, _), (ht, wt, _) = student, teacher
    labels[0] = -100
    per_token, _ = run_reference(student, teacher, labels, beta=0.5)
    loss = torch_offload.distillation_loss(hs, ws, ht, wt, labels, beta=0.5)
    torch.testing.assert_close(loss, per_token.sum() / labels.ne(-100).sum())
    torch.testing.assert_close(
        torch_offload.distillation_loss(hs, ws, ht, wt, labels, reduction="sum"), per_token.sum()
    )
    everything_ignored = torch.full_like(labels, -100)
    loss = torch_offload.distillation_loss(hs, ws, ht, wt, everything_ignored)
    assert loss.item() == 0.0
    grads = torch.autograd.grad(loss, [hs, ws])
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    with pytest.raises(ValueError, match="reduction is 'mean'"):
        torch_offload.distillation_loss(hs, ws, ht, wt, labels, reduction="mean")


def test_bf16_error_within_eager_bf16_error_against_float64():
    student64, teacher64, labels = make_heads(shape=(4, 16), vocab=MULTI_TILE_VOCAB, bias=True)
    for beta in (0.0, 0.5, 1.0):
        truth, _ = run_reference(student64, teacher64, beta=beta)
        truth_grads = gradients(truth, torch.ones_like(truth), student64)
        student = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in student64]
        teacher = [t.detach().to(torch.bfloat16) for t in teacher64]
        ours, _ = run_op(student, teacher, beta=beta)
        eager, _ = run_reference(student, teacher, beta=beta)
        assert ours.dtype == torch.float32
        scale = truth.abs().max()
        assert (ours.double() - truth).abs().max() <= 2 * (eager.double() - truth).abs().max() + 2**-10 * scale
        for got, want, exact in zip(
            gradients(ours, torch.ones_like(ours), student),
            gradients(eager, torch.ones_like(eager), student),
            truth_grads,
        ):
            ours_error, eager_error = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
            assert ours_error <= 2 * eager_error + 2**-10 * exact.abs().max(), (beta, ours_error, eager_error)


def test_under_autocast_the_heads_run_in_bf16_and_the_outputs_are_float32():
    student, teacher, labels = make_heads(dtype=torch.float32, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, entropy = run_op(student, teacher, labels)
    cast = [[t.detach().to(torch.bfloat16) if t is not None else None for t in head] for head in (student, teacher)]
    want, _ = run_op(*cast, labels)
    assert ours.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(ours, want)
    assert torch.autograd.grad(ours.sum(), student[0])[0].dtype == torch.float32


def test_no_allocation_holds_tokens_by_vocabulary():
    tokens, vocab = 1024, 16384
    student, teacher, _ = make_heads(
        shape=(tokens,), vocab=vocab, student_width=16, teacher_width=16, dtype=torch.float32
    )
    whole = tokens * vocab * 4
    with torch.profiler.profile(profile_memory=True) as prof:
        divergence, _ = run_op(student, teacher, beta=0.5)
        torch.autograd.grad(divergence.sum(), student[:2])
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    assert sizes and max(sizes) < whole / 4, (max(sizes), whole)
    with torch.profiler.profile(profile_memory=True) as prof:
        run_reference(student, teacher, beta=0.5)
    eager = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    assert max(eager) >= whole  # the trace sees a [tokens, V] tensor where one exists


def test_opcheck():
    for bias in (False, True):
        student, teacher, labels = make_heads(dtype=torch.float32, bias=bias)
        (hs, ws, bs), (ht, wt, bt) = student, teacher
        for beta in (0.0, 0.5, 1.0):
            opcheck(
                torch.ops.offload.token_divergence.default,
                (hs, ws, ht, wt),
                dict(student_bias=bs, teacher_bias=bt, labels=labels, beta=beta, **op_options((2.0, 0.5), (0.0, 1.5))),
            )
        forward = torch.ops.offload.token_divergence_forward(
            hs, ws, ht, wt, bs, bt, labels, 0.5, 1.0, 0.0, 1.0, 0.0, 1.0, -100
        )
        detached = [t.detach() if t is not None else None for t in (hs, ws, ht, wt, bs, bt)]
        backward_args = (torch.ones(2, 3), *detached, labels, *(t.detach() for t in forward[2:]))
        opcheck(
            torch.ops.offload.token_divergence_backward.default,
            (*backward_args, 0.5, 1.0, 0.0, 1.0, 0.0, 1.0, -100, [True, True, bias]),
        )


def test_bad_arguments_are_named():
    student, teacher, labels = make_heads(bias=True)
    (hs, ws, bs), (ht, wt, bt) = student, teacher
    call = torch_offload.token_divergence
    cases = [
        (lambda: call(hs, ws, ht, wt[:-1]), "teacher_weight has 18 rows and student_weight 19"),
        (lambda: call(hs, ws, ht.float(), wt), "teacher_hidden has dtype Float"),
        (lambda: call(hs, ws, ht[:1], wt), "teacher_hidden has shape"),
        (lambda: call(hs, ws[:, :-1], ht, wt), "student_weight has shape"),
        (lambda: call(hs, ws, ht, wt, student_bias=bs[:-1]), "student_bias has shape"),
        (lambda: call(hs, ws, ht, wt, teacher_bias=bt.float()), "teacher_bias has dtype"),
        (lambda: call(hs, ws, ht, wt, labels=labels[:1]), "labels has shape"),
        (lambda: call(hs, ws, ht, wt, labels=labels.float()), "labels has dtype"),
        (lambda: call(hs, ws, ht, wt, beta=1.5), "beta is 1.5; expected a value in"),
        (lambda: call(hs, ws, ht, wt, temperature=0.0), "temperature is 0"),
        (lambda: call(hs, ws, ht, wt, teacher_softcap=-1.0), "teacher_softcap is -1"),
        (lambda: call(hs, ws, ht, wt, student_logit_scale=math.inf), "student_logit_scale is inf"),
        (lambda: call(hs, ws, ht.to_sparse(), wt), "teacher_hidden is a sparse COO tensor"),
        (lambda: call(hs, ws, "x", wt), "teacher_hidden"),
    ]
    for bad, message in cases:
        with pytest.raises((RuntimeError, TypeError), match=message):
            bad()
