"""attention_block on a GPU (PyTorch's memory-efficient attention kernels inside): against the
same attention in eager torch and the CPU op. Skipped without a GPU."""
import pytest
import torch
from torch.testing._internal.optests import opcheck

from test_attention_block import NAMES, call, make_inputs, output_and_grads, reference, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(inputs, dtype=None):
    return [t.detach().to("cuda", dtype).requires_grad_(t.requires_grad) if t is not None else None for t in inputs]


@pytest.mark.parametrize("shape", [dict(), dict(bias=True, heads=4, kv_heads=1, head_dim=8), dict(tokens=1),
                                   dict(tokens=300, h=64, heads=8, kv_heads=4, head_dim=16, rotary_batch=2)],
                         ids=["gqa", "one_kv_head_biases", "one_token", "longer"])
def test_cuda_matches_eager_and_the_cpu_op_float32(shape):
    inputs = make_inputs(**shape)
    gpu = to_cuda(inputs)
    grad_out = torch.randn(*inputs[0].shape[:2], inputs[4].shape[0])
    got, got_grads = output_and_grads(call, gpu, grad_out.cuda())
    assert got.is_cuda
    want, want_grads = output_and_grads(reference, gpu, grad_out.cuda())
    cpu, cpu_grads = output_and_grads(call, inputs, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-4, atol=1e-5)
    for name, g, w, c in zip(NAMES, got_grads, want_grads, cpu_grads):
        assert relative_error(g, w) < 1e-4 and relative_error(g.cpu(), c) < 1e-4, name


def test_cuda_bf16_is_as_close_to_float32_as_eager():
    inputs = to_cuda(make_inputs(tokens=128, h=64, heads=8, kv_heads=2, head_dim=16, bias=True))
    low = to_cuda(inputs, torch.bfloat16)
    grad_out = torch.randn(2, 128, 64, device="cuda")
    want, want_grads = output_and_grads(reference, inputs, grad_out)
    eager, eager_grads = output_and_grads(reference, low, grad_out.bfloat16())
    got, got_grads = output_and_grads(call, low, grad_out.bfloat16())
    assert got.dtype == torch.bfloat16
    assert relative_error(got, want) <= max(2 * relative_error(eager, want), 1e-2)
    for name, g, e, w in zip(NAMES, got_grads, eager_grads, want_grads):
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-2), name


def test_cuda_holds_one_head_group_at_a_time():
    # 16384 tokens, 8 heads of 64: eager's q, k, v, attention output and their gradients are
    # 8 x 32 MiB; the op's backward holds x, grad_out, dx and one group's share of those.
    inputs = to_cuda(make_inputs(batch=1, tokens=16384, h=512, heads=8, kv_heads=8, head_dim=64))
    grad_out = torch.randn(1, 16384, 512, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call(*inputs)
    out.backward(grad_out)
    torch.cuda.synchronize()
    one_tensor = 16384 * 512 * 4
    assert torch.cuda.max_memory_allocated() - before < 8 * one_tensor


def test_cuda_opcheck():
    inputs = to_cuda(make_inputs(bias=True))
    opcheck(torch.ops.offload.attention_block.default, (*inputs, None))
    detached = [t.detach() if t is not None else None for t in inputs]
    opcheck(torch.ops.offload.attention_block_backward.default,
            (torch.randn(2, 7, 16, device="cuda"), *detached, 0.5, [True] * 9))


def test_cuda_float64_and_unaligned_head_dimensions_are_refused_by_name():
    inputs = to_cuda(make_inputs(dtype=torch.float64))
    with pytest.raises(RuntimeError, match="attention_block: x is float64, which CUDA's attention kernels do not"):
        call(*inputs)
    inputs = to_cuda(make_inputs(head_dim=4), torch.bfloat16)
    with pytest.raises(RuntimeError, match="attention_block: the head dimension .cos's last dimension. is 4; CUDA's "
                                           "attention kernels need a multiple of 8 for BFloat16"):
        call(*inputs)
