"""linear_cross_entropy's statistics from the same pass (linear_cross_entropy_with_statistics, and
linear_cross_entropy(..., return_statistics=True)): the z-loss term, token accuracy and entropy against eager
float64 on both gradient paths, every reduction, tiles, soft-cap, ignored tokens, a -inf-masked vocabulary and
tied logits; the loss and its gradients unchanged; bf16 against eager's error; autocast, opcheck, torch.compile;
one pass of GEMMs and a bounded scratch."""

import pytest
import torch
import torch.nn.functional as F
from op_recording import gemm_count, peak_allocated_bytes
from test_linear_cross_entropy import make_inputs, reference
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range


def eager_statistics(hidden, weight, target, bias=None, softcap=None, z_loss=0.0, reduction="mean"):
    """(z-loss term, accuracy, entropy) from the whole logits, each reduced as the loss."""
    logits = F.linear(hidden, weight, bias).detach()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    valid = flat_target != -100
    probabilities = logits.softmax(-1)
    per_token = [
        z_loss * logits.logsumexp(-1).square(),
        (logits.argmax(-1) == flat_target).to(logits.dtype),
        -torch.special.xlogy(probabilities, probabilities).sum(-1),
    ]
    per_token = [torch.where(valid, value, 0.0) for value in per_token]
    if reduction == "mean":
        return [value.sum() / valid.sum() for value in per_token]
    if reduction == "sum":
        return [value.sum() for value in per_token]
    return [value.view(target.shape) for value in per_token]


def with_statistics(hidden, weight, target, bias=None, **kwargs):
    loss, statistics = torch_offload.linear_cross_entropy(
        hidden, weight, target, bias=bias, return_statistics=True, **kwargs
    )
    return loss, statistics


PATHS = {"in_forward": {"gradients_in_forward": True}, "recompute": {"gradients_in_forward": False}}
CASES = {
    "tiles": {"tile_tokens": 8, "tile_vocab": 16},
    "one_tile": {},
    "softcap_z_loss": {"softcap": 3.0, "z_loss": 1e-2, "tile_tokens": 5, "tile_vocab": 7},
    "smoothing": {"label_smoothing": 0.1, "tile_tokens": 8, "tile_vocab": 16},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_statistics_loss_and_gradients_match_eager_float64(path, case, reduction):
    kwargs = dict(CASES[case], reduction=reduction, **PATHS[path])
    if path == "in_forward" and (reduction == "none" or "softcap" in kwargs):
        kwargs["gradients_in_forward"] = None  # gradients in forward do not apply there: the op's own choice
    hidden, weight, b, target = make_inputs((37, 16), 53, bias=True, dtype=torch.float64, ignored_every=5)
    loss, statistics = with_statistics(hidden, weight, target, b, **kwargs)
    reference_kwargs = {k: v for k, v in kwargs.items() if k in ("softcap", "z_loss", "label_smoothing", "reduction")}
    want = reference(hidden, weight, target, b, **reference_kwargs)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    got_grads = torch.autograd.grad(loss.sum(), (hidden, weight, b))
    want_grads = torch.autograd.grad(want.sum(), (hidden, weight, b))
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    stats_kwargs = {k: v for k, v in kwargs.items() if k in ("softcap", "z_loss", "reduction")}
    for name, got, expected in zip(
        statistics._fields, statistics, eager_statistics(hidden, weight, target, b, **stats_kwargs)
    ):
        assert not got.requires_grad, name
        assert got.shape == expected.shape and got.dtype == torch.float64, name
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("tile_vocab", [4, 5, 8, 12], ids=str)
def test_vocabulary_masked_by_minus_infinity_gives_finite_statistics_at_every_tile(tile_vocab):
    # The first tiles of some rows are all -inf: their running max is still -inf when the next tile arrives.
    hidden, weight, _, target = make_inputs((11, 8), 21, dtype=torch.float64)
    b = torch.zeros(21, dtype=torch.float64)
    b[:9] = -float("inf")
    target = target.clamp_min(9)
    _, statistics = with_statistics(hidden, weight, target, b, reduction="none", tile_tokens=4, tile_vocab=tile_vocab)
    for name, got, expected in zip(
        statistics._fields, statistics, eager_statistics(hidden, weight, target, b, reduction="none")
    ):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("tile_vocab", [2, 3, 8], ids=str)
def test_tied_logits_count_the_first_as_argmax_does(tile_vocab):
    # Rows 0-3 of the weight are equal: their logits tie for every token. A target on the first of a tied
    # maximum is correct, one on a later one is not (argmax picks the first), in whichever tile each falls.
    hidden = torch.ones(4, 3, dtype=torch.float64)
    weight = torch.tensor([[1.0, 1.0, 1.0]] * 4 + [[0.0, 0.0, 0.0]] * 4, dtype=torch.float64)
    target = torch.tensor([0, 1, 3, 5])
    _, statistics = with_statistics(hidden, weight, target, reduction="none", tile_tokens=2, tile_vocab=tile_vocab)
    assert statistics.accuracy.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert statistics.accuracy.tolist() == (F.linear(hidden, weight).argmax(-1) == target).double().tolist()


def test_all_tokens_ignored_give_nan_means_as_the_loss():
    hidden, weight, b, target = make_inputs((6, 8), 13)
    target.fill_(-100)
    loss, statistics = with_statistics(hidden, weight, target, b)
    assert loss.isnan() and all(value.isnan() for value in statistics)
    loss, statistics = with_statistics(hidden, weight, target, b, reduction="sum")
    assert loss == 0 and all(value == 0 for value in statistics)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_statistics_are_as_close_to_float64_as_eager(dtype):
    inputs64 = make_inputs((2, 300, 32), 500, bias=True, dtype=torch.float64, ignored_every=7)
    target = inputs64[3]
    rounded = [t.detach().to(dtype) for t in inputs64[:3]]
    truth = eager_statistics(*[t.double() for t in rounded[:2]], target, rounded[2].double(), softcap=4.0, z_loss=1e-3)
    eager = eager_statistics(*rounded[:2], target, rounded[2], softcap=4.0, z_loss=1e-3)
    _, got = with_statistics(*rounded[:2], target, rounded[2], softcap=4.0, z_loss=1e-3, tile_tokens=64, tile_vocab=64)
    for name, g, e, w in zip(got._fields, got, eager, truth):
        assert g.dtype == torch.float32, name
        assert abs(g.item() - w.item()) <= 2 * abs(e.item() - w.item()) + 2**-10 * abs(w.item()), name


def test_autocast_gives_float32_statistics_of_the_call_in_the_autocast_dtype():
    hidden, weight, b, target = make_inputs((2, 9, 16), 40, bias=True)
    kwargs = dict(z_loss=1e-3, tile_tokens=4, tile_vocab=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, statistics = with_statistics(hidden, weight, target, b, **kwargs)
    want_loss, want = with_statistics(*(t.bfloat16() for t in (hidden, weight)), target, b.bfloat16(), **kwargs)
    assert loss.dtype == torch.float32 and all(value.dtype == torch.float32 for value in statistics)
    torch.testing.assert_close(loss, want_loss)
    for name, got, expected in zip(statistics._fields, statistics, want):
        torch.testing.assert_close(got, expected, msg=name)


@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["in_forward", "recompute"])
def test_statistics_cost_no_gemm_and_a_bounded_scratch(gradients_in_forward):
    # The statistics read the tiles the loss computes: the same GEMMs as without them; and the extra memory is
    # the [tokens] vectors, one scratch of at most 8 MiB and its rows' bool mask (a quarter of it), not a second
    # slab (64 MiB here).
    hidden, weight, _, target = make_inputs((2048, 64), 8192, ignored_every=7)
    kwargs = dict(gradients_in_forward=gradients_in_forward)

    def run(statistics):
        def step():
            result = torch_offload.linear_cross_entropy(hidden, weight, target, return_statistics=statistics, **kwargs)
            loss = result[0] if statistics else result
            torch.autograd.grad(loss, (hidden, weight))

        return gemm_count(step), peak_allocated_bytes(step)

    (plain_gemms, plain_peak), (gemms, peak) = run(False), run(True)
    assert gemms == plain_gemms
    assert peak - plain_peak <= (10 << 20) + 16 * 2048 * 4 + (1 << 20)


def test_opcheck():
    hidden, weight, b, target = make_inputs((2, 7, 16), 30, bias=True, ignored_every=4)
    detached = [t.detach() for t in (hidden, weight, b)]
    for args in (
        (*detached, target, -100, 0.0, 2.0, 1e-3, "mean", 4, 8),
        (hidden, weight, b, target, -100, 0.1, 0.0, 0.0, "sum", 4, 8),
        (hidden, weight, None, target, -100, 0.0, 0.0, 0.0, "none", 3, 5),
    ):
        opcheck(torch.ops.offload.linear_cross_entropy_with_statistics.default, args)
    opcheck(
        torch.ops.offload.linear_cross_entropy_forward.default,
        (*detached, target, -100, 0.1, 0.0, 1e-3, "sum", 3, 5, True),
    )
    opcheck(
        torch.ops.offload.linear_cross_entropy_with_gradients.default,
        (*detached, target, -100, 0.1, 0.0, 1e-3, "mean", 3, [True, True, True], True),
    )


def test_compile_fullgraph_matches_eager():
    hidden, weight, b, target = make_inputs((3, 11, 16), 37, bias=True, ignored_every=5)

    def step(hidden, weight, b, target):
        loss, statistics = torch_offload.linear_cross_entropy(hidden, weight, target, bias=b, return_statistics=True)
        return loss, *statistics

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = compiled(hidden, weight, b, target), step(hidden, weight, b, target)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(
        torch.autograd.grad(got[0], (hidden, weight)), torch.autograd.grad(want[0], (hidden, weight))
    )


def test_bad_reduction_is_refused_by_name():
    hidden, weight, b, target = make_inputs((4, 8), 13)
    with pytest.raises(RuntimeError, match="linear_cross_entropy: reduction is 'avg'; expected one of mean, sum, none"):
        with_statistics(hidden, weight, target, b, reduction="avg")
