"""rms_norm against transformers' LlamaRMSNorm (the module itself) in float32 and its formula in float64 (the
module computes float64 in float32): outputs and gradients over several chunks of rows, gradcheck in float64,
bf16/fp16 against float64 with the module's error as the scale, odd layouts, opcheck, torch.compile, meta tensors,
bad arguments, a saved x changed in place, what its backward holds against the module's, its kernel launches against
the tokens, and its backward writing x's gradient over an incoming gradient only autograd holds (and leaving one held
elsewhere alone)."""

import pytest
import torch
from op_recording import peak_allocated_bytes
from torch.testing._internal.optests import opcheck
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import torch_offload

pytestmark = pytest.mark.torch_range


def module_reference(x, weight, eps):
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    norm.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    return norm, norm(x)


def float64_reference(x, weight, eps):
    """The module's formula in float64 throughout (the module itself computes a float64 x in float32)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def make_inputs(shape, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=generator, dtype=dtype)).requires_grad_()
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=generator, dtype=dtype)).requires_grad_()
    return x, weight


def gradients(output, leaves, seed=1):
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed), dtype=output.dtype)
    return torch.autograd.grad(output, leaves, upstream.to(output.device))


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


# One chunk of rows; 32 chunks (600 rows of 4096: 19 a chunk, the last one 11); a 1-D x.
SHAPES = [(2, 7, 16), (600, 4096), (24,)]


@pytest.mark.parametrize("shape", SHAPES, ids=["one_chunk", "32_chunks", "one_row"])
def test_matches_the_transformers_module_in_float32(shape):
    x, weight = make_inputs(shape, torch.float32)
    norm, want = module_reference(x, weight, 1e-5)
    want_grads = gradients(want, [x, norm.weight])
    got = torch_offload.rms_norm(x, weight, 1e-5)
    got_grads = gradients(got, [x, weight])
    assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the module's very operations, row by row
    torch.testing.assert_close(got_grads[0], want_grads[0], rtol=1e-5, atol=1e-6)
    # The weight's gradient sums over the rows chunk by chunk, where the module sums them at once: each within
    # float32's error of the float64 truth, the op's no further from it than the module's.
    x64, weight64 = (t.detach().double().requires_grad_() for t in (x, weight))
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    (truth,) = torch.autograd.grad(float64_reference(x64, weight64, 1e-5), [weight64], upstream.double())
    errors = [relative_error(g, truth) for g in (got_grads[1], want_grads[1])]
    assert errors[0] <= 1.5 * errors[1] + 1e-7, errors


@pytest.mark.parametrize("shape", SHAPES, ids=["one_chunk", "32_chunks", "one_row"])
def test_matches_the_formula_in_float64(shape):
    x, weight = make_inputs(shape)
    want = float64_reference(x, weight, 1e-5)
    got = torch_offload.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    for g, w in zip(gradients(got, [x, weight]), gradients(want, [x, weight])):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64():
    x, weight = make_inputs((3, 5, 8))
    assert torch.autograd.gradcheck(lambda a, w: torch_offload.rms_norm(a, w, 1e-6), (x, weight))


def test_gradcheck_float64_with_eps_zero_and_a_tied_input():
    # eps = 0 (a norm without one) and the weight also scaling x: both inputs' gradients meet.
    x, weight = make_inputs((4, 6))
    assert torch.autograd.gradcheck(lambda a, w: torch_offload.rms_norm(a * w, w, 0.0), (x, weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_is_as_close_to_float64_as_the_module(dtype):
    x, weight = (t.detach().to(dtype).requires_grad_() for t in make_inputs((64, 96)))
    exact = [t.detach().double().requires_grad_() for t in (x, weight)]
    want = torch_offload.rms_norm(*exact, 1e-6)
    want_grads = gradients(want.float(), exact)
    norm, eager = module_reference(x, weight, 1e-6)
    eager_grads = gradients(eager.float(), [x, norm.weight])
    got = torch_offload.rms_norm(x, weight, 1e-6)
    got_grads = gradients(got.float(), [x, weight])
    assert got.dtype == dtype
    assert relative_error(got, want) <= max(1.5 * relative_error(eager, want), 1e-3)
    for g, e, w in zip(got_grads, eager_grads, want_grads):
        assert g.dtype == dtype
        assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2)


def test_odd_layouts_match_contiguous_ones():
    x, weight = make_inputs((6, 10, 8))
    strided = x[:, ::2]
    weight_view = torch.randn(16, dtype=torch.float64)[::2].requires_grad_()
    want = torch_offload.rms_norm(strided.contiguous(), weight_view.detach().contiguous().requires_grad_(), 1e-6)
    got = torch_offload.rms_norm(strided, weight_view, 1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    grads = gradients(got, [x, weight_view])
    assert grads[0][:, 1::2].abs().sum() == 0 and grads[0][:, ::2].abs().sum() > 0


def test_edge_shapes():
    empty = torch.randn(0, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)
    out = torch_offload.rms_norm(empty, weight)
    assert out.shape == (0, 8)
    grad_x, grad_w = torch.autograd.grad(out.sum(), [empty, weight])
    assert grad_x.shape == (0, 8) and torch.equal(grad_w, torch.zeros(8, dtype=torch.float64))


def test_only_the_gradients_asked_for_are_computed():
    x, weight = make_inputs((5, 8))
    frozen = weight.detach()
    (got_x,) = gradients(torch_offload.rms_norm(x, frozen), [x])
    torch.testing.assert_close(got_x, gradients(float64_reference(x, frozen, 1e-6), [x])[0], rtol=1e-12, atol=1e-12)
    grad_x, grad_w = torch.ops.offload.rms_norm_backward(
        torch.ones(5, 8, dtype=torch.float64), x, weight, 1e-6, [False, True]
    )
    assert grad_x is None and grad_w.shape == (8,)


def test_x_changed_in_place_after_forward_is_an_error_in_backward():
    x, weight = make_inputs((5, 8))
    y = x * 1
    out = torch_offload.rms_norm(y, weight)
    y.add_(1)  # the saved x: its version counter says so, as for any autograd formula
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_backward_holds_little_beyond_its_gradients():
    # The module's autograd holds several x-sized float32 gradients at once; the op, x's gradient and a few chunks.
    x, weight = make_inputs((16384, 512), torch.float32)  # 32 MiB against 1 MiB chunks
    upstream = torch.randn(x.shape)
    size = x.numel() * 4
    norm, eager = module_reference(x, weight, 1e-6)
    ours = torch_offload.rms_norm(x, weight, 1e-6)
    eager_peak = peak_allocated_bytes(lambda: torch.autograd.grad(eager, [x, norm.weight], upstream))
    ours_peak = peak_allocated_bytes(lambda: torch.autograd.grad(ours, [x, weight], upstream))
    assert eager_peak > 3 * size, (eager_peak, size)
    assert ours_peak < 1.7 * size, (ours_peak, size)


def aten_calls(fn):
    """How many ATen operations fn runs (each a kernel launch on a GPU, where their count bounds a small op's time)."""
    with torch.profiler.profile() as prof:
        fn()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


def test_kernel_launches_do_not_grow_with_the_tokens():
    # Chunks of a fixed size made a launch count proportional to the tokens: ~10,000 a layer at 32K on a GPU.
    def calls(tokens):
        x, weight = make_inputs((tokens, 4096), torch.float32)
        return aten_calls(lambda: torch.autograd.grad(torch_offload.rms_norm(x, weight).sum(), [x, weight]))

    short, long = calls(512), calls(8192)
    assert short > 100 and long <= 1.5 * short, (short, long)


def allocations_of_at_least(nbytes, fn):
    """How many allocations of at least nbytes fn makes (CPU allocator, as the profiler records it)."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    return sum(1 for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() >= nbytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("frozen_weight", [False, True], ids=["weight", "frozen_weight"])
def test_backward_writes_over_an_incoming_gradient_nothing_else_holds(frozen_weight, dtype):
    # The usual case in a model: the norm's output feeds one module, whose backward hands over a gradient no one
    # else holds. x's gradient is written over it, so backward allocates no x-sized tensor beyond that module's,
    # and the result is the op's, bit for bit.
    x, weight = make_inputs((16384, 512), dtype)  # x: 32 MiB in float32, 32 chunks of rows
    weight.requires_grad_(not frozen_weight)
    upstream = torch.randn(x.shape).to(dtype)
    loss = (torch_offload.rms_norm(x, weight) * upstream).sum()  # MulBackward0 hands over upstream * 1
    leaves = [x] if frozen_weight else [x, weight]
    grads = []
    x_bytes = x.numel() * x.element_size()
    assert allocations_of_at_least(x_bytes, lambda: grads.extend(torch.autograd.grad(loss, leaves))) == 1
    want = torch.ops.offload.rms_norm_backward(upstream, x.detach(), weight.detach(), 1e-6, [True, True])
    for got, expected in zip(grads, want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("holder", ["hook", "retain_grad", "grad_outputs", "residual"])
def test_an_incoming_gradient_held_elsewhere_is_left_as_it_was(holder):
    x, weight = make_inputs((300, 4096), torch.float32)  # 19 chunks of rows
    upstream = torch.randn(x.shape)
    out = torch_offload.rms_norm(x, weight)
    seen = []
    if holder == "hook":
        out.register_hook(seen.append)
    elif holder == "retain_grad":
        out.retain_grad()
    if holder == "grad_outputs":
        incoming = upstream.clone()
        torch.autograd.backward(out, incoming)
        seen.append(incoming)
    elif holder == "residual":  # a sum's backward hands the same gradient to the norm and to the residual
        residual = torch.zeros(x.shape, requires_grad=True)
        ((out + residual) * upstream).sum().backward()
        seen.append(residual.grad)
    else:
        (out * upstream).sum().backward()
        seen.append(out.grad if holder == "retain_grad" else seen[0])
    assert torch.equal(seen[-1], upstream)  # the holder's gradient was not overwritten
    want = torch.ops.offload.rms_norm_backward(upstream, x.detach(), weight.detach(), 1e-6, [True, True])
    assert torch.equal(x.grad, want[0]) and torch.equal(weight.grad, want[1])


def test_create_graph_takes_the_op_path_with_its_missing_double_backward():
    # The incoming gradient (upstream * 1) needs no gradient itself, but with create_graph a graph is being recorded:
    # x's gradient comes from rms_norm_backward, whose own backward is refused, not from operations traced over it.
    x, weight = make_inputs((5, 8))
    upstream = torch.randn(x.shape, dtype=torch.float64)
    (grad_x,) = torch.autograd.grad((torch_offload.rms_norm(x, weight) * upstream).sum(), [x], create_graph=True)
    want = torch.ops.offload.rms_norm_backward(upstream, x.detach(), weight.detach(), 1e-6, [True, False])[0]
    assert torch.equal(grad_x, want)
    with pytest.raises(RuntimeError, match="not implemented"):
        grad_x.sum().backward()


def test_opcheck():
    x, weight = make_inputs((2, 7, 16), torch.float32)
    opcheck(torch.ops.offload.rms_norm.default, (x, weight, 1e-5))
    grad = torch.randn(x.shape)
    for mask in ([True, True], [True, False], [False, True]):
        opcheck(torch.ops.offload.rms_norm_backward.default, (grad, x.detach(), weight.detach(), 1e-5, mask))


def test_compile_fullgraph_dynamic_matches_eager():
    torch._dynamo.reset()
    weight = torch.randn(16, requires_grad=True)

    def norm_then_sum(x):
        return (torch_offload.rms_norm(x, weight, 1e-6) ** 2).sum()

    compiled = torch.compile(norm_then_sum, fullgraph=True, dynamic=True)
    for tokens in (12, 29):
        x = torch.randn(2, tokens, 16, requires_grad=True)
        want = norm_then_sum(x)
        want_grads = torch.autograd.grad(want, [x, weight])
        got = compiled(x)
        got_grads = torch.autograd.grad(got, [x, weight])
        torch.testing.assert_close(got, want)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w)
    explanation = torch._dynamo.explain(norm_then_sum)(torch.randn(2, 12, 16))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_meta_tensors_give_shapes_only():
    x = torch.empty(2, 5, 16, device="meta", dtype=torch.bfloat16)
    weight = torch.empty(16, device="meta", dtype=torch.bfloat16)
    out = torch.ops.offload.rms_norm(x, weight, 1e-6)
    assert (out.shape, out.dtype, out.is_meta) == ((2, 5, 16), torch.bfloat16, True)
    grads = torch.ops.offload.rms_norm_backward(out, x, weight, 1e-6, [False, True])
    assert grads[0] is None and grads[1].shape == (16,)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weight=torch.randn(7)), r"rms_norm: weight has shape \[7\]; expected \[h\], x's last dimension = \[8\]"),
        (dict(weight=torch.randn(8, dtype=torch.float64)), r"rms_norm: weight has dtype Double; expected Float"),
        (dict(weight=torch.randn(1, 8)), r"rms_norm: weight has shape \[1, 8\]"),
        (dict(x=torch.zeros(3, 8, dtype=torch.long)), r"rms_norm: x has dtype Long; expected a floating-point"),
        (dict(x=torch.tensor(1.0)), r"rms_norm: x is a 0-dimensional tensor; expected \[\.\.\., h\]"),
        (dict(x=None), r"rms_norm: x is NoneType; expected a defined tensor"),
        (dict(weight=None), r"rms_norm: weight is NoneType; expected a defined tensor"),
        (dict(eps=-1e-6), r"rms_norm: eps is -1e-06; expected a finite value >= 0"),
        (dict(eps=float("nan")), r"rms_norm: eps is nan"),
    ],
    ids=[
        "weight_size",
        "weight_dtype",
        "weight_rank",
        "integer_x",
        "scalar_x",
        "no_x",
        "no_weight",
        "negative_eps",
        "nan_eps",
    ],
)
def test_bad_arguments_are_refused_by_name(change, message):
    arguments = dict(x=torch.randn(3, 8), weight=torch.randn(8), eps=1e-6)
    arguments.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch_offload.rms_norm(arguments["x"], arguments["weight"], arguments["eps"])


def test_backward_refuses_a_gradient_of_another_shape():
    x, weight = make_inputs((3, 8), torch.float32)
    with pytest.raises(RuntimeError, match=r"rms_norm_backward: grad has shape \[3, 7\]; expected x's shape"):
        torch.ops.offload.rms_norm_backward(torch.randn(3, 7), x, weight, 1e-6, [True, True])
