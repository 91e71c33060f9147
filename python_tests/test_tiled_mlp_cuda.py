"""tiled_mlp on a GPU: the CUDA kernels against the CPU op and plain torch. Skipped without one."""

import pytest
import torch
from cuda_allocations import allocation_sizes
from test_tiled_mlp import (
    ACTIVATIONS,
    GatedMLP,
    assert_close_f32,
    call_tiled,
    check_autocast,
    mlp_inputs,
    outputs_and_grads,
    reference_mlp,
    relative_error,
)
from torch.testing._internal.optests import opcheck

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(inputs, dtype=None):
    return [t.detach().to("cuda", dtype).requires_grad_() if t is not None else None for t in inputs]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_cuda_matches_cpu_op_float64(activation, gated, bias):
    inputs = mlp_inputs((3, 37, 16), gated=gated, bias=bias, dtype=torch.float64)
    gpu = to_cuda(inputs)
    got, got_grads = outputs_and_grads(lambda: call_tiled(gpu, activation, 4), gpu)
    want, want_grads = outputs_and_grads(lambda: call_tiled(inputs, activation, 4), inputs)
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        assert g.is_cuda
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_cuda_float32_matches_untiled_reference(activation):
    gpu = to_cuda(mlp_inputs((2, 300, 64), intermediate=96))
    got, got_grads = outputs_and_grads(lambda: call_tiled(gpu, activation, 7), gpu)
    want, want_grads = outputs_and_grads(lambda: reference_mlp(*gpu, activation=activation), gpu)
    assert_close_f32(got, want)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_reduced_precision_gradients_are_as_close_as_untiled(dtype):
    inputs = to_cuda(mlp_inputs((4096, 64), intermediate=128, seed=3), dtype)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    grad_out = torch.randn(4096, 64, device="cuda").to(dtype)
    _, want = outputs_and_grads(lambda: reference_mlp(*exact), exact, grad_out.double())
    _, tiled = outputs_and_grads(lambda: call_tiled(inputs, num_shards=16), inputs, grad_out)
    _, untiled = outputs_and_grads(lambda: reference_mlp(*inputs), inputs, grad_out)
    for t, u, w in zip(tiled, untiled, want):
        assert t.dtype == dtype
        assert relative_error(t, w) <= relative_error(u, w) * 1.05


def test_cuda_runs_on_the_current_stream_and_device_of_x():
    gpu = to_cuda(mlp_inputs((64, 16)))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = call_tiled(gpu, num_shards=3)
        grads = torch.autograd.grad(out.sum(), gpu)
    stream.synchronize()
    want = reference_mlp(*gpu)
    assert_close_f32(out, want)
    for g, w in zip(grads, torch.autograd.grad(want.sum(), gpu)):
        assert_close_f32(g, w)


def test_opcheck_cuda():
    gpu = to_cuda(mlp_inputs((2, 9, 16)))
    opcheck(torch.ops.offload.tiled_mlp.default, (*gpu, "gelu", 2))
    detached = [t.detach() for t in gpu]
    opcheck(
        torch.ops.offload.tiled_mlp_backward.default,
        (torch.randn(2, 9, 16, device="cuda"), *detached, "gelu", 2, [True] * 7),
    )


def test_device_mismatch_is_rejected_by_name():
    x, w_gate, w_up, w_down, *_ = mlp_inputs((3, 16))
    with pytest.raises(RuntimeError, match="tiled_mlp: w_gate is on cpu but x is on cuda"):
        torch.ops.offload.tiled_mlp(x.detach().cuda(), w_gate, w_up.detach().cuda(), w_down.detach().cuda())


def test_cuda_bf16_backward_holds_no_float32_product_as_large_as_a_weight():
    # Llama-7B's MLP (h 4096, I 11008) in bf16: each weight's float32 gradient accumulator is
    # 172 MiB. Adding each shard's product into it through a whole [I, h] float32 GEMM result
    # would allocate one more as large per shard and weight; the op adds each product into it in the GEMM.
    h, inter, tokens, shards = 4096, 11008, 2048, 4
    generator = torch.Generator("cuda").manual_seed(0)

    def weight(*size):
        return (torch.randn(*size, device="cuda", generator=generator) * 0.02).bfloat16().requires_grad_()

    x = torch.randn(tokens, h, device="cuda", generator=generator).bfloat16()
    w_gate, w_up, w_down = weight(inter, h), weight(inter, h), weight(h, inter)
    out = torch.ops.offload.tiled_mlp(x, w_gate, w_up, w_down, None, None, None, "silu", shards)
    grad_out = torch.randn_like(out)
    sizes = allocation_sizes(lambda: out.backward(grad_out))
    accumulator = inter * h * 4
    assert sum(size >= accumulator for size in sizes) == 3  # the three accumulators, nothing else as large
    assert max(size for size in sizes if size < accumulator) <= inter * h * 2  # the bf16 gradients
    want = torch.nn.functional.linear(
        torch.nn.functional.silu(x.float() @ w_gate.float().t()) * (x.float() @ w_up.float().t()), w_down.float()
    )
    assert relative_error(out, want) < 1e-2


def test_cuda_bf16_weight_gradients_add_up_in_float32_in_the_gemm():
    # Integers of magnitude 1 at most: every product and every sum within a shard is exact in bf16 (at most 256), and
    # the sums over the shards exact in float32 (under 2^24) but not in bf16. The weight gradients, float32 sums
    # rounded once to bf16, are then float64's rounded to bf16: a product rounded or written over the sum, instead
    # of added to it, differs. Nothing else in float32 is as large as a weight: a product stored in a scratch, then
    # added, would be one more per shard and weight.
    tokens, h, inter, shards = 512, 256, 512, 4
    generator = torch.Generator("cuda").manual_seed(0)

    def integers(*size):
        return torch.randint(-1, 2, size, device="cuda", generator=generator).bfloat16()

    x, grad_out = integers(tokens, h), integers(tokens, h)
    w_gate, w_down = integers(inter, h).requires_grad_(), integers(h, inter).requires_grad_()
    out = torch.ops.offload.tiled_mlp(x, w_gate, None, w_down, None, None, None, "relu", shards)
    grads = []
    sizes = allocation_sizes(lambda: grads.extend(torch.autograd.grad(out, (w_gate, w_down), grad_out)))
    exact = [w.detach().double().requires_grad_() for w in (w_gate, w_down)]
    want = torch.autograd.grad(torch.relu(x.double() @ exact[0].t()) @ exact[1].t(), exact, grad_out.double())
    for got, w in zip(grads, want):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, w.bfloat16())
    accumulator = inter * h * 4
    assert sum(size >= accumulator for size in sizes) == 2  # the two accumulators


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_autocast_runs_the_op_in_the_autocast_dtype_like_the_linear_layers(dtype):
    torch.manual_seed(0)
    check_autocast(
        GatedMLP(hidden=64, intermediate=160, bias=True).cuda(),
        torch.randn(2, 300, 64, device="cuda", requires_grad=True),
        dtype,
    )
