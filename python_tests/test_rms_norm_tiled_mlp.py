"""rms_norm_tiled_mlp: a norm and the tiled MLP after it as one op, against rms_norm then tiled_mlp (values bit for
bit, gradients), float64 gradcheck, opcheck, the gradients a mask asks for, bad inputs."""

import pytest
import torch
from test_tiled_mlp import ACTIVATIONS, SHAPES, mlp_inputs, outputs_and_grads
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

EPS = 1e-5
FUSED = torch.ops.offload.rms_norm_tiled_mlp.default
BACKWARD = torch.ops.offload.rms_norm_tiled_mlp_backward.default


def norm_weight(h, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (1 + 0.5 * torch.randn(h, generator=generator, dtype=torch.float64)).to(dtype).requires_grad_()


def fused(x, weight, mlp, activation="silu", num_shards=0):
    _, w_gate, w_up, w_down, b_gate, b_up, b_down = mlp
    return torch_offload.rms_norm_tiled_mlp(
        x,
        weight,
        w_gate,
        w_up,
        w_down,
        norm_eps=EPS,
        activation=activation,
        num_shards=num_shards,
        b_gate=b_gate,
        b_up=b_up,
        b_down=b_down,
    )


def separate(x, weight, mlp, activation="silu", num_shards=0):
    _, w_gate, w_up, w_down, b_gate, b_up, b_down = mlp
    return torch_offload.tiled_mlp(
        torch_offload.rms_norm(x, weight, EPS),
        w_gate,
        w_up,
        w_down,
        activation=activation,
        num_shards=num_shards,
        b_gate=b_gate,
        b_up=b_up,
        b_down=b_down,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize(("shape", "num_shards"), SHAPES)
def test_values_bit_for_bit_and_gradients_as_the_two_ops(shape, num_shards, gated, dtype):
    mlp = mlp_inputs(shape, gated=gated, dtype=dtype)
    x, weight = mlp[0], norm_weight(shape[-1], dtype)
    leaves = [x, weight, *mlp[1:]]
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, got_grads = outputs_and_grads(lambda: fused(x, weight, mlp, num_shards=num_shards), leaves, grad_out)
    want, want_grads = outputs_and_grads(lambda: separate(x, weight, mlp, num_shards=num_shards), leaves, grad_out)
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        if w is None:
            assert g is None
            continue
        assert g.dtype == dtype
        # x's gradient and the MLP's are the same rows' arithmetic; the norm weight's adds up shard by shard.
        scale = max(w.abs().max().item(), 0.1) if w.numel() else 0.0
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_gradcheck_float64(activation, gated, bias):
    mlp = mlp_inputs((2, 9, 6), intermediate=10, gated=gated, bias=bias, dtype=torch.float64)
    x, weight = mlp[0], norm_weight(6, torch.float64)
    given = [t for t in (x, weight, *mlp[1:]) if t is not None]

    def fn(*tensors):
        it = iter(tensors)
        x, weight = next(it), next(it)
        rest = [next(it) if t is not None else None for t in mlp[1:]]
        return fused(x, weight, (None, *rest), activation, num_shards=4)

    assert torch.autograd.gradcheck(fn, given)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_opcheck(gated):
    _, w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_inputs((3, 5, 8), gated=gated)
    x, weight = torch.randn(3, 5, 8, requires_grad=True), norm_weight(8)
    args = (x, weight, EPS, w_gate, w_up, w_down, b_gate, b_up if gated else None, b_down, "gelu", 2)
    opcheck(FUSED, args)
    grad_out = torch.randn(3, 5, 8)
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    opcheck(BACKWARD, (grad_out, *detached, [True] * 8))


@pytest.mark.parametrize("mask", ["all", "x"])
def test_a_hidden_size_above_the_intermediate_one(mask):
    # h > I: the norm output's gradient needs a buffer of its own (it fits in d_hidden's memory otherwise).
    mlp = mlp_inputs((3, 11, 16), intermediate=8, dtype=torch.float64)
    x, weight = mlp[0], norm_weight(16, torch.float64)
    inputs = [x, weight, *mlp[1:]]
    grad_out = torch.randn(3, 11, 16, dtype=torch.float64)
    want = torch.autograd.grad(separate(x, weight, mlp, num_shards=4), inputs, grad_out)
    output_mask = [True] * 8 if mask == "all" else [True] + [False] * 7
    got = BACKWARD(grad_out, x, weight, EPS, *mlp[1:], "silu", 4, output_mask)
    for g, w, asked in zip(got, want, output_mask):
        if asked:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: fused(x, weight.detach(), mlp, num_shards=4), (x,))


@pytest.mark.parametrize("asked", [0, 1, 2, 4, 7])
def test_the_backward_op_computes_what_its_mask_asks(asked):
    mlp = mlp_inputs((4, 7, 8))
    x, weight = mlp[0], norm_weight(8)
    inputs = [x, weight, *mlp[1:]]
    grad_out = torch.randn(4, 7, 8)
    want = torch.autograd.grad(fused(x, weight, mlp, num_shards=3), inputs, grad_out)
    mask = [i == asked for i in range(8)]
    got = BACKWARD(grad_out, x, weight, EPS, *mlp[1:4], *mlp[4:], "silu", 3, mask)
    assert [g is not None and g.numel() > 0 for g in got] == mask
    torch.testing.assert_close(got[asked], want[asked], rtol=1e-5, atol=1e-6)


def test_bad_inputs_name_the_argument():
    mlp = mlp_inputs((2, 3, 8))
    x = mlp[0]
    cases = {
        "norm_weight has shape": norm_weight(7),
        "norm_weight has dtype": norm_weight(8, torch.float64),
    }
    for message, weight in cases.items():
        with pytest.raises(RuntimeError, match=f"rms_norm_tiled_mlp: {message}"):
            fused(x, weight, mlp)
    for eps in (-1.0, float("nan")):
        with pytest.raises(RuntimeError, match="rms_norm_tiled_mlp: norm_eps is"):
            torch.ops.offload.rms_norm_tiled_mlp(x, norm_weight(8), eps, *mlp[1:4])
    with pytest.raises(RuntimeError, match="rms_norm_tiled_mlp: norm_weight is NoneType"):
        torch_offload.rms_norm_tiled_mlp(x, None, *mlp[1:4])
    with pytest.raises(RuntimeError, match="rms_norm_tiled_mlp: activation is 'tanh'"):
        fused(x, norm_weight(8), mlp, activation="tanh")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_cuda_matches_the_two_ops_and_the_cpu_op(dtype):
    mlp = [t.detach().cuda().requires_grad_() if t is not None else None for t in mlp_inputs((2, 300, 64), 96)]
    mlp = [t.to(dtype).detach().requires_grad_() if t is not None else None for t in mlp]
    x, weight = mlp[0], norm_weight(64, dtype).detach().cuda().requires_grad_()
    leaves = [x, weight, *mlp[1:]]
    got, got_grads = outputs_and_grads(lambda: fused(x, weight, mlp, num_shards=3), leaves)
    want, want_grads = outputs_and_grads(lambda: separate(x, weight, mlp, num_shards=3), leaves)
    assert got.is_cuda
    tolerance = 1e-10 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)  # cuBLAS may differ by buffer
    cpu = [t.detach().cpu().requires_grad_() for t in leaves]
    cpu_out, cpu_grads = outputs_and_grads(lambda: fused(cpu[0], cpu[1], [None, *cpu[2:]], num_shards=3), cpu)
    torch.testing.assert_close(got.cpu(), cpu_out, rtol=tolerance, atol=tolerance)
    for g, w, c in zip(got_grads, want_grads, cpu_grads):
        scale = max(w.abs().max().item(), 0.1)
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance * scale)
        torch.testing.assert_close(g.cpu(), c, rtol=tolerance, atol=tolerance * scale)
