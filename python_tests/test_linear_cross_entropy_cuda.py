"""linear_cross_entropy on a GPU: the CUDA kernels against the CPU op and eager torch, on both paths of the
gradients (the `path` fixture), and no [tokens, V] allocation. Skipped without a GPU."""

import pytest
import torch
from test_linear_cross_entropy import (  # noqa: F401
    OPTIONS,
    assert_close_f32,
    call,
    check_autocast,
    check_cut_cross_entropys_elementwise_criterion,
    improbable_tail_inputs,
    loss_and_grads,
    make_inputs,
    path,
    reference,
    relative_error,
)
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(inputs, dtype=None):
    *tensors, target = inputs
    return [t.detach().to("cuda", dtype).requires_grad_() if t is not None else None for t in tensors] + [target.cuda()]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", OPTIONS, ids=str)
@pytest.mark.usefixtures("path")
def test_cuda_matches_cpu_op_float64(option, reduction):
    kwargs = dict(OPTIONS[option])
    inputs = make_inputs((3, 37, 16), 301, bias=kwargs.pop("bias", False), dtype=torch.float64, ignored_every=5)
    gpu = to_cuda(inputs)
    leaves, gpu_leaves = ([t for t in ins[:3] if t is not None] for ins in (inputs, gpu))
    got, got_grads = loss_and_grads(
        lambda: call(*gpu, reduction=reduction, tile_tokens=16, tile_vocab=64, **kwargs), gpu_leaves
    )
    want, want_grads = loss_and_grads(
        lambda: call(*inputs, reduction=reduction, tile_tokens=16, tile_vocab=64, **kwargs), leaves
    )
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        assert g.is_cuda
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("option", OPTIONS, ids=str)
@pytest.mark.usefixtures("path")
def test_cuda_float32_matches_eager(option):
    kwargs = dict(OPTIONS[option])
    hidden, weight, b, target = to_cuda(
        make_inputs((2, 300, 64), 1000, bias=kwargs.pop("bias", False), ignored_every=7)
    )
    leaves = [t for t in (hidden, weight, b) if t is not None]
    got, got_grads = loss_and_grads(
        lambda: call(hidden, weight, b, target, tile_tokens=128, tile_vocab=256, **kwargs), leaves
    )
    want, want_grads = loss_and_grads(lambda: reference(hidden, weight, target, b, **kwargs), leaves)
    assert_close_f32(got, want)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.usefixtures("path")
def test_cuda_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    inputs = to_cuda(make_inputs((2, 300, 32), 500, bias=True, ignored_every=7), dtype)
    exact = [t.detach().double().requires_grad_() for t in inputs[:3]]
    target = inputs[3]
    want, want_grads = loss_and_grads(lambda: reference(*exact[:2], target, exact[2]), exact)
    eager, eager_grads = loss_and_grads(lambda: reference(*inputs[:2], target, inputs[2]), inputs[:3])
    got, got_grads = loss_and_grads(lambda: call(*inputs, tile_tokens=64, tile_vocab=64), inputs[:3])
    assert got.dtype == torch.float32  # as transformers' loss, which upcasts the logits
    assert relative_error(got, want) <= max(2 * relative_error(eager, want), 4e-3)
    for g, e, w in zip(got_grads, eager_grads, want_grads):
        assert g.dtype == dtype
        assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softcap", [0.0, 20.0], ids=["no_softcap", "softcap"])
def test_cuda_reduced_precision_passes_cut_cross_entropys_elementwise_criterion(dtype, softcap):
    # The tiles are float32 on CUDA too: one GEMM from bf16/fp16 operands into them, unrounded through bias and cap.
    check_cut_cross_entropys_elementwise_criterion(dtype, softcap, "cuda")


@pytest.mark.parametrize("kwargs", [{}, {"softcap": 50.0, "z_loss": 1e-2}], ids=str)
def test_cuda_gradient_filtering_skips_the_tiles_the_cpu_op_skips(kwargs):
    inputs = improbable_tail_inputs(torch.float64)
    gpu = to_cuda(inputs)
    results = [
        loss_and_grads(lambda: call(*ins, tile_tokens=16, tile_vocab=20, filter_eps="auto", **kwargs), ins[:3])
        for ins in (gpu, inputs)
    ]
    (got, got_grads), (want, want_grads) = results
    assert (got_grads[1][40:] == 0).all() and (got_grads[2][40:] == 0).all()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


def test_cuda_allocates_no_tokens_by_vocabulary_tensor(path):  # noqa: F811 (the imported fixture)
    tokens, vocab = 8192, 32000
    hidden, weight, _, target = to_cuda(make_inputs((tokens, 64), vocab))
    call(hidden[:16], weight, None, target[:16]).backward()  # warm up
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call(hidden, weight, None, target).backward()
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - base
    logits_bytes = tokens * vocab * 4
    # The gradients (hidden's and the weight's: 10 MiB) and one 8 MiB tile buffer, or the 64 MiB slab of
    # the gradients in forward; the logits are 1 GiB.
    assert growth < (logits_bytes / 16 if path == "recompute" else (64 + 12) << 20), growth


def test_cuda_bad_target_is_an_error_not_a_crash():
    hidden, weight, _, target = to_cuda(make_inputs((5, 16), 10))
    target[2] = 10
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy: target holds 10 at \(flattened\) index 2"):
        call(hidden, weight, None, target)


def test_cuda_runs_on_the_current_stream():
    hidden, weight, b, target = to_cuda(make_inputs((64, 16), 100, bias=True))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        loss = call(hidden, weight, b, target, tile_tokens=16, tile_vocab=32)
        grads = torch.autograd.grad(loss, (hidden, weight, b))
    stream.synchronize()
    want, want_grads = loss_and_grads(lambda: reference(hidden, weight, target, b), [hidden, weight, b])
    assert_close_f32(loss.detach(), want)
    for g, w in zip(grads, want_grads):
        assert_close_f32(g, w)


def test_cuda_opcheck():
    hidden, weight, b, target = to_cuda(make_inputs((2, 7, 16), 19, bias=True, ignored_every=3))
    opcheck(
        torch.ops.offload.linear_cross_entropy.default, (hidden, weight, b, target, -100, 0.1, 2.0, 1e-3, "mean", 4, 8)
    )
    opcheck(
        torch.ops.offload.linear_cross_entropy.default,
        (hidden, weight, b, target, -100, 0.0, 2.0, 1e-3, "sum", 4, 8, 1e-3),
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_vocabulary_tiles_much_wider_than_a_thread_block_match_eager(reduction):
    # Each forward block (256 threads, one row of the tile) strides 16 times over a 4096-wide
    # tile row and reduces across all its warps; tiles of 256 or less take one stride.
    hidden, weight, b, target = to_cuda(make_inputs((2, 300, 64), 10000, bias=True, ignored_every=7))
    leaves = [hidden, weight, b]
    got, got_grads = loss_and_grads(
        lambda: call(hidden, weight, b, target, reduction=reduction, tile_tokens=128, tile_vocab=4096), leaves
    )
    want, want_grads = loss_and_grads(lambda: reference(hidden, weight, target, b, reduction=reduction), leaves)
    assert_close_f32(got, want)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.usefixtures("path")
def test_cuda_autocast_runs_the_gemms_in_the_autocast_dtype_and_returns_a_float32_loss(dtype):
    check_autocast(*to_cuda(make_inputs((2, 300, 64), 1000, bias=True)), dtype, tile_tokens=64, tile_vocab=512)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["in_forward", "recompute"])
def test_cuda_statistics_match_the_cpu_op(dtype, gradients_in_forward):
    # bf16 tiles stay bf16 on CUDA (float32 on the CPU), so there the two agree to bf16's rounding of a logit, and
    # accuracy may differ where that rounding ties two logits. Tied logits (weight rows 0 and 1 equal) check
    # argmax's first-of-ties rule on the device.
    hidden, weight, b, target = make_inputs((2, 37, 16), 301, bias=True, dtype=torch.float64, ignored_every=5)
    with torch.no_grad():
        weight[1] = weight[0]
    target.view(-1)[::3] = 1
    kwargs = dict(z_loss=1e-3, tile_tokens=16, tile_vocab=64, gradients_in_forward=gradients_in_forward)
    # Leaves that need gradients, so that gradients_in_forward=True takes its path (the slab).
    rounded = [t.detach().to(dtype) for t in (hidden, weight, b)]
    gpu = [t.cuda().requires_grad_() for t in rounded]
    cpu = [t.clone().requires_grad_() for t in rounded]
    got_loss, got = torch_offload.linear_cross_entropy(
        *gpu[:2], target.cuda(), bias=gpu[2], return_statistics=True, **kwargs
    )
    want_loss, want = torch_offload.linear_cross_entropy(
        *cpu[:2], target, bias=cpu[2], return_statistics=True, **kwargs
    )
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_loss.detach().cpu(), want_loss.detach(), **tolerance)
    for g, w in zip(torch.autograd.grad(got_loss, gpu), torch.autograd.grad(want_loss, cpu)):
        if dtype == torch.float64:
            torch.testing.assert_close(g.cpu(), w, **tolerance)
        else:
            assert relative_error(g.cpu(), w) < 2e-2
    loose_accuracy = dict(rtol=0, atol=0.1) if dtype == torch.bfloat16 else tolerance
    for name, g, w in zip(got._fields, got, want):
        assert g.is_cuda, name
        torch.testing.assert_close(g.cpu(), w, **(loose_accuracy if name == "accuracy" else tolerance), msg=name)
