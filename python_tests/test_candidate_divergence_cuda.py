"""token_logprobs with K ids a token and candidate_divergence on a GPU: against the CPU in float64, bf16 against
float64 with eager's error as the scale. Skipped without a GPU."""

import pytest
import torch
from test_candidate_divergence import (
    SHAPES,
    check_reduced_precision_against_float64,
    grads_of,
    make_inputs,
    teacher_for,
)

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(tensors, dtype=None):
    return [t.detach().to("cuda", dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "renormalized"])
def test_cuda_matches_cpu_float64(beta, tail):
    tokens, h, vocab, k = SHAPES[1]
    hidden, weight, b, ids = make_inputs(tokens, h, vocab, k, bias=True)
    teacher = teacher_for(ids, vocab=vocab)
    options = dict(beta=beta, tail=tail, temperature=0.7, softcap=4.0)
    leaves = [hidden, weight, b]
    gpu = to_cuda(leaves)
    want = torch_offload.candidate_divergence(hidden, weight, ids, teacher, bias=b, **options)
    got = torch_offload.candidate_divergence(gpu[0], gpu[1], ids.cuda(), teacher.cuda(), bias=gpu[2], **options)
    upstream = torch.randn(want[0].shape, dtype=torch.float64)
    for g, w in zip(
        [*got, *grads_of(got[:1], [upstream.cuda()], gpu)], [*want, *grads_of(want[:1], [upstream], leaves)]
    ):
        assert g.is_cuda
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    check_reduced_precision_against_float64(dtype, "cuda")
