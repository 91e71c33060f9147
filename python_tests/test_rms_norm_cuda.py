"""rms_norm on a GPU: against the CPU op in float64, bf16/fp16 against float64 with transformers' module's
error as the scale, opcheck, what its backward holds (also written over the incoming gradient). Skipped without a
GPU."""

import pytest
import torch
from test_rms_norm import gradients, make_inputs, module_reference, relative_error
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_matches_cpu_op_float64():
    x, weight = make_inputs((600, 4096))  # 32 chunks of rows
    gpu = [t.detach().cuda().requires_grad_() for t in (x, weight)]
    want = torch_offload.rms_norm(x, weight, 1e-5)
    got = torch_offload.rms_norm(*gpu, 1e-5)
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(x.shape, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, [x, weight], upstream)
    got_grads = torch.autograd.grad(got, gpu, upstream.cuda())
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_reduced_precision_is_as_close_to_float64_as_the_module(dtype):
    x, weight = (t.detach().to("cuda", dtype).requires_grad_() for t in make_inputs((256, 512)))
    exact = [t.detach().double().requires_grad_() for t in (x, weight)]
    want = torch_offload.rms_norm(*exact, 1e-6)
    norm, eager = module_reference(x, weight, 1e-6)
    got = torch_offload.rms_norm(x, weight, 1e-6)
    assert relative_error(got, want) <= max(1.5 * relative_error(eager, want), 1e-3)
    for g, e, w in zip(
        gradients(got.float(), [x, weight]), gradients(eager.float(), [x, norm.weight]), gradients(want, exact)
    ):
        assert g.dtype == dtype and g.is_cuda
        assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2)


def test_cuda_opcheck():
    x, weight = (t.detach().cuda().float() for t in make_inputs((2, 7, 16)))
    opcheck(torch.ops.offload.rms_norm.default, (x.requires_grad_(), weight.requires_grad_(), 1e-5))
    opcheck(
        torch.ops.offload.rms_norm_backward.default,
        (torch.randn_like(x), x.detach(), weight.detach(), 1e-5, [True, True]),
    )


def test_cuda_backward_holds_little_beyond_its_gradients():
    x, weight = (t.detach().cuda().float().requires_grad_() for t in make_inputs((16384, 512)))
    out = torch_offload.rms_norm(x, weight, 1e-6)
    upstream = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.autograd.grad(out, [x, weight], upstream)
    assert torch.cuda.max_memory_allocated() - before < 1.7 * x.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_backward_writes_over_an_incoming_gradient_nothing_else_holds(dtype):
    x, weight = (t.detach().to("cuda", dtype).requires_grad_() for t in make_inputs((65536, 512)))  # 128 MiB in fp32
    upstream = torch.randn_like(x)
    loss = (torch_offload.rms_norm(x, weight, 1e-6) * upstream).sum()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(loss, [x, weight])
    # MulBackward0's gradient, x's written over it, and a few 4 MiB chunks; the op would add a second x-sized tensor.
    assert torch.cuda.max_memory_allocated() - before < 1.5 * x.numel() * x.element_size()
    want = torch.ops.offload.rms_norm_backward(upstream, x.detach(), weight.detach(), 1e-6, [True, True])
    for got, expected in zip(grads, want):
        assert torch.equal(got, expected)
