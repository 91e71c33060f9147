"""token_divergence on a GPU: against the CPU op in float64, bf16/fp16 against float64 with eager's error as the
scale, no [tokens, V] allocation, opcheck. Skipped without a GPU."""

import pytest
import torch
from cuda_allocations import allocation_sizes
from test_token_divergence import MULTI_TILE_VOCAB, gradients, make_heads, run_op, run_reference
from torch.testing._internal.optests import opcheck

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(head, dtype=None, grad=True):
    return [t.detach().to("cuda", dtype).requires_grad_(grad) if t is not None else None for t in head]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_cuda_matches_cpu_op_float64(beta):
    student, teacher, labels = make_heads(shape=(1030,), vocab=MULTI_TILE_VOCAB, bias=True)
    labels[3] = -100
    scores = dict(student_scores=(3.0, 0.7), teacher_scores=(0.0, 1.2))
    want, want_entropy = run_op(student, teacher, labels, beta=beta, temperature=0.8, **scores)
    upstream = torch.randn_like(want)
    want_grads = gradients(want, upstream, student)
    gpu = to_cuda(student)
    got, got_entropy = run_op(gpu, to_cuda(teacher, grad=False), labels.cuda(), beta=beta, temperature=0.8, **scores)
    got_grads = gradients(got, upstream.cuda(), gpu)
    for g, w in zip([got, got_entropy, *got_grads], [want, want_entropy, *want_grads]):
        assert g.is_cuda
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    student64, teacher64, _ = make_heads(shape=(64, 16), vocab=MULTI_TILE_VOCAB, bias=True)
    for beta in (0.0, 0.5, 1.0):
        truth, _ = run_reference(student64, teacher64, beta=beta)
        truth_grads = gradients(truth, torch.ones_like(truth), student64)
        student, teacher = to_cuda(student64, dtype), to_cuda(teacher64, dtype, grad=False)
        ours, _ = run_op(student, teacher, beta=beta)
        eager, _ = run_reference(student, teacher, beta=beta)
        scale = truth.abs().max()
        assert (ours.double().cpu() - truth).abs().max() <= 2 * (
            eager.double().cpu() - truth
        ).abs().max() + 2**-10 * scale
        for got, want, exact in zip(
            gradients(ours, torch.ones_like(ours), student),
            gradients(eager, torch.ones_like(eager), student),
            truth_grads,
        ):
            ours_error = (got.double().cpu() - exact).abs().max()
            eager_error = (want.double().cpu() - exact).abs().max()
            assert ours_error <= 2 * eager_error + 2**-10 * exact.abs().max(), (beta, ours_error, eager_error)


def test_cuda_no_allocation_holds_tokens_by_vocabulary():
    tokens, vocab = 8192, 32000
    student, teacher, _ = make_heads(shape=(tokens,), vocab=vocab, student_width=64, teacher_width=64)
    student, teacher = to_cuda(student, torch.float32), to_cuda(teacher, torch.float32, grad=False)

    def step():
        divergence, _ = run_op(student, teacher, beta=0.5)
        torch.autograd.grad(divergence.sum(), student[:2])

    sizes = allocation_sizes(step)
    assert max(sizes) < tokens * vocab * 4 / 16, max(sizes)


def test_cuda_opcheck():
    student, teacher, labels = make_heads(dtype=torch.float32, bias=True)
    (hs, ws, bs), (ht, wt, bt) = to_cuda(student), to_cuda(teacher, grad=False)
    opcheck(
        torch.ops.offload.token_divergence.default,
        (hs, ws, ht, wt),
        dict(student_bias=bs, teacher_bias=bt, labels=labels.cuda(), beta=0.5),
    )
