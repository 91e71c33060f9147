"""Distillation from a teacher given as log-probabilities of a few candidates a token: token_logprobs with K ids a
token (against eager's log_softmax gathered at them, gradients of both outputs, gradcheck, opcheck, meta, compile,
bf16 against float64, no [tokens, V] tensor, bad arguments) and candidate_divergence over them (against an eager
float64 reference built from the whole logits, against TRL's async distillation loss, gradcheck)."""

import pytest
import torch
from op_recording import peak_allocated_bytes
from test_token_logprobs import scores
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

IGNORE = -100


def log_softmax_scores(hidden, weight, bias=None, temperature=1.0, softcap=0.0, logit_scale=1.0):
    return torch.log_softmax(scores(hidden, weight, bias, temperature, softcap, logit_scale), dim=-1)


def reference_logprobs(hidden, weight, ids, bias=None, temperature=1.0, softcap=0.0, logit_scale=1.0):
    """Eager: the whole log-softmax gathered at each token's K ids (0 at ignored ones), and each token's entropy
    (0 where every id is ignored)."""
    log_p = log_softmax_scores(hidden, weight, bias, temperature, softcap, logit_scale)
    counted = ids != IGNORE
    logprobs = log_p.gather(-1, ids.clamp_min(0)).masked_fill(~counted, 0)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy.masked_fill(~counted.any(-1), 0)


def make_inputs(tokens, h, vocab, k, bias=False, dtype=torch.float64, seed=0, ignored=0.2):
    """Student inputs and K distinct candidates a token, some slots ignore_index and one token with none."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*tokens, h, generator=generator, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=generator, dtype=dtype) / h**0.5).requires_grad_()
    b = torch.randn(vocab, generator=generator, dtype=dtype).requires_grad_() if bias else None
    ids = torch.rand(*tokens, vocab, generator=generator).argsort(-1)[..., :k]
    ids = ids.masked_fill(torch.rand(ids.shape, generator=generator) < ignored, IGNORE)
    ids.view(-1, k)[0] = IGNORE
    return hidden, weight, b, ids


def grads_of(outputs, upstream, leaves):
    total = sum((o * u).sum() for o, u in zip(outputs, upstream) if u is not None)
    return torch.autograd.grad(total, leaves, allow_unused=True)


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


# One tile; two tiles of tokens and three of the vocabulary (the candidates fall in different vocabulary tiles).
SHAPES = [((2, 7), 16, 19, 4), ((1030,), 8, 4099, 5)]


@pytest.mark.parametrize("tokens, h, vocab, k", SHAPES, ids=["one_tile", "many_tiles"])
@pytest.mark.parametrize("scoring", [{}, dict(temperature=0.7, softcap=2.0, logit_scale=0.5)], ids=["plain", "scored"])
@pytest.mark.parametrize("which", ["logprobs", "entropy", "both"])
def test_several_ids_match_eager_float64_for_any_upstream_gradient(tokens, h, vocab, k, scoring, which):
    hidden, weight, b, ids = make_inputs(tokens, h, vocab, k, bias=True)
    leaves = [hidden, weight, b]
    generator = torch.Generator().manual_seed(1)
    upstream = [
        torch.randn(ids.shape, generator=generator, dtype=torch.float64) if which != "entropy" else None,
        torch.randn(tokens, generator=generator, dtype=torch.float64) if which != "logprobs" else None,
    ]
    want = reference_logprobs(hidden, weight, ids, b, **scoring)
    got = torch_offload.token_logprobs(hidden, weight, ids, bias=b, entropy=True, **scoring)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)
    for g, w in zip(grads_of(got, upstream, leaves), grads_of(want, upstream, leaves)):
        torch.testing.assert_close(g, w)


def test_one_id_in_a_last_dimension_of_one_equals_one_id_a_token():
    hidden, weight, b, ids = make_inputs((3, 6), 8, 29, 1, ignored=0.3)
    single = torch_offload.token_logprobs(hidden, weight, ids[..., 0], bias=b, entropy=True)
    several = torch_offload.token_logprobs(hidden, weight, ids, bias=b, entropy=True)
    torch.testing.assert_close(several[0][..., 0], single[0])
    torch.testing.assert_close(several[1], single[1])


def test_no_candidate_gives_empty_log_probabilities_and_zero_entropy():
    hidden, weight, _, ids = make_inputs((2, 3), 8, 11, 2)
    logprobs, entropy = torch_offload.token_logprobs(hidden, weight, ids[..., :0], entropy=True)
    assert logprobs.shape == (2, 3, 0) and entropy.shape == (2, 3)
    assert (entropy == 0).all()


def test_gradcheck_float64_several_ids_both_outputs():
    hidden, weight, b, ids = make_inputs((2, 3), 5, 13, 3, bias=True)

    def both(hidden, weight, b):
        return torch_offload.token_logprobs(
            hidden, weight, ids, bias=b, temperature=0.8, entropy=True, softcap=3.0, logit_scale=0.7
        )

    assert torch.autograd.gradcheck(both, (hidden, weight, b))


def test_opcheck_and_meta_with_several_ids():
    hidden, weight, b, ids = make_inputs((2, 5), 16, 19, 3, bias=True, dtype=torch.float32)
    opcheck(
        torch.ops.offload.token_logprobs.default, (hidden, weight, ids), dict(bias=b, temperature=0.7, entropy=True)
    )
    detached = [t.detach() for t in (hidden, weight, b)]
    arguments = (0.7, True, 2.0, 0.5, IGNORE)
    opcheck(torch.ops.offload.token_logprobs_forward.default, (detached[0], detached[1], ids, detached[2], *arguments))
    _, entropy, lse = torch.ops.offload.token_logprobs_forward(detached[0], detached[1], ids, detached[2], *arguments)
    grads = (torch.randn(ids.shape), torch.randn(ids.shape[:-1]))
    opcheck(
        torch.ops.offload.token_logprobs_backward.default,
        (*grads, detached[0], detached[1], ids, detached[2], lse, entropy, 0.7, *arguments[2:], [True, True, True]),
    )
    meta = [t.to("meta") for t in (*detached, ids)]
    logprobs, entropy, lse = torch.ops.offload.token_logprobs_forward(meta[0], meta[1], meta[3], meta[2], *arguments)
    assert [tuple(t.shape) for t in (logprobs, entropy, lse)] == [(2, 5, 3), (2, 5), (10,)]


def test_compile_fullgraph_dynamic_with_several_ids():
    torch._dynamo.reset()
    head = torch.nn.Linear(16, 37, bias=False)

    def weighted(x, ids):
        logprobs, entropy = torch_offload.token_logprobs(x, head.weight, ids, entropy=True)
        return (logprobs * torch.arange(ids.shape[-1])).sum() + entropy.sum()

    compiled = torch.compile(weighted, fullgraph=True, dynamic=True)
    for tokens in (12, 29):
        x = torch.randn(2, tokens, 16, requires_grad=True)
        ids = torch.randint(0, 37, (2, tokens, 4))
        want = weighted(x, ids)
        got = compiled(x, ids)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got, [x, head.weight]), torch.autograd.grad(want, [x, head.weight])):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_several_ids_in_reduced_precision_are_as_close_to_float64_as_eager(dtype):
    hidden64, weight64, b64, ids = make_inputs((600,), 32, 5000, 8, bias=True)
    rounded = [t.detach().to(dtype) for t in (hidden64, weight64, b64)]
    inputs = [t.clone().requires_grad_() for t in rounded]
    inputs64 = [t.double().requires_grad_() for t in rounded]
    upstream = [torch.randn(ids.shape), torch.randn(ids.shape[:-1])]
    want = reference_logprobs(*inputs64[:2], ids, inputs64[2], 0.7)
    eager = reference_logprobs(*inputs[:2], ids, inputs[2], 0.7)
    got = torch_offload.token_logprobs(*inputs[:2], ids, bias=inputs[2], temperature=0.7, entropy=True)
    for g, e, w in zip(got, eager, want):
        assert g.dtype == torch.float32
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-3)
    for g, e, w in zip(
        grads_of(got, upstream, inputs), grads_of(eager, upstream, inputs), grads_of(want, upstream, inputs64)
    ):
        assert g.dtype == dtype
        assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2)


def test_several_ids_allocate_no_tensor_of_tokens_by_vocabulary():
    tokens, vocab, k = 2048, 32768, 8
    hidden, weight, b, ids = make_inputs((tokens,), 16, vocab, k, bias=True, dtype=torch.float32)
    teacher = torch.log_softmax(torch.randn(ids.shape), -1)
    full = tokens * vocab * 4

    def step(fn):
        divergence, _ = fn()
        torch.autograd.grad(divergence.sum(), [hidden, weight, b])

    ours = peak_allocated_bytes(
        lambda: step(lambda: torch_offload.candidate_divergence(hidden, weight, ids, teacher, bias=b))
    )
    eager = peak_allocated_bytes(lambda: step(lambda: reference_divergence(hidden, weight, ids, teacher, bias=b)))
    assert eager > full  # the measure sees [tokens, V]
    assert ours < full / 4, (ours, full)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda h, w, ids: torch_offload.token_logprobs(h, w, ids[:, :2]), r"token_logprobs: ids has shape"),
        (
            lambda h, w, ids: torch_offload.token_logprob_summaries(h, w, ids),
            r"token_logprob_summaries: ids has shape \[2, 3, 4\]; expected hidden's shape without h = \[2, 3\]",
        ),
        (
            lambda h, w, ids: torch_offload.token_logprobs(h, w, ids.masked_fill(ids == ids[0, 0, 0], 31)),
            r"token_logprobs: ids holds 31 at \(flattened\) index 0",
        ),
    ],
    ids=["ids_shape", "summaries_take_one_id", "id_too_large"],
)
def test_bad_ids_are_refused_by_name(call, message):
    hidden, weight, _, ids = make_inputs((2, 3), 8, 31, 4, ignored=0.0)
    with pytest.raises(RuntimeError, match=message):
        call(hidden, weight, ids)


def reference_divergence(
    hidden,
    weight,
    ids,
    teacher_logprobs,
    *,
    bias=None,
    beta=0.5,
    temperature=1.0,
    tail=True,
    softcap=0.0,
    logit_scale=1.0,
):
    """Eager, from the whole log-softmax: each side's distribution over the counted candidates plus, with the tail,
    the rest of the vocabulary as one outcome (else renormalized over the candidates); the generalized JSD over those
    outcomes, one sum a token, 0 at a token with no candidate."""
    log_p = log_softmax_scores(hidden, weight, bias, temperature, softcap, logit_scale)
    counted = ids != IGNORE
    p_student = log_p.exp().gather(-1, ids.clamp_min(0)).masked_fill(~counted, 0)
    p_teacher = teacher_logprobs.to(p_student.dtype).exp().masked_fill(~counted, 0)
    if tail:
        p_student = torch.cat([p_student, (1 - p_student.sum(-1, keepdim=True)).clamp_min(0)], -1)
        p_teacher = torch.cat([p_teacher, (1 - p_teacher.sum(-1, keepdim=True)).clamp_min(0)], -1)
    else:  # a token without a candidate sums to 0: kept finite, its divergence dropped below
        p_student = p_student / p_student.sum(-1, keepdim=True).clamp_min(1e-300)
        p_teacher = p_teacher / p_teacher.sum(-1, keepdim=True).clamp_min(1e-300)

    def kl(p, q):
        # Logs of positive values only, so that no NaN reaches the gradient through the branch where() drops.
        def log(x):
            return torch.where(x > 0, x, 1).log()

        return torch.where(p > 0, p * (log(p) - log(q)), 0).sum(-1)

    mixture = beta * p_teacher + (1 - beta) * p_student
    divergence = beta * kl(p_teacher, mixture) + (1 - beta) * kl(p_student, mixture)
    if beta == 0:
        divergence = kl(p_teacher, p_student)
    if beta == 1:
        divergence = kl(p_student, p_teacher)
    entropy = -(log_p.exp() * log_p).sum(-1)
    any_counted = counted.any(-1)
    return torch.where(any_counted, divergence, 0), entropy.masked_fill(~any_counted, 0)


def teacher_for(ids, seed=2, vocab=None):
    """A teacher's log-probabilities at the candidates: of a random distribution over a vocabulary of `vocab`."""
    generator = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(3 * torch.randn(*ids.shape[:-1], vocab, generator=generator, dtype=torch.float64), -1)
    return log_p.gather(-1, ids.clamp_min(0)).masked_fill(ids == IGNORE, float("nan"))  # ignored slots never read


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "renormalized"])
@pytest.mark.parametrize("tokens, h, vocab, k", SHAPES, ids=["one_tile", "many_tiles"])
def test_candidate_divergence_matches_eager_float64(beta, temperature, tail, tokens, h, vocab, k):
    hidden, weight, b, ids = make_inputs(tokens, h, vocab, k, bias=True)
    teacher = teacher_for(ids, vocab=vocab)
    options = dict(bias=b, beta=beta, temperature=temperature, tail=tail, softcap=4.0, logit_scale=0.9)
    got = torch_offload.candidate_divergence(hidden, weight, ids, teacher, **options)
    want = reference_divergence(hidden, weight, ids, teacher, **options)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert got[0].flatten()[0] == 0 and got[1].flatten()[0] == 0  # the token without a candidate
    upstream = torch.randn(got[0].shape, dtype=torch.float64)
    leaves = [hidden, weight, b]
    for g, w in zip(grads_of(got[:1], [upstream], leaves), grads_of(want[:1], [upstream], leaves)):
        assert g.isfinite().all()
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "renormalized"])
def test_candidate_divergence_gradcheck_float64(beta, tail):
    hidden, weight, b, ids = make_inputs((2, 3), 5, 13, 3, bias=True)
    teacher = teacher_for(ids, vocab=13)

    def divergence(hidden, weight, b):
        return torch_offload.candidate_divergence(
            hidden, weight, ids, teacher, bias=b, beta=beta, tail=tail, temperature=0.8
        )[0]

    assert torch.autograd.gradcheck(divergence, (hidden, weight, b))


def assert_divergence_and_gradients_match_eager(hidden, weight, ids, teacher, rtol=None, **options):
    got, _ = torch_offload.candidate_divergence(hidden, weight, ids, teacher, **options)
    want, _ = reference_divergence(hidden, weight, ids, teacher, **options)
    tolerance = dict(rtol=rtol, atol=1e-12) if rtol else {}
    torch.testing.assert_close(got, want, **tolerance)
    leaves = [hidden, weight]
    for g, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
        assert g.isfinite().all()
        torch.testing.assert_close(g, w, **tolerance)


@pytest.mark.parametrize("beta", [0.5, 1.0])
@pytest.mark.parametrize("masked", ["one_candidate", "every_candidate_of_a_token"])
def test_candidates_a_bias_masks_match_eager_with_finite_gradients(beta, masked):
    hidden, weight, _, ids = make_inputs((4,), 8, 17, 3, ignored=0.0)
    bias = torch.zeros(17, dtype=torch.float64)
    bias[ids[1] if masked == "every_candidate_of_a_token" else ids[1, 0]] = float("-inf")  # the student's p is 0
    teacher = teacher_for(ids, vocab=17)
    assert_divergence_and_gradients_match_eager(hidden, weight, ids, teacher, bias=bias, beta=beta)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_confident_student_keeps_its_tail_in_float64(beta):
    # The student's mass outside the candidates is about 3e-9: float32 keeps TRL's floor of 1e-7 there, float64 the
    # exact tail and its gradient (the floor moved the divergence by 10%). The reference's 1 - sum loses the tail's
    # last digits (its gradient 3e-7 off), hence the tolerance.
    weight = torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3, 1, 2]].requires_grad_()
    hidden = torch.tensor([[21.0, 0.0, 0.0, 0.0], [0.0, 3.0, 1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 2]])
    teacher = torch.tensor([[0.9, 0.05], [0.6, 0.3]], dtype=torch.float64).log()
    assert_divergence_and_gradients_match_eager(hidden, weight, ids, teacher, rtol=1e-5, beta=beta)


def test_a_candidate_listed_twice_counts_twice_as_in_eager():
    hidden, weight, _, ids = make_inputs((5,), 8, 17, 4, ignored=0.0)
    ids[:, 3] = ids[:, 0]
    teacher = teacher_for(ids, vocab=17) - 0.5  # the candidates' mass stays below 1 with the repeat counted
    for beta in (0.0, 0.5, 1.0):
        assert_divergence_and_gradients_match_eager(hidden, weight, ids, teacher, beta=beta)


def check_reduced_precision_against_float64(dtype, device):
    """candidate_divergence in dtype on device: as close to float64 as eager in that dtype is, values and
    gradients."""
    hidden, weight, b, ids = make_inputs((2, 600), 64, 5000, 8, bias=True)
    teacher = teacher_for(ids, vocab=5000).to(device)
    inputs = [t.detach().to(device, dtype).requires_grad_() for t in (hidden, weight, b)]
    exact = [t.detach().double().requires_grad_() for t in inputs]
    ids = ids.to(device)
    upstream = [torch.randn(ids.shape[:-1], device=device)]
    want = reference_divergence(*exact[:2], ids, teacher, bias=exact[2], temperature=0.7)
    eager = reference_divergence(*inputs[:2], ids, teacher, bias=inputs[2], temperature=0.7)
    got = torch_offload.candidate_divergence(*inputs[:2], ids, teacher, bias=inputs[2], temperature=0.7)
    for g, e, w in zip(got, eager, want):
        assert g.dtype == torch.float32
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-3)
    grads = [grads_of(d[:1], upstream, leaves) for d, leaves in ((got, inputs), (eager, inputs), (want, exact))]
    for g, e, w in zip(*grads):
        assert g.dtype == dtype
        assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_candidate_divergence_in_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    check_reduced_precision_against_float64(dtype, "cpu")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "renormalized"])
def test_candidate_divergence_equals_trls_async_distillation_loss(beta, tail):
    # TRL is pinned in every venv the tests run in (the Makefile's DEV_PACKAGES): its absence is a failure, not a skip.
    from trl.experimental.async_distillation.async_distillation_trainer import _jsd_loss_chunk as jsd_loss_chunk

    hidden, weight, b, ids = make_inputs((40,), 16, 300, 6, bias=True, dtype=torch.float32)
    ids[0] = ids[1]  # TRL's chunks hold tokens with a candidate only
    teacher = teacher_for(ids, vocab=300).float()
    options = dict(temperature=0.7, softcap=5.0, logit_scale=1.3)
    counted = ids != IGNORE
    trl_loss, *_ = jsd_loss_chunk(
        hidden,
        weight,
        b,
        options["logit_scale"],
        options["softcap"],
        ids,
        teacher.nan_to_num(),
        counted,
        beta,
        options["temperature"],
        tail,
        None,
        1,
    )
    divergence, _ = torch_offload.candidate_divergence(
        hidden, weight, ids, teacher, bias=b, beta=beta, tail=tail, **options
    )
    torch.testing.assert_close(divergence.sum(), trl_loss)
    for g, w in zip(
        torch.autograd.grad(divergence.sum(), [hidden, weight, b]), torch.autograd.grad(trl_loss, [hidden, weight, b])
    ):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(candidate_ids=lambda ids: ids[..., 0]), r"candidate_divergence: candidate_ids has shape \(2, 3\)"),
        (dict(teacher_logprobs=lambda t: t[..., :2]), r"candidate_divergence: teacher_logprobs has shape \(2, 3, 2\)"),
        (dict(teacher_logprobs=lambda t: t.long()), r"candidate_divergence: teacher_logprobs has dtype torch.int64"),
        (dict(beta=1.5), r"candidate_divergence: beta is 1.5; expected a value in \[0, 1\]"),
        (dict(candidate_ids=lambda ids: ids.float()), r"candidate_divergence: candidate_ids has dtype torch.float32"),
        (dict(teacher_logprobs=lambda t: t.to("meta")), r"candidate_divergence: teacher_logprobs is on meta"),
        (dict(teacher_logprobs=lambda t: None), r"candidate_divergence: teacher_logprobs is NoneType"),
    ],
    ids=["ids_without_k", "teacher_shape", "teacher_dtype", "beta", "float_ids", "teacher_elsewhere", "no_teacher"],
)
def test_candidate_divergence_refuses_bad_arguments_by_name(change, message):
    hidden, weight, _, ids = make_inputs((2, 3), 8, 31, 3, ignored=0.0)
    arguments = dict(candidate_ids=ids, teacher_logprobs=teacher_for(ids, vocab=31), beta=0.5)
    for key, value in change.items():
        arguments[key] = value(arguments[key]) if callable(value) else value
    with pytest.raises((ValueError, RuntimeError), match=message):
        torch_offload.candidate_divergence(
            hidden, weight, arguments["candidate_ids"], arguments["teacher_logprobs"], beta=arguments["beta"]
        )
