"""tiled_mlp, TiledMLP and tiled_apply: values and gradients against plain torch, gradcheck,
opcheck, torch.compile, gradients that are not needed, bf16 accumulation, errors."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from op_recording import CountCalls, RecordBackwardMask, gemm_count
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}
F32 = {"rtol": 1e-5, "atol": 1e-6}


def assert_close_f32(got, want):
    """Within 1e-5 of want, relative to want's largest element: gradients are sums over the
    tokens, and where their terms cancel, float32 rounding is relative to the terms, not the sum."""
    scale = max(want.abs().max().item(), 0.1) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def reference_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, activation="silu"):
    """The untiled MLP, same formulas, plain torch."""
    hidden = ACTIVATIONS[activation](F.linear(x, w_gate, b_gate))
    if w_up is not None:
        hidden = hidden * F.linear(x, w_up, b_up)
    return F.linear(hidden, w_down, b_down)


def mlp_inputs(x_shape, intermediate=24, gated=True, bias=True, dtype=torch.float32, seed=0):
    """(x, w_gate, w_up, w_down, b_gate, b_up, b_down), all requiring grad, scaled so outputs are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    h = x_shape[-1]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    x = rand(*x_shape)
    w_gate, w_up = rand(intermediate, h, scale=max(h, 1) ** -0.5), rand(intermediate, h, scale=max(h, 1) ** -0.5)
    w_down = rand(h, intermediate, scale=max(intermediate, 1) ** -0.5)
    b_gate, b_up, b_down = rand(intermediate, scale=0.1), rand(intermediate, scale=0.1), rand(h, scale=0.1)
    return (
        x,
        w_gate,
        w_up if gated else None,
        w_down,
        b_gate if bias else None,
        b_up if bias and gated else None,
        b_down if bias else None,
    )


def call_tiled(inputs, activation="silu", num_shards=0):
    x, w_gate, w_up, w_down, b_gate, b_up, b_down = inputs
    return torch_offload.tiled_mlp(
        x, w_gate, w_up, w_down, activation=activation, num_shards=num_shards, b_gate=b_gate, b_up=b_up, b_down=b_down
    )


def outputs_and_grads(fn, inputs, grad_out=None):
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    out = fn()
    grad_out = torch.ones_like(out) if grad_out is None else grad_out
    return out.detach(), torch.autograd.grad(out, leaves, grad_out, allow_unused=True)


# (x shape, num_shards): 2-D and 3-D x, tokens not divisible by the shards, more shards
# than tokens, a single token (also as a 1-D x), zero tokens (2-D and 3-D), automatic shards.
SHAPES = [
    ((37, 16), 4),
    ((3, 13, 16), 5),
    ((5, 16), 8),
    ((1, 16), 3),
    ((16,), 2),
    ((0, 16), 2),
    ((2, 0, 16), 0),
    ((4, 9, 16), 0),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("x_shape, num_shards", SHAPES, ids=[f"{s}-{n}" for s, n in SHAPES])
def test_matches_untiled_reference_float32(x_shape, num_shards, activation, gated, bias):
    inputs = mlp_inputs(x_shape, gated=gated, bias=bias)
    grad_out = torch.randn(x_shape, generator=torch.Generator().manual_seed(1))
    got, got_grads = outputs_and_grads(lambda: call_tiled(inputs, activation, num_shards), inputs, grad_out)
    want, want_grads = outputs_and_grads(lambda: reference_mlp(*inputs, activation=activation), inputs, grad_out)
    assert got.shape == want.shape == torch.Size(x_shape)
    torch.testing.assert_close(got, want, **F32)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)


# Zero-size dimensions compute what plain torch computes: hidden size 0 (an output
# with no features; the gate is its bias alone), intermediate size 0 (the output is
# b_down alone), and no tokens along with either.
ZERO_SIZES = [((5, 0), 24), ((2, 3, 0), 24), ((0, 0), 24), ((5, 16), 0), ((0, 16), 0)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("x_shape, intermediate", ZERO_SIZES, ids=[f"{s}-I{i}" for s, i in ZERO_SIZES])
def test_zero_size_dimensions_match_plain_torch(x_shape, intermediate, gated, bias):
    inputs = mlp_inputs(x_shape, intermediate=intermediate, gated=gated, bias=bias)
    grad_out = torch.randn(x_shape, generator=torch.Generator().manual_seed(1))
    got, got_grads = outputs_and_grads(lambda: call_tiled(inputs, num_shards=2), inputs, grad_out)
    want, want_grads = outputs_and_grads(lambda: reference_mlp(*inputs), inputs, grad_out)
    assert got.shape == want.shape == torch.Size(x_shape)
    torch.testing.assert_close(got, want, **F32)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, **F32)


@pytest.mark.parametrize("x_shape", [(2, 3, 0), (0, 4)], ids=["hidden_0", "tokens_0"])
def test_tiled_apply_of_zero_size_inputs_matches_plain_torch(x_shape):
    weight = torch.randn(5, x_shape[-1], requires_grad=True)
    x = torch.randn(x_shape, requires_grad=True)
    got = torch_offload.tiled_apply(lambda rows: F.linear(rows, weight), x, [weight], 2)
    want = F.linear(x, weight)
    torch.testing.assert_close(got, want)
    got_grads = torch.autograd.grad(got.sum(), [x, weight])
    want_grads = torch.autograd.grad(want.sum(), [x, weight])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_gradcheck_float64(activation, gated, bias):
    inputs = mlp_inputs((2, 5, 4), intermediate=6, gated=gated, bias=bias, dtype=torch.float64)
    present = [i for i, t in enumerate(inputs) if t is not None]

    def fn(*tensors):
        full = list(inputs)
        for i, t in zip(present, tensors):
            full[i] = t
        return call_tiled(full, activation, num_shards=3)

    assert torch.autograd.gradcheck(fn, [inputs[i] for i in present])


def test_shard_count_does_not_change_the_result():
    inputs = mlp_inputs((50, 16))
    results = [outputs_and_grads(lambda: call_tiled(inputs, num_shards=n), inputs) for n in (0, 1, 2, 7, 50, 64)]
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], **F32)
        for g, w in zip(grads, results[0][1]):
            assert_close_f32(g, w)


@pytest.mark.usefixtures("more_than_one_thread")
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_the_activation_loops_split_over_threads_match_the_reference(gated):
    # 64 x 1024 activations: two of the loops' 32768-element tasks.
    inputs = mlp_inputs((64, 32), intermediate=1024, gated=gated)
    out, grads = outputs_and_grads(lambda: call_tiled(inputs, num_shards=1), inputs)
    want_out, want_grads = outputs_and_grads(lambda: reference_mlp(*inputs), inputs)
    assert_close_f32(out, want_out)
    for got, want in zip(grads, want_grads):
        assert_close_f32(got, want)


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize(
    "tokens, intermediate, gated, dtype, shards",
    [
        (32768, 2816, True, torch.float32, 9),  # 128 MiB / (3 x 2816 x 4 B) = 3971 tokens per shard
        (32768, 2816, False, torch.float32, 6),  # 2 buffers: 5957 tokens per shard
        (131072, 14336, True, torch.bfloat16, 64),  # Llama-3-8B MLP: 1560, so 2048 tokens per shard
        (100000, 16, True, torch.float32, 4),  # at most 32768 tokens per shard
        (8192, 100000, True, torch.bfloat16, 4),  # at least 2048 tokens per shard
        (1, 2816, True, torch.float32, 1),
        (0, 2816, True, torch.float32, 1),
    ],
)
def test_automatic_shard_count_follows_the_documented_budget(tokens, intermediate, gated, dtype, shards):
    assert torch_offload.tiled_mlp_num_shards(tokens, intermediate, gated=gated, dtype=dtype) == shards


def test_automatic_shards_are_the_reported_count():
    inputs = mlp_inputs((15000, 8), intermediate=2816)  # 3971 tokens per shard
    assert torch_offload.tiled_mlp_num_shards(15000, 2816) == 4
    auto = outputs_and_grads(lambda: call_tiled(inputs, num_shards=0), inputs)
    explicit = outputs_and_grads(lambda: call_tiled(inputs, num_shards=4), inputs)
    other = outputs_and_grads(lambda: call_tiled(inputs, num_shards=3), inputs)
    assert all(torch.equal(a, b) for a, b in zip([auto[0], *auto[1]], [explicit[0], *explicit[1]]))
    assert not all(torch.equal(a, b) for a, b in zip([auto[0], *auto[1]], [other[0], *other[1]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_forward_is_close_and_keeps_dtype(dtype):
    inputs64 = mlp_inputs((3, 40, 32), intermediate=64, dtype=torch.float64)
    inputs = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in inputs64]
    out, grads = outputs_and_grads(lambda: call_tiled(inputs, num_shards=3), inputs)
    want, want_grads = outputs_and_grads(lambda: reference_mlp(*inputs64), inputs64)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    tolerance = {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]  # a few roundings of 2^-8 / 2^-11
    for got, expected in zip([out, *grads], [want, *want_grads]):
        assert relative_error(got, expected) < tolerance


def test_bf16_weight_gradients_are_as_close_to_float64_as_the_untiled_bf16_mlp():
    # Many shards and tokens: bf16 accumulation would add a rounding per shard. The float64
    # reference runs on the same (bf16) values, so only the arithmetic's roundings count.
    inputs16 = [t.detach().bfloat16().requires_grad_() for t in mlp_inputs((2048, 64), intermediate=128, seed=3)]
    inputs64 = [t.detach().double().requires_grad_() for t in inputs16]
    grad_out = torch.randn(2048, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    _, want = outputs_and_grads(lambda: reference_mlp(*inputs64), inputs64, grad_out.double())
    _, tiled = outputs_and_grads(lambda: call_tiled(inputs16, num_shards=16), inputs16, grad_out)
    _, untiled = outputs_and_grads(lambda: reference_mlp(*inputs16), inputs16, grad_out)
    names = ["x", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"]
    for name, t, u, w in zip(names, tiled, untiled, want):
        tiled_error, untiled_error = relative_error(t, w), relative_error(u, w)
        # Float32 accumulation: as close as one bf16 rounding of the whole sum, not 16.
        assert tiled_error <= untiled_error * 1.05, (name, tiled_error, untiled_error)


@pytest.mark.parametrize(
    "trainable, expected_mask",
    [
        ({"x"}, [True, False, False, False, False, False, False]),  # frozen MLP (LoRA base weights)
        ({"w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"}, [False, True, True, True, True, True, True]),
        ({"x", "w_down"}, [True, False, False, True, False, False, False]),
        ({"b_down"}, [False, False, False, False, False, False, True]),
    ],
    ids=["frozen_weights", "x_without_grad", "x_and_w_down", "b_down_only"],
)
def test_gradients_not_needed_are_not_computed(trainable, expected_mask):
    names = ["x", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"]
    inputs = [t.detach().requires_grad_(name in trainable) for name, t in zip(names, mlp_inputs((20, 16)))]
    with RecordBackwardMask(torch.ops.offload.tiled_mlp_backward.default) as mode:
        out = call_tiled(inputs, num_shards=4)
        grads = torch.autograd.grad(out.sum(), [t for t in inputs if t.requires_grad])
    assert mode.masks == [expected_mask]
    want = torch.autograd.grad(reference_mlp(*inputs).sum(), [t for t in inputs if t.requires_grad])
    for g, w in zip(grads, want):
        assert_close_f32(g, w)
    # The op returns nothing (None) where the mask says no, and runs fewer GEMMs.
    detached = [t.detach() for t in inputs]
    grad_out = torch.ones(20, 16)

    def backward(mask):
        return torch.ops.offload.tiled_mlp_backward(grad_out, *detached, "silu", 4, mask)

    results = backward(expected_mask)
    assert [r is not None for r in results] == expected_mask
    assert gemm_count(lambda: backward(expected_mask)) < gemm_count(lambda: backward([True] * 7))


def test_b_down_gradient_needs_no_recompute():
    inputs = [t.detach() for t in mlp_inputs((20, 16))]
    mask = [False] * 6 + [True]
    assert gemm_count(lambda: torch.ops.offload.tiled_mlp_backward(torch.ones(20, 16), *inputs, "silu", 4, mask)) == 0


def test_undefined_grads_for_absent_inputs():
    x, w_gate, _, w_down, _, _, _ = [
        t.detach() if t is not None else None for t in mlp_inputs((6, 16), gated=False, bias=False)
    ]
    results = torch.ops.offload.tiled_mlp_backward(
        torch.ones(6, 16), x, w_gate, None, w_down, None, None, None, "gelu", 2, [True] * 7
    )
    assert [r is not None for r in results] == [True, True, False, True, False, False, False]


def opcheck_cases():
    cases = []
    for gated in (True, False):
        for bias in (True, False):
            for requires_grad in (True, False):
                inputs = [
                    t.detach().requires_grad_(requires_grad) if t is not None else None
                    for t in mlp_inputs((2, 7, 16), gated=gated, bias=bias)
                ]
                cases.append(
                    (f"{'gated' if gated else 'plain'}-{'bias' if bias else 'nobias'}-grad{requires_grad}", inputs)
                )
    return cases


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("name, inputs", opcheck_cases(), ids=[c[0] for c in opcheck_cases()])
def test_opcheck_tiled_mlp(name, inputs, activation):
    opcheck(torch.ops.offload.tiled_mlp.default, (*inputs, activation, 3))
    opcheck(
        torch.ops.offload.tiled_mlp.default,
        (inputs[0], inputs[1], inputs[2], inputs[3]),
        {"b_down": inputs[6], "activation": activation},
    )


@pytest.mark.parametrize(
    "mask",
    [[True] * 7, [True, False, False, False, False, False, False], [False, True, True, True, False, False, True]],
    ids=["all", "x_only", "weights"],
)
@pytest.mark.parametrize("name, inputs", opcheck_cases()[::2], ids=[c[0] for c in opcheck_cases()[::2]])
def test_opcheck_tiled_mlp_backward(name, inputs, mask):
    # tiled_mlp_backward has no derivative of its own (no double backward): inputs without grad.
    detached = [t.detach() if t is not None else None for t in inputs]
    grad_out = torch.randn(2, 7, 16)
    opcheck(torch.ops.offload.tiled_mlp_backward.default, (grad_out, *detached, "relu", 2, mask))


def test_double_backward_is_a_clear_error():
    inputs = mlp_inputs((4, 16))
    (grad_x,) = torch.autograd.grad(call_tiled(inputs).sum(), inputs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="derivative for offload::tiled_mlp_backward is not implemented"):
        grad_x.sum().backward()


class GatedMLP(nn.Module):
    """A Hugging Face LlamaMLP lookalike (transformers is not a test dependency)."""

    def __init__(self, hidden=16, intermediate=40, bias=False, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """A CLIPMLP / PhiMLP lookalike: fc1, activation_fn, fc2."""

    def __init__(self, hidden=16, intermediate=40, act=None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.activation_fn = act if act is not None else nn.GELU()

    def forward(self, x):
        return self.fc2(self.activation_fn(self.fc1(x)))


class FusedGateUpMLP(nn.Module):
    """A Phi3MLP lookalike: one gate_up_proj whose rows are the gate's, then the up projection's."""

    def __init__(self, hidden=16, intermediate=40, bias=False, rows=None):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, rows or 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


def hf_style_activation(class_name, fn):
    """A module class named like one of transformers' ACT2FN classes."""
    return type(class_name, (nn.Module,), {"forward": lambda self, x: fn(x)})()


@pytest.mark.parametrize(
    "make_mlp, activation",
    [
        (lambda: GatedMLP(), "silu"),
        (lambda: GatedMLP(bias=True, act=hf_style_activation("SiLUActivation", F.silu)), "silu"),
        (lambda: GatedMLP(act=hf_style_activation("GELUActivation", F.gelu)), "gelu"),
        (lambda: GatedMLP(act=hf_style_activation("PytorchGELUTanh", ACTIVATIONS["gelu_tanh"])), "gelu_tanh"),
        (lambda: GatedMLP(act=hf_style_activation("GELUTanh", ACTIVATIONS["gelu_tanh"])), "gelu_tanh"),
        (lambda: PlainMLP(act=hf_style_activation("NewGELUActivation", ACTIVATIONS["gelu_tanh"])), "gelu_tanh"),
        (lambda: PlainMLP(), "gelu"),
        (lambda: PlainMLP(act=nn.GELU(approximate="tanh")), "gelu_tanh"),
        (lambda: PlainMLP(act=nn.ReLU()), "relu"),
        (lambda: FusedGateUpMLP(), "silu"),
        (lambda: FusedGateUpMLP(bias=True), "silu"),
    ],
    ids=[
        "llama",
        "llama_bias_hf_silu",
        "hf_gelu",
        "hf_pytorch_gelu_tanh",
        "hf_gelu_tanh",
        "hf_new_gelu",
        "fc_gelu",
        "fc_gelu_tanh",
        "fc_relu",
        "phi3_fused_gate_up",
        "fused_gate_up_bias",
    ],
)
def test_tiled_mlp_module_matches_the_module_it_wraps(make_mlp, activation):
    torch.manual_seed(0)
    mlp = make_mlp()
    tiled = torch_offload.TiledMLP(mlp, num_shards=3)
    assert tiled.activation == activation
    assert list(tiled.state_dict()) == list(mlp.state_dict())
    assert all(a is b for a, b in zip(tiled.parameters(), mlp.parameters()))
    x = torch.randn(2, 11, 16, requires_grad=True)
    params = [x, *mlp.parameters()]
    got, got_grads = outputs_and_grads(lambda: tiled(x), params)
    want, want_grads = outputs_and_grads(lambda: mlp(x), params)
    torch.testing.assert_close(got, want, **F32)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)


class LoraLinear(nn.Module):
    """A frozen base nn.Linear plus a trainable low-rank update, as PEFT's LoRA layers."""

    def __init__(self, base, rank=4, dropout=0.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x)))


def lora_mlp(dropout=0.0):
    mlp = GatedMLP()
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, LoraLinear(getattr(mlp, name), dropout=dropout))
    return mlp


@pytest.mark.parametrize(
    "mlp, message",
    [
        (lora_mlp(), "gate_proj is LoraLinear, not a plain nn.Linear.*use torch_offload.tiled_apply"),
        (GatedMLP(act=nn.Tanh()), "activation Tanh.*use torch_offload.tiled_apply"),
        (GatedMLP(act=hf_style_activation("QuickGELUActivation", torch.sigmoid)), "QuickGELUActivation.*tiled_apply"),
        (nn.Sequential(nn.Linear(4, 4)), "none of gate_proj/up_proj/down_proj, gate_up_proj/down_proj.*tiled_apply"),
        (FusedGateUpMLP(intermediate=40, rows=81), "gate_up_proj has 81 rows, not two halves.*tiled_apply"),
    ],
    ids=["lora", "tanh", "quick_gelu", "not_an_mlp", "odd_gate_up"],
)
def test_tiled_mlp_module_rejects_what_the_op_cannot_compute(mlp, message):
    with pytest.raises(ValueError, match=message):
        torch_offload.TiledMLP(mlp)


def test_tiled_mlp_module_rejects_projections_with_hooks():
    mlp = GatedMLP()
    mlp.up_proj.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="up_proj is Linear, not a plain nn.Linear without hooks"):
        torch_offload.TiledMLP(mlp)


def test_tiled_mlp_module_runs_the_mlp_when_its_activation_was_replaced_after_wrapping():
    torch.manual_seed(0)
    mlp = GatedMLP()
    tiled = torch_offload.TiledMLP(mlp, num_shards=3)
    mlp.act_fn = nn.Tanh()  # not one the op computes: the module's own forward, in shards
    x = torch.randn(2, 11, 16, requires_grad=True)
    params = [x, *mlp.parameters()]
    op = torch.ops.offload.tiled_mlp.default
    with CountCalls(op) as mode:
        got, got_grads = outputs_and_grads(lambda: tiled(x), params)
    assert mode.counts[op] == 0
    want, want_grads = outputs_and_grads(lambda: mlp(x), params)
    torch.testing.assert_close(got, want, **F32)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)


@pytest.mark.parametrize("x_shape, num_shards", [((2, 11, 16), 3), ((7, 16), 10), ((0, 16), 2), ((1, 16), 1)])
def test_tiled_apply_on_a_lora_module_matches_untiled(x_shape, num_shards):
    torch.manual_seed(0)
    mlp = lora_mlp()
    trainable = [p for p in mlp.parameters() if p.requires_grad]
    frozen = [p for p in mlp.parameters() if not p.requires_grad]
    x = torch.randn(*x_shape, requires_grad=True)
    got, got_grads = outputs_and_grads(
        lambda: torch_offload.tiled_apply(mlp, x, trainable, num_shards), [x, *trainable]
    )
    want, want_grads = outputs_and_grads(lambda: mlp(x), [x, *trainable])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **F32)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)
    assert all(p.grad is None for p in frozen)


def test_tiled_apply_delivers_each_gradient_once():
    torch.manual_seed(0)
    mlp = lora_mlp()
    trainable = [p for p in mlp.parameters() if p.requires_grad]
    calls = {id(p): 0 for p in trainable}
    for p in trainable:
        p.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(id(p), calls[id(p)] + 1))
    x = torch.randn(40, 16)
    torch_offload.tiled_apply(mlp, x, trainable, 5).square().sum().backward()
    assert set(calls.values()) == {1}
    want = [torch.autograd.grad(mlp(x).square().sum(), p)[0] for p in trainable]
    for p, w in zip(trainable, want):
        assert_close_f32(p.grad, w)


def test_tiled_apply_output_can_be_changed_in_place_as_the_module_output():
    # Falcon: mlp_output += attention_output.
    torch.manual_seed(0)
    mlp = lora_mlp()
    trainable = [p for p in mlp.parameters() if p.requires_grad]
    x, other = torch.randn(2, 20, 16, requires_grad=True), torch.randn(2, 20, 16)

    def loss(run):
        out = run(x)
        out += other
        return out.square().sum()

    got = torch.autograd.grad(loss(lambda x: torch_offload.tiled_apply(mlp, x, trainable, 3)), [x, *trainable])
    want = torch.autograd.grad(loss(mlp), [x, *trainable])
    for g, w in zip(got, want):
        assert_close_f32(g, w)


def test_tiled_apply_accumulates_bf16_gradients_in_float32():
    torch.manual_seed(0)
    weight = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4096, 32, dtype=torch.float64)
    (want,) = torch.autograd.grad(F.linear(x, weight).sum(), weight)
    weight16 = weight.detach().bfloat16().requires_grad_()
    x16 = x.bfloat16()
    tiled_out = torch_offload.tiled_apply(lambda t: F.linear(t, weight16), x16, [weight16], 64)
    (tiled,) = torch.autograd.grad(tiled_out.sum(), weight16)
    (bf16_sum,) = torch.autograd.grad(sum(F.linear(s, weight16).sum() for s in x16.chunk(64)), weight16)
    assert tiled.dtype == torch.bfloat16
    # One rounding at the end instead of one per shard.
    assert relative_error(tiled, want) < relative_error(bf16_sum, want)


def test_tiled_apply_replays_dropout_masks_in_backward():
    torch.manual_seed(0)
    weight = torch.randn(16, requires_grad=True)
    x = torch.randn(30, 16)
    out = torch_offload.tiled_apply(lambda t: F.dropout(t, 0.5, training=True) * weight, x, [weight], 4)
    grad_out = torch.randn(30, 16)
    (grad,) = torch.autograd.grad(out, weight, grad_out)
    # out = dropout(x) * weight, so d(out . grad_out)/dweight is (out / weight * grad_out) summed:
    # it holds only if backward recomputed the masks forward drew.
    assert_close_f32(grad, (out.detach() / weight.detach() * grad_out).sum(0))
    assert (out == 0).any()


def check_autocast(mlp, x, dtype):
    """Under autocast to `dtype` TiledMLP gives what the MLP gives under it, in that dtype, with
    float32 gradients for the float32 parameters."""
    tiled = torch_offload.TiledMLP(mlp, num_shards=3)
    with torch.autocast(x.device.type, dtype=dtype):
        got, want = tiled(x), mlp(x)
    assert got.dtype == want.dtype == dtype
    params = [x, *mlp.parameters()]
    got_grads = torch.autograd.grad(got.float().square().sum(), params)
    want_grads = torch.autograd.grad(want.float().square().sum(), params)
    assert relative_error(got, want) < 1e-2
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.float32  # the parameters' own dtype
        assert relative_error(g, w) < 2e-2


def test_autocast_runs_the_op_in_the_autocast_dtype_like_the_linear_layers():
    torch.manual_seed(0)
    check_autocast(GatedMLP(bias=True), torch.randn(2, 11, 16, requires_grad=True), torch.bfloat16)


def test_tiled_apply_recomputes_under_the_forward_autocast_state():
    weight = torch.randn(8, 16, requires_grad=True)
    seen = []

    def fn(rows):
        out = F.linear(rows, weight)
        seen.append(out.dtype)
        return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch_offload.tiled_apply(fn, torch.randn(10, 16), [weight], 2)
    out.float().sum().backward()
    assert seen == [torch.bfloat16] * 4  # 2 shards in forward, 2 recomputed in backward
    assert weight.grad.dtype == torch.float32


def test_tiled_apply_rejects_bad_shard_counts():
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="tiled_apply: num_shards"):
            torch_offload.tiled_apply(torch.sin, torch.randn(3, 2), [], bad)


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = torch_offload.TiledMLP(GatedMLP(bias=True), num_shards=4)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def test_compile_fullgraph_dynamic_matches_eager_without_graph_breaks():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = MLPBlock()
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for seq in (12, 29):  # two sequence lengths, one dynamic graph
        x = torch.randn(2, seq, 16, requires_grad=True)
        eager_out, eager_grads = outputs_and_grads(lambda: block(x), [x, *block.parameters()])
        compiled_out, compiled_grads = outputs_and_grads(lambda: compiled(x), [x, *block.parameters()])
        torch.testing.assert_close(compiled_out, eager_out, **F32)
        for got, want in zip(compiled_grads, eager_grads):
            assert_close_f32(got, want)
    explanation = torch._dynamo.explain(block)(torch.randn(2, 12, 16))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compiled_backward_calls_the_backward_op():
    torch._dynamo.reset()
    inputs = mlp_inputs((9, 16))
    graphs = []

    def record(graph, _):
        graphs.append(graph.code)
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    compiled = torch.compile(lambda *t: call_tiled(t, num_shards=2), backend=backend, fullgraph=True, dynamic=True)
    compiled(*inputs).sum().backward()
    assert len(graphs) == 2
    assert "offload.tiled_mlp.default" in graphs[0]
    assert "offload.tiled_mlp_backward.default" in graphs[1]


def bad_input_cases():
    x, w_gate, w_up, w_down, b_gate, b_up, b_down = [t.detach() for t in mlp_inputs((3, 16))]
    good = dict(
        x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, activation="silu"
    )
    return [
        (
            "w_gate_h",
            dict(good, w_gate=torch.randn(24, 15)),
            r"w_gate has shape \[24, 15\]; expected \[I, h\] = \[24, 16\]",
        ),
        ("w_gate_1d", dict(good, w_gate=torch.randn(24)), r"w_gate has shape \[24\]; expected \[I, h\]"),
        ("w_up_I", dict(good, w_up=torch.randn(23, 16)), r"w_up has shape \[23, 16\]; expected \[I, h\] = \[24, 16\]"),
        (
            "w_down_I",
            dict(good, w_down=torch.randn(16, 23)),
            r"w_down has shape \[16, 23\]; expected \[h, I\] = \[16, 24\]",
        ),
        ("w_down_h", dict(good, w_down=torch.randn(15, 24)), r"w_down has shape \[15, 24\]"),
        ("dtype", dict(good, w_up=w_up.double()), "w_up has dtype Double but x has Float"),
        ("x_dtype", dict(good, x=x.long()), "x has dtype Long; expected float32, float64, bfloat16 or float16"),
        ("device", dict(good, w_down=w_down.to("meta")), "w_down is on meta but x is on cpu"),
        (
            "activation",
            dict(good, activation="swish"),
            "activation is 'swish'; expected one of silu, gelu, gelu_tanh, relu",
        ),
        ("b_gate", dict(good, b_gate=torch.randn(23)), r"b_gate has shape \[23\]; expected \[I\] = \[24\]"),
        ("b_up", dict(good, b_up=torch.randn(25)), r"b_up has shape \[25\]; expected \[I\] = \[24\]"),
        ("b_down", dict(good, b_down=torch.randn(24)), r"b_down has shape \[24\]; expected \[h\] = \[16\]"),
        ("b_up_without_w_up", dict(good, w_up=None), "b_up is given but w_up is not"),
        ("x_0d", dict(good, x=torch.tensor(1.0)), "x is a 0-d tensor"),
    ]


@pytest.mark.parametrize("name, kwargs, message", bad_input_cases(), ids=[c[0] for c in bad_input_cases()])
def test_bad_inputs_raise_errors_naming_the_argument(name, kwargs, message):
    kwargs = dict(kwargs)
    args = [kwargs.pop(k) for k in ("x", "w_gate", "w_up", "w_down")]
    with pytest.raises(RuntimeError, match=f"tiled_mlp: {message}"):
        torch_offload.tiled_mlp(*args, **kwargs)
    # The backward op checks the same.
    backward_args = [kwargs[k] for k in ("b_gate", "b_up", "b_down")]
    with pytest.raises(RuntimeError, match=f"tiled_mlp_backward: {message}"):
        torch.ops.offload.tiled_mlp_backward(
            torch.ones(3, 16), *args, *backward_args, kwargs["activation"], 0, [True] * 7
        )


def test_missing_tensors_and_bad_grad_out_are_rejected_by_name():
    x, w_gate, w_up, w_down, *_ = [t.detach() for t in mlp_inputs((3, 16))]
    with pytest.raises(RuntimeError, match="tiled_mlp: w_gate is NoneType; expected a defined tensor"):
        torch_offload.tiled_mlp(x, None, w_up, w_down)
    with pytest.raises(RuntimeError, match=r"tiled_mlp_backward: grad_out has shape \[3, 15\]; expected x's shape"):
        torch.ops.offload.tiled_mlp_backward(
            torch.ones(3, 15), x, w_gate, w_up, w_down, None, None, None, "silu", 0, [True] * 7
        )


def test_meta_tensors_give_shapes_only():
    inputs = [t.detach().to("meta") if t is not None else None for t in mlp_inputs((2, 5, 16))]
    out = call_tiled(inputs)
    assert out.is_meta and out.shape == (2, 5, 16)
    grads = torch.ops.offload.tiled_mlp_backward(
        torch.empty(2, 5, 16, device="meta"), *inputs, "silu", 0, [True, True, False, True, False, True, True]
    )
    assert [g.shape if g is not None else None for g in grads] == [
        (2, 5, 16),
        (24, 16),
        None,
        (16, 24),
        None,
        (24,),
        (16,),
    ]


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_every_cpu_kernel_variant_matches_the_reference(capability):
    # ATen picks the widest vector kernels this CPU runs; the environment variable lowers
    # that choice for ATen's kernels and ours, in a fresh process.
    script = (
        "import torch, torch_offload, test_tiled_mlp as t\n"
        "for act in t.ACTIVATIONS:\n"
        "    for dtype in (torch.float32, torch.float64, torch.bfloat16):\n"
        "        inputs = [v.detach().to(dtype).requires_grad_() for v in t.mlp_inputs((3, 45, 16), intermediate=40)]\n"
        "        out, grads = t.outputs_and_grads(lambda: t.call_tiled(inputs, act, 2), inputs)\n"
        "        ref, ref_grads = t.outputs_and_grads(lambda: t.reference_mlp(*inputs, activation=act), inputs)\n"
        "        for a, b in zip([out, *grads], [ref, *ref_grads]):\n"
        "            if dtype == torch.bfloat16:\n"
        "                assert t.relative_error(a, b) < 1e-2\n"
        "            else:\n"
        "                t.assert_close_f32(a, b)\n"
        "print(torch.backends.cpu.get_cpu_capability())\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=os.path.dirname(__file__),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() != "AVX512"  # the lowered choice took effect
