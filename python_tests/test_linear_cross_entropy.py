"""linear_cross_entropy: loss and gradients against eager F.cross_entropy(F.linear(...)) with the same
softcap / z-loss in plain torch, on both paths (gradients in forward and recompute; the `path` fixture),
gradcheck, opcheck, torch.compile, TorchScript, autocast, gradients that are not needed, GEMM work, memory
(no [tokens, V] tensor; the slab's budget), errors."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from op_recording import RecordBackwardMask, gemm_count, gemm_flops, peak_allocated_bytes
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range


def reference(
    hidden,
    weight,
    target,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    softcap=None,
    z_loss=0.0,
):
    """The eager loss: logits in hidden's dtype, softcap and z-loss written in plain torch."""
    logits = F.linear(hidden, weight, bias)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    loss = F.cross_entropy(
        flat_logits, flat_target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    if z_loss:
        loss = torch.where(flat_target != ignore_index, loss + z_loss * flat_logits.logsumexp(-1).square(), 0.0)
    if reduction == "mean":
        return loss.sum() / (flat_target != ignore_index).sum()
    if reduction == "sum":
        return loss.sum()
    return loss.view(target.shape)


def make_inputs(shape, vocab, bias=False, dtype=torch.float32, seed=0, ignored_every=0):
    """(hidden [*shape], weight [vocab, h], bias, target): hidden and weights require grad, logits are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    h = shape[-1]

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    hidden = rand(*shape)
    weight = rand(vocab, h, scale=2 * h**-0.5)
    b = rand(vocab, scale=0.5) if bias else None
    target = torch.randint(0, vocab, shape[:-1], generator=generator)
    if ignored_every:
        target.view(-1)[1::ignored_every] = -100
    return hidden, weight, b, target


# The path call() asks for (the `path` fixture sets it): None lets the op choose.
GRADIENTS_IN_FORWARD = None


def call(hidden, weight, b, target, **kwargs):
    if GRADIENTS_IN_FORWARD is not None and "gradients_in_forward" not in kwargs:
        # Gradients in forward where they apply (the op refuses them elsewhere), else the recompute.
        applies = (
            kwargs.get("reduction", "mean") != "none" and not kwargs.get("softcap") and not kwargs.get("filter_eps")
        )
        kwargs["gradients_in_forward"] = GRADIENTS_IN_FORWARD and applies
    return torch_offload.linear_cross_entropy(hidden, weight, target, bias=b, **kwargs)


@pytest.fixture(params=["in_forward", "recompute"])
def path(request, monkeypatch):
    """Runs a test on each path of the gradients."""
    monkeypatch.setattr(sys.modules[__name__], "GRADIENTS_IN_FORWARD", request.param == "in_forward")
    return request.param


def loss_and_grads(fn, leaves, grad_out=None):
    loss = fn()
    grad_out = torch.ones_like(loss) if grad_out is None else grad_out
    return loss.detach(), torch.autograd.grad(loss, leaves, grad_out)


def assert_close_f32(got, want):
    """Within 1e-5 relative to want's largest element (sums over tokens or classes cancel)."""
    scale = max(want.abs().max().item(), 1e-3) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, equal_nan=True)


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# (hidden shape, vocab, tile_tokens, tile_vocab): tokens and vocabulary not multiples of the tile,
# fewer tokens / classes than a tile, 3-D and 1-D hidden, one tile, automatic tiles.
SHAPES = [
    ((37, 16), 53, 8, 16),
    ((2, 13, 16), 70, 5, 32),
    ((3, 16), 300, 8, 64),
    ((40, 8), 7, 16, 32),
    ((16,), 29, 4, 8),
    ((21, 16), 45, 0, 0),
    ((9, 16), 2000, 0, 0),
]
OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 3.0},
    "z_loss": {"z_loss": 1e-2},
    "all": {"bias": True, "label_smoothing": 0.25, "softcap": 2.0, "z_loss": 1e-3},
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", OPTIONS, ids=str)
@pytest.mark.parametrize("shape, vocab, tile_tokens, tile_vocab", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.usefixtures("path")
def test_matches_eager_float32(shape, vocab, tile_tokens, tile_vocab, option, reduction):
    kwargs = dict(OPTIONS[option])
    hidden, weight, b, target = make_inputs(shape, vocab, bias=kwargs.pop("bias", False), ignored_every=5)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    want_loss = reference(hidden, weight, target, b, reduction=reduction, **kwargs)
    grad_out = torch.rand_like(want_loss) + 0.5
    want, want_grads = loss_and_grads(lambda: want_loss, leaves, grad_out)
    got, got_grads = loss_and_grads(
        lambda: call(
            hidden, weight, b, target, reduction=reduction, tile_tokens=tile_tokens, tile_vocab=tile_vocab, **kwargs
        ),
        leaves,
        grad_out,
    )
    assert got.shape == want.shape and got.dtype == torch.float32
    assert_close_f32(got, want)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close_f32(g, w)


@pytest.mark.parametrize("option", ["plain", "smoothing", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.usefixtures("path")
def test_all_tokens_ignored_matches_eager(option, reduction):
    kwargs = dict(OPTIONS[option])
    hidden, weight, b, target = make_inputs((6, 16), 20, bias=kwargs.pop("bias", False))
    target.fill_(-100)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    want, want_grads = loss_and_grads(
        lambda: reference(hidden, weight, target, b, reduction=reduction, **kwargs), leaves
    )
    got, got_grads = loss_and_grads(
        lambda: call(hidden, weight, b, target, reduction=reduction, tile_tokens=4, tile_vocab=8, **kwargs), leaves
    )
    if reduction == "mean":
        assert got.isnan() and want.isnan()  # 0 / 0, as F.cross_entropy
    torch.testing.assert_close(got, want, equal_nan=True)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("path")
def test_custom_ignore_index_and_int32_target():
    hidden, weight, _, target = make_inputs((30, 16), 40)
    target[::3] = 7
    want = reference(hidden, weight, target, ignore_index=7, label_smoothing=0.2)
    assert_close_f32(
        call(hidden, weight, None, target.int(), ignore_index=7, label_smoothing=0.2, tile_tokens=8, tile_vocab=16),
        want,
    )


@pytest.mark.usefixtures("path")
def test_gradcheck_float64():
    for kwargs in ({"reduction": "mean"}, {"reduction": "none", "label_smoothing": 0.3, "softcap": 1.5, "z_loss": 0.1}):
        hidden, weight, b, target = make_inputs((2, 5, 6), 11, bias=True, dtype=torch.float64, ignored_every=4)
        assert torch.autograd.gradcheck(
            lambda h, w, bb: call(h, w, bb, target, tile_tokens=3, tile_vocab=4, **kwargs), (hidden, weight, b)
        )


@pytest.mark.usefixtures("path", "more_than_one_thread")
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0, "z_loss": 1e-2}], ids=["plain", "softcap_z_loss"])
def test_the_row_loops_split_over_threads_match_eager(options):
    # Tiles of 1024 classes: 32 rows a task, two tasks for the 64 tokens.
    hidden, weight, b, target = make_inputs((64, 32), 4096, bias=True, ignored_every=5)
    got = loss_and_grads(
        lambda: call(hidden, weight, b, target, tile_tokens=64, tile_vocab=1024, **options), [hidden, weight, b]
    )
    want = loss_and_grads(lambda: reference(hidden, weight, target, b, **options), [hidden, weight, b])
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert_close_f32(g, w)


@pytest.mark.usefixtures("path")
def test_tied_weight_gets_both_gradients():
    # The head's weight is the embedding matrix: its gradient is the embedding's plus the head's.
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 16)
    proj = torch.nn.Linear(16, 16)
    ids = torch.randint(0, 50, (3, 11))
    target = torch.randint(0, 50, (3, 11))

    def loss(fn):
        embedding.zero_grad()
        proj.zero_grad()
        fn(torch.tanh(proj(embedding(ids))), embedding.weight, target).backward()
        return [p.grad.clone() for p in (embedding.weight, proj.weight, proj.bias)]

    got = loss(lambda h, w, t: call(h, w, None, t, tile_tokens=8, tile_vocab=16))
    want = loss(reference)
    for g, w in zip(got, want):
        assert_close_f32(g, w)


@pytest.mark.parametrize(
    "trainable, expected_mask",
    [
        ({"hidden"}, [True, False, False]),  # frozen (or LoRA'd) head
        ({"weight", "bias"}, [False, True, True]),
        ({"hidden", "bias"}, [True, False, True]),
    ],
    ids=["frozen_head", "head_only", "hidden_and_bias"],
)
def test_gradients_not_needed_are_not_computed(trainable, expected_mask, path):
    names = ["hidden", "weight", "bias"]
    *tensors, target = make_inputs((20, 16), 30, bias=True)
    inputs = [t.detach().requires_grad_(name in trainable) for name, t in zip(names, tensors)]
    leaves = [t for t in inputs if t.requires_grad]
    # The op that computes the gradients is asked for those needed only.
    op = (
        torch.ops.offload.linear_cross_entropy_with_gradients
        if path == "in_forward"
        else torch.ops.offload.linear_cross_entropy_backward
    )
    with RecordBackwardMask(op.default) as mode:
        grads = torch.autograd.grad(call(*inputs, target, tile_tokens=8, tile_vocab=8), leaves)
    assert mode.masks == [expected_mask]
    for g, w in zip(grads, torch.autograd.grad(reference(inputs[0], inputs[1], target, inputs[2]), leaves)):
        assert_close_f32(g, w)
    # The op returns None where the mask says no, and runs fewer GEMMs.
    detached = [t.detach() for t in inputs]
    _, lse, _ = torch.ops.offload.linear_cross_entropy_forward(*detached, target, -100, 0.0, 0.0, 0.0, "mean", 8, 8)

    def backward(mask):
        return torch.ops.offload.linear_cross_entropy_backward(
            torch.tensor(1.0), *detached, target, lse, -100, 0.0, 0.0, 0.0, "mean", 8, 8, mask
        )

    assert [r is not None for r in backward(expected_mask)] == expected_mask
    assert gemm_count(lambda: backward(expected_mask)) < gemm_count(lambda: backward([True] * 3))

    def in_forward(mask):
        return torch.ops.offload.linear_cross_entropy_with_gradients(
            *detached, target, -100, 0.0, 0.0, 0.0, "mean", 8, mask
        )[1:4]

    assert [r is not None for r in in_forward(expected_mask)] == expected_mask
    assert gemm_count(lambda: in_forward(expected_mask)) < gemm_count(lambda: in_forward([True] * 3))


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gradients_in_forward_do_three_gemms_of_work_and_recompute_four(bias):
    # [T, h] x [h, V] is one GEMM's work: the logits, hidden's gradient, the weight's; the recompute adds the
    # logits again in backward. Whatever the tiles.
    tokens, vocab, h = 100, 70, 16
    hidden, weight, b, target = make_inputs((tokens, h), vocab, bias=bias)
    for gradients_in_forward, gemms in ((True, 3), (False, 4)):
        for tile_tokens in (0, 16, 33):

            def step():
                call(
                    hidden,
                    weight,
                    b,
                    target,
                    tile_tokens=tile_tokens,
                    tile_vocab=24,
                    gradients_in_forward=gradients_in_forward,
                ).backward()

            assert gemm_flops(step) == gemms * tokens * vocab * h, (gradients_in_forward, tile_tokens)


def test_gradients_in_forward_hold_the_slab_budget_and_the_gradients_only():
    # 2048 tokens x 32000: the whole logits would be 250 MiB; the slab is at most 64 MiB (here 4 of 512
    # tokens), and besides it forward and backward hold the gradients (hidden's, the weight's) and a few
    # [tokens] vectors.
    tokens, vocab, h = 2048, 32000, 8
    hidden, weight, _, target = make_inputs((tokens, h), vocab)
    gradients = hidden.nbytes + weight.nbytes

    def step(**kwargs):
        return lambda: call(hidden, weight, None, target, gradients_in_forward=True, **kwargs).backward()

    slab = 64 << 20
    peak = peak_allocated_bytes(step())
    assert slab / 2 < peak <= slab + gradients + (1 << 20)
    # tile_tokens sets the slab's tokens instead, 64 of them; never past the budget (here all 2048 asked for).
    assert peak_allocated_bytes(step(tile_tokens=64)) <= 64 * vocab * 4 + gradients + (1 << 20)
    assert peak_allocated_bytes(step(tile_tokens=tokens)) <= slab + gradients + (1 << 20)


def test_gradients_in_forward_keep_hiddens_gradient_in_its_dtype():
    # Kept from forward to backward, hidden's gradient in float32 would be twice a bf16 hidden state. A slab's rows
    # are final after their one GEMM over the vocabulary, so rounding them there is rounding the float32 result.
    hidden, weight, _, target = make_inputs((300, 32), 500, dtype=torch.bfloat16)
    args = (target, -100, 0.0, 0.0, 0.0, "mean", 64, [True, True, False])
    _, grad_hidden, grad_weight, _, _ = torch.ops.offload.linear_cross_entropy_with_gradients(
        hidden.detach(), weight.detach(), None, *args
    )
    _, grad_hidden32, _, _, _ = torch.ops.offload.linear_cross_entropy_with_gradients(
        hidden.detach().float(), weight.detach().float(), None, *args
    )
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.float32
    assert torch.equal(grad_hidden, grad_hidden32.bfloat16())


def test_a_large_vocabulary_gets_slabs_of_512_tokens():
    # V = 70000 in float32: 64 MiB would hold 239 tokens, too few to amortize reading and writing the [V, h]
    # weight gradient once per slab; the slab holds 512 (of 1024) instead, and no more.
    tokens, vocab, h = 1024, 70000, 4
    hidden, weight, _, target = make_inputs((tokens, h), vocab)
    gradients = hidden.nbytes + weight.nbytes
    slab = 512 * vocab * 4
    peak = peak_allocated_bytes(lambda: call(hidden, weight, None, target, gradients_in_forward=True).backward())
    assert slab < peak <= slab + gradients + (1 << 20)


def test_gradients_in_forward_refuse_a_second_backward_and_double_backward():
    hidden, weight, _, target = make_inputs((6, 8), 11)
    loss = call(hidden, weight, None, target, gradients_in_forward=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="linear_cross_entropy: trying to backward through the graph a second time"):
        loss.backward()
    loss = call(hidden, weight, None, target, gradients_in_forward=True)
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy: double backward \(create_graph=True\)"):
        torch.autograd.grad(loss, hidden, create_graph=True)


@pytest.mark.parametrize("changed", ["hidden", "weight", "bias", "target"])
def test_an_input_changed_in_place_between_forward_and_backward_is_refused(changed, path):
    # As autograd refuses a saved input changed in place: the gradients would be those at its old value.
    x, weight, b, target = make_inputs((2, 5, 8), 13, bias=True, dtype=torch.float64, ignored_every=4)
    inputs = {"hidden": x * 1.0, "weight": weight, "bias": b, "target": target}  # hidden: a model's output
    loss = call(*inputs.values(), tile_tokens=4, tile_vocab=8)
    version = inputs[changed]._version
    with torch.no_grad():
        inputs[changed].zero_()
    message = (
        rf"linear_cross_entropy: {changed} was modified by an inplace operation between forward and backward;"
        rf".*\(its version is {version + 1}, expected {version}\)"
        if path == "in_forward"
        else "one of the variables needed for gradient computation has been modified by an inplace operation"
    )
    with pytest.raises(RuntimeError, match=message):
        loss.backward()


def test_gradients_are_exact_until_an_input_changes_in_place(path):
    x, weight, b, target = make_inputs((2, 5, 8), 13, bias=True, dtype=torch.float64, ignored_every=4)
    with torch.no_grad():
        weight.mul_(2)  # before forward: backward compares with the version forward saw, not with 0
    leaves = [x, weight, b]
    loss = call(x * 1.0, weight, b, target, tile_tokens=4, tile_vocab=8)
    want = torch.autograd.grad(reference(x * 1.0, weight, target, b), leaves)
    for _ in range(2):
        for g, w in zip(torch.autograd.grad(loss, leaves, retain_graph=True), want):
            torch.testing.assert_close(g, w)
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, leaves)


def test_forward_op_returns_the_float32_log_sum_exp_of_unrounded_logits():
    # The products of bf16 operands stay float32 through the bias (eager rounds each logit to bf16).
    hidden, weight, b, target = [t.detach() if t is not None else None for t in make_inputs((2, 7, 16), 33, True)]
    rounded = [t.bfloat16() for t in (hidden, weight, b)]
    loss, lse, _ = torch.ops.offload.linear_cross_entropy_forward(*rounded, target, -100, 0.0, 0.0, 0.0, "none", 4, 8)
    assert loss.dtype == torch.float32 and loss.shape == (2, 7)
    assert lse.dtype == torch.float32 and lse.shape == (14,)
    want = F.linear(*[t.double() for t in rounded]).logsumexp(-1).view(-1)
    torch.testing.assert_close(lse, want.float())


def check_cut_cross_entropys_elementwise_criterion(dtype, softcap, device):
    """Cut Cross-Entropy's test: each token's log-sum-exp and loss within eager's error (the logits' GEMM in the
    input dtype, everything after in float32) plus a tolerance, against the truth on the same rounded inputs.
    Rounding each logit before the bias or the soft-cap, and the capped logit again, failed it (issue 71)."""
    hidden, weight, b, target = make_inputs((4, 256, 64), 1000, bias=True, dtype=torch.float64)
    rounded = [t.detach().to(device, dtype) for t in (hidden, weight, b)]
    b_rounded = rounded[2] + 8  # logits near 8: a unit in the last place of bf16 is 2^-4 there
    target = target.to(device)

    def loss_and_lse(logits):
        capped = softcap * torch.tanh(logits / softcap) if softcap else logits
        flat = capped.reshape(-1, capped.shape[-1])
        return F.cross_entropy(flat, target.reshape(-1), reduction="none"), flat.logsumexp(-1)

    truth = loss_and_lse(F.linear(rounded[0].double(), rounded[1].double(), b_rounded.double()))
    eager = loss_and_lse(F.linear(rounded[0], rounded[1], b_rounded).float())
    loss, lse, _ = torch.ops.offload.linear_cross_entropy_forward(
        rounded[0], rounded[1], b_rounded, target, -100, 0.0, softcap, 0.0, "none", 0, 0
    )
    for name, got, e, want in zip(["loss", "log-sum-exp"], (loss.reshape(-1), lse), eager, truth):
        error, eagers = (got.double() - want).abs(), (e.double() - want).abs()
        tolerance = 1e-6 * want.abs().clamp_min(1)  # a few float32 roundings
        assert (error <= eagers + tolerance).all(), (name, (error - eagers).max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softcap", [0.0, 20.0], ids=["no_softcap", "softcap"])
def test_reduced_precision_passes_cut_cross_entropys_elementwise_criterion(dtype, softcap):
    check_cut_cross_entropys_elementwise_criterion(dtype, softcap, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.usefixtures("path")
def test_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    # Many tiles: per-tile roundings of bf16/fp16 gradient sums would show here. The float64
    # reference runs on the same (rounded) values, so only the arithmetic's roundings count.
    inputs64 = make_inputs((2, 300, 32), 500, bias=True, dtype=torch.float64, ignored_every=7)
    inputs = [t.detach().to(dtype).requires_grad_() for t in inputs64[:3]]
    inputs64 = [t.detach().to(dtype).double().requires_grad_() for t in inputs64[:3]]
    target = make_inputs((2, 300, 32), 500, ignored_every=7)[3]
    for kwargs in ({}, {"label_smoothing": 0.1, "softcap": 4.0, "z_loss": 1e-3}):
        want, want_grads = loss_and_grads(lambda: reference(*inputs64[:2], target, inputs64[2], **kwargs), inputs64)
        eager, eager_grads = loss_and_grads(lambda: reference(*inputs[:2], target, inputs[2], **kwargs), inputs)
        got, got_grads = loss_and_grads(lambda: call(*inputs, target, tile_tokens=64, tile_vocab=64, **kwargs), inputs)
        assert got.dtype == torch.float32 and all(g.dtype == dtype for g in got_grads)
        assert relative_error(got, want) <= max(2 * relative_error(eager, want), 4e-3)
        for name, g, e, w in zip(["hidden", "weight", "bias"], got_grads, eager_grads, want_grads):
            assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2), name


def check_autocast(hidden, weight, b, target, dtype, **tiles):
    """Under autocast to `dtype` the op's loss and gradients are as close to eager's under autocast as
    rounding allows, a float32 loss and float32 gradients for float32 leaves, as eager gives."""
    vocab = weight.shape[0]
    with torch.autocast(hidden.device.type, dtype=dtype):
        got = call(hidden, weight, b, target, **tiles)
        want = F.cross_entropy(F.linear(hidden, weight, b).view(-1, vocab), target.view(-1))
    assert got.dtype == want.dtype == torch.float32
    assert relative_error(got, want) < 1e-2
    got_grads = torch.autograd.grad(got, (hidden, weight, b))
    want_grads = torch.autograd.grad(want, (hidden, weight, b))
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.float32
        assert relative_error(g, w) < 2e-2


@pytest.mark.usefixtures("path")
def test_autocast_runs_the_gemms_in_the_autocast_dtype_and_returns_a_float32_loss():
    check_autocast(*make_inputs((2, 9, 16), 40, bias=True), torch.bfloat16, tile_tokens=4, tile_vocab=16)


@pytest.mark.usefixtures("path")
def test_autocast_leaves_a_float64_loss_in_float64_as_eager():
    hidden, weight, b, target = make_inputs((9, 16), 40, bias=True, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast does not cast float64
        got = call(hidden, weight, b, target)
        want = F.cross_entropy(F.linear(hidden, weight, b), target)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("tile_vocab", [4, 5, 8, 12], ids=str)
@pytest.mark.usefixtures("path")
def test_vocabulary_masked_by_minus_infinity_matches_eager_at_every_tile(tile_vocab):
    # A tile whose every logit is -inf must add nothing to the log-sum-exp (not exp(-inf - -inf) = NaN).
    hidden, weight, b, target = make_inputs((6, 8), 12, bias=True)
    with torch.no_grad():
        b[8:] = float("-inf")
        target.clamp_(max=7)
    want = loss_and_grads(lambda: reference(hidden, weight, target, bias=b), (hidden, weight, b))
    got = loss_and_grads(
        lambda: call(hidden, weight, b, target, tile_tokens=4, tile_vocab=tile_vocab), (hidden, weight, b)
    )
    for g, w in zip((got[0], *got[1]), (want[0], *want[1])):
        assert torch.isfinite(w).all()
        assert_close_f32(g, w)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.usefixtures("path")
def test_hidden_size_zero_matches_eager(reduction):
    hidden = torch.randn(2, 3, 0, requires_grad=True)
    weight = torch.randn(11, 0, requires_grad=True)
    target = torch.randint(0, 11, (2, 3))
    want = loss_and_grads(lambda: reference(hidden, weight, target, reduction=reduction), (hidden, weight))
    got = loss_and_grads(lambda: call(hidden, weight, None, target, reduction=reduction), (hidden, weight))
    for g, w in zip((got[0], *got[1]), (want[0], *want[1])):
        assert_close_f32(g, w)


def improbable_tail_inputs(dtype=torch.float32, softcap=None, **kwargs):
    """Inputs (vocabulary 77, tiles of 16 x 20 in use) whose classes from 40 on are improbable for every token
    (bias -60: softmax below 1e-17 even with a softcap of 50), so gradient filtering may skip the last two vocabulary
    tiles; every target is a probable class."""
    hidden, weight, b, target = make_inputs((3, 45, 16), 77, bias=True, dtype=dtype, ignored_every=4, **kwargs)
    with torch.no_grad():
        b[40:] = -60.0
    target = torch.where(target >= 0, target % 40, target)
    return hidden, weight, b, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kwargs", [{}, {"softcap": 50.0, "z_loss": 1e-2}, {"reduction": "none"}], ids=str)
def test_gradient_filtering_skips_improbable_tiles_and_still_matches_eager(dtype, kwargs):
    hidden, weight, b, target = improbable_tail_inputs(dtype)
    leaves = [hidden, weight, b]
    loss = reference(hidden.double(), weight.double(), target, b.double(), **kwargs)
    grad_out = torch.rand_like(loss) + 0.5
    want, want_grads = loss_and_grads(lambda: loss, leaves, grad_out)
    results = {}
    for filter_eps in (None, "auto"):
        results[filter_eps] = loss_and_grads(
            lambda: call(
                hidden,
                weight,
                b,
                target,
                tile_tokens=16,
                tile_vocab=20,
                filter_eps=filter_eps,
                gradients_in_forward=False,
                **kwargs,
            ),
            leaves,
            grad_out.to(dtype),
        )
    _, (_, unfiltered_weight, unfiltered_bias) = results[None]
    got, got_grads = results["auto"]
    # The skipped tiles added nothing (unfiltered, their gradients are tiny but not zero) ...
    _, grad_weight, grad_bias = got_grads
    assert (grad_weight[40:] == 0).all() and (grad_bias[40:] == 0).all()
    assert (unfiltered_weight[40:] != 0).all() and (unfiltered_bias[40:] != 0).all()
    # ... the tiles that count are computed as without filtering, and everything is as close to eager.
    torch.testing.assert_close(grad_weight[:40], unfiltered_weight[:40], rtol=0, atol=0)
    assert_close_f32(got.double(), want)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g.double(), w.double())


def test_gradient_filtering_keeps_every_tile_that_counts():
    # Logits of order 1: no tile is below float resolution, so filtering changes no bit; nor does it hide a NaN.
    hidden, weight, b, target = make_inputs((2, 30, 16), 90, bias=True, ignored_every=3)
    for poison in (False, True):
        if poison:
            with torch.no_grad():
                hidden[1, 7, 3] = float("nan")
        results = [
            loss_and_grads(
                lambda: call(
                    hidden,
                    weight,
                    b,
                    target,
                    tile_tokens=8,
                    tile_vocab=16,
                    filter_eps=filter_eps,
                    gradients_in_forward=False,
                ),
                [hidden, weight, b],
            )
            for filter_eps in (None, "auto", 1e-6)
        ]
        for _, grads in results[1:]:
            for got, want in zip(grads, results[0][1]):
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert results[1][1][1].isnan().any() == poison


def test_gradient_filtering_skips_every_tile_when_all_tokens_are_ignored():
    hidden, weight, b, target = improbable_tail_inputs()
    target.fill_(-100)
    got, got_grads = loss_and_grads(
        lambda: call(hidden, weight, b, target, reduction="sum", filter_eps=1e-30), [hidden, weight, b]
    )
    assert got == 0 and all((g == 0).all() for g in got_grads)


@pytest.mark.parametrize(
    "filter_eps, message",
    [
        (-1.0, "filter_eps is -1; expected a finite value >= 0"),
        (float("inf"), "filter_eps is inf; expected a finite value >= 0"),
        ("on", "filter_eps is 'on'; expected None, \"auto\" or a float"),
        (1e-9, "filter_eps is 1e-09 with label_smoothing 0.1; gradient filtering needs label_smoothing = 0"),
    ],
)
def test_bad_filter_eps_is_refused_by_name(filter_eps, message):
    hidden, weight, _, target = make_inputs((3, 16), 10)
    with pytest.raises(RuntimeError, match=f"linear_cross_entropy: {message}"):
        call(hidden, weight, None, target, label_smoothing=0.1, filter_eps=filter_eps)
    if not isinstance(filter_eps, str):
        with pytest.raises(RuntimeError, match=f"linear_cross_entropy_backward: {message}"):
            torch.ops.offload.linear_cross_entropy_backward(
                torch.tensor(1.0),
                hidden.detach(),
                weight.detach(),
                None,
                target,
                torch.zeros(3),
                -100,
                0.1,
                0.0,
                0.0,
                "sum",
                0,
                0,
                [True] * 3,
                filter_eps,
            )


def opcheck_cases():
    cases = []
    for bias in (True, False):
        for requires_grad in (True, False):
            hidden, weight, b, target = make_inputs((2, 7, 16), 19, bias=bias, ignored_every=3)
            tensors = [t.detach().requires_grad_(requires_grad) if t is not None else None for t in (hidden, weight, b)]
            cases.append((f"{'bias' if bias else 'nobias'}-grad{requires_grad}", [*tensors, target]))
    return cases


@pytest.mark.parametrize("name, inputs", opcheck_cases(), ids=[c[0] for c in opcheck_cases()])
def test_opcheck(name, inputs):
    opcheck(torch.ops.offload.linear_cross_entropy.default, (*inputs, -100, 0.1, 2.0, 1e-3, "mean", 4, 8))
    opcheck(torch.ops.offload.linear_cross_entropy.default, (*inputs, -100, 0.0, 0.0, 0.0, "none"))
    opcheck(torch.ops.offload.linear_cross_entropy.default, (*inputs, -100, 0.0, 3.0, 0.0, "sum", 4, 8, 1e-3))
    for gradients_in_forward in (True, False):
        opcheck(
            torch.ops.offload.linear_cross_entropy.default,
            (*inputs, -100, 0.1, 0.0, 1e-3, "mean", 4, 8, 0.0, gradients_in_forward),
        )
    detached = [t.detach() if t is not None else None for t in inputs]
    opcheck(torch.ops.offload.linear_cross_entropy_forward.default, (*detached, -100, 0.1, 0.0, 0.0, "sum", 3, 5))
    for mask in ([True, True, True], [False, True, False]):
        opcheck(
            torch.ops.offload.linear_cross_entropy_with_gradients.default,
            (*detached, -100, 0.1, 0.0, 1e-3, "mean", 3, mask),
        )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck_backward(reduction):
    hidden, weight, b, target = [
        t.detach() if t is not None else None for t in make_inputs((2, 7, 16), 19, bias=True, ignored_every=3)
    ]
    _, lse, _ = torch.ops.offload.linear_cross_entropy_forward(
        hidden, weight, b, target, -100, 0.1, 2.0, 0.0, reduction, 4, 8
    )
    grad_loss = torch.ones(2, 7) if reduction == "none" else torch.tensor(2.0)
    for mask in ([True, True, True], [True, False, False]):
        opcheck(
            torch.ops.offload.linear_cross_entropy_backward.default,
            (grad_loss, hidden, weight, b, target, lse, -100, 0.1, 2.0, 0.0, reduction, 4, 8, mask),
        )
    _, lse, _ = torch.ops.offload.linear_cross_entropy_forward(
        hidden, weight, b, target, -100, 0.0, 2.0, 0.0, reduction, 4, 8
    )
    opcheck(
        torch.ops.offload.linear_cross_entropy_backward.default,
        (grad_loss, hidden, weight, b, target, lse, -100, 0.0, 2.0, 0.0, reduction, 4, 8, [True] * 3, 1e-3),
    )


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 37, bias=False)

    def forward(self, x, target):
        return torch_offload.linear_cross_entropy(
            self.norm(x), self.lm_head.weight, target, softcap=5.0, label_smoothing=0.1, tile_tokens=8, tile_vocab=16
        )


def test_compile_fullgraph_dynamic_matches_eager_over_changing_tokens():
    torch._dynamo.reset()
    torch.manual_seed(0)
    head = Head()
    compiled = torch.compile(head, fullgraph=True, dynamic=True)
    for seq in (12, 29, 40):
        x = torch.randn(2, seq, 16, requires_grad=True)
        target = torch.randint(0, 37, (2, seq))
        target[:, ::4] = -100
        leaves = [x, *head.parameters()]
        want, want_grads = loss_and_grads(lambda: head(x, target), leaves)
        got, got_grads = loss_and_grads(lambda: compiled(x, target), leaves)
        assert_close_f32(got, want)
        for g, w in zip(got_grads, want_grads):
            assert_close_f32(g, w)
    explanation = torch._dynamo.explain(head)(torch.randn(2, 12, 16), torch.randint(0, 37, (2, 12)))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_gradient_filtering_compiles_without_graph_break():
    torch._dynamo.reset()
    hidden, weight, b, target = improbable_tail_inputs()

    def loss(h, w, bb):
        return call(h, w, bb, target, tile_tokens=16, tile_vocab=20, filter_eps="auto")

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    want, want_grads = loss_and_grads(lambda: loss(hidden, weight, b), [hidden, weight, b])
    got, got_grads = loss_and_grads(lambda: compiled(hidden, weight, b), [hidden, weight, b])
    assert (got_grads[1][40:] == 0).all()
    for g, w in zip([got, *got_grads], [want, *want_grads]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["in_forward", "recompute"])
def test_compiled_graphs_call_the_ops_of_the_path(gradients_in_forward):
    torch._dynamo.reset()
    hidden, weight, b, target = make_inputs((9, 16), 20, bias=True)
    graphs = []

    def record(graph, _):
        graphs.append(graph.code)
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    compiled = torch.compile(
        lambda h, w, bb, t: call(h, w, bb, t, tile_tokens=4, gradients_in_forward=gradients_in_forward),
        backend=backend,
        fullgraph=True,
        dynamic=True,
    )
    loss = compiled(hidden, weight, b, target)
    (loss * 3).backward()
    assert len(graphs) == 2
    if gradients_in_forward:
        assert "offload.linear_cross_entropy_with_gradients.default" in graphs[0]
        assert "offload.linear_cross_entropy" not in graphs[1]  # backward only scales
    else:
        assert "offload.linear_cross_entropy_forward.default" in graphs[0]
        assert "offload.linear_cross_entropy_backward.default" in graphs[1]
    want_loss = reference(hidden, weight, target, b)
    want = torch.autograd.grad(want_loss * 3, [hidden, weight, b])
    assert_close_f32(loss.detach(), want_loss.detach())
    for got, w in zip((hidden.grad, weight.grad, b.grad), want):
        assert_close_f32(got, w)


def test_torchscript_calls_the_op():
    @torch.jit.script
    def scripted(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.ops.offload.linear_cross_entropy(hidden, weight, None, target, -100, 0.0, 0.0, 0.0, "sum")

    hidden, weight, _, target = make_inputs((12, 16), 30)
    got, got_grads = loss_and_grads(lambda: scripted(hidden, weight, target), [hidden, weight])
    want, want_grads = loss_and_grads(lambda: reference(hidden, weight, target, reduction="sum"), [hidden, weight])
    assert_close_f32(got, want)
    for g, w in zip(got_grads, want_grads):
        assert_close_f32(g, w)


def test_meta_tensors_give_shapes_only():
    hidden, weight, b = (
        torch.empty(2, 5, 16, device="meta"),
        torch.empty(30, 16, device="meta"),
        torch.empty(30, device="meta"),
    )
    target = torch.empty(2, 5, dtype=torch.long, device="meta")
    assert call(hidden, weight, b, target).shape == ()
    assert call(hidden, weight, b, target, reduction="none").shape == (2, 5)
    loss, lse, _ = torch.ops.offload.linear_cross_entropy_forward(
        hidden.bfloat16(), weight.bfloat16(), None, target, -100, 0.0, 0.0, 0.0, "sum", 0, 0
    )
    assert loss.is_meta and loss.dtype == torch.float32 and lse.shape == (10,) and lse.dtype == torch.float32
    grads = torch.ops.offload.linear_cross_entropy_backward(
        torch.empty((), device="meta"),
        hidden,
        weight,
        b,
        target,
        torch.empty(10, device="meta"),
        -100,
        0.0,
        0.0,
        0.0,
        "mean",
        0,
        0,
        [False, True, True],
    )
    assert [g.shape if g is not None else None for g in grads] == [None, (30, 16), (30,)]
    loss, *grads, _ = torch.ops.offload.linear_cross_entropy_with_gradients(
        hidden.bfloat16(), weight.bfloat16(), b.bfloat16(), target, -100, 0.0, 0.0, 0.0, "sum", 0, [True, False, True]
    )
    assert loss.shape == () and loss.is_meta and loss.dtype == torch.float32
    assert [(g.shape, g.dtype) if g is not None else None for g in grads] == [
        ((2, 5, 16), torch.bfloat16),
        None,
        ((30,), torch.float32),
    ]


@pytest.mark.parametrize(
    "tokens, vocab, dtype, tile",
    [
        (16384, 32000, torch.float32, (1024, 2000)),  # 8 MiB of float32 logits, split evenly
        (16384, 128256, torch.bfloat16, (1024, 4008)),
        (300, 50000, torch.float32, (300, 3847)),
        (2500, 100, torch.float32, (834, 100)),
        (0, 0, torch.float32, (1, 1)),
    ],
)
def test_automatic_tile_follows_the_documented_budget(tokens, vocab, dtype, tile):
    assert torch_offload.linear_cross_entropy_tile(tokens, vocab, dtype=dtype) == tile


PEAK_SCRIPT = """
import sys, torch, torch.nn.functional as F, torch_offload
def rss(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
T, V, h = 4096, 8192, 32
hidden = torch.randn(T, h, requires_grad=True)
weight = torch.randn(V, h, requires_grad=True)
target = torch.randint(0, V, (T,))
if sys.argv[1] == "eager":
    loss = lambda h, w, t: F.cross_entropy(h @ w.t(), t)
else:
    loss = lambda h, w, t: torch_offload.linear_cross_entropy(h, w, t, gradients_in_forward=sys.argv[1] == "in_forward")
loss(hidden[:8], weight, target[:8]).backward()  # warm up allocator and thread pool
hidden.grad = weight.grad = None
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
before = rss("VmRSS")
loss(hidden, weight, target).backward()
print(rss("VmHWM") - before)
"""


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(reduction="none"), r"gradients_in_forward is True with reduction \"none\".*it needs a scalar loss"),
        (dict(filter_eps=1e-3), r"gradients_in_forward is True .* filter_eps 0.001 .*; it needs .* filter_eps 0"),
        (dict(softcap=2.0), r"gradients_in_forward is True .* softcap 2; it needs .* softcap 0"),
    ],
    ids=["reduction_none", "filter_eps", "softcap"],
)
def test_gradients_in_forward_where_they_do_not_apply_are_refused_by_name(kwargs, message):
    hidden, weight, _, target = make_inputs((3, 16), 10)
    with pytest.raises(ValueError, match=f"linear_cross_entropy: {message}"):
        torch_offload.linear_cross_entropy(hidden, weight, target, gradients_in_forward=True, **kwargs)
    # Alike without a gradient to compute.
    with torch.inference_mode(), pytest.raises(ValueError, match=f"linear_cross_entropy: {message}"):
        torch_offload.linear_cross_entropy(hidden, weight, target, gradients_in_forward=True, **kwargs)
    op = torch.ops.offload.linear_cross_entropy_with_gradients
    with pytest.raises(ValueError, match='linear_cross_entropy: reduction is "none"; gradients computed in forward'):
        op(hidden, weight, None, target, -100, 0.0, 0.0, 0.0, "none", 0, [True] * 3)
    with pytest.raises(ValueError, match="linear_cross_entropy: softcap is 2; gradients computed in forward need"):
        op(hidden, weight, None, target, -100, 0.0, 2.0, 0.0, "mean", 0, [True] * 3)


def test_peak_is_a_tile_or_the_slab_never_the_logits():
    # Peak resident growth of forward + backward in a fresh process: the [4096, 8192] float32
    # logits are 128 MiB; the recompute stays near its 8 MiB tile, gradients in forward near their
    # 64 MiB slab (the gradients are 1.5 MiB), eager holds several copies.
    def peak(mode):
        result = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, mode],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="2"),
        )
        assert result.returncode == 0, result.stderr
        return int(result.stdout)

    logits_bytes = 4096 * 8192 * 4
    assert peak("recompute") < logits_bytes / 8
    assert peak("in_forward") < (64 + 8) << 20
    assert peak("eager") > 2 * logits_bytes  # the measurement sees what it should


def bad_input_cases():
    hidden, weight, b, target = [t.detach() for t in make_inputs((3, 16), 10, bias=True)]
    good = dict(hidden=hidden, weight=weight, bias=b, target=target)
    return [
        (
            "target_high",
            dict(good, target=torch.tensor([1, 10, 2])),
            r"target holds 10 at \(flattened\) index 1; expected class indices in \[0, 10\) or ignore_index \(-100\)",
        ),
        ("target_negative", dict(good, target=torch.tensor([1, 2, -1])), r"target holds -1 at \(flattened\) index 2"),
        ("target_float", dict(good, target=target.float()), "target has dtype Float; expected int64"),
        ("target_shape", dict(good, target=target[:2]), r"target has shape \[2\]; expected hidden's shape without h"),
        ("target_device", dict(good, target=target.to("meta")), "target is on meta but hidden is on cpu"),
        ("weight_h", dict(good, weight=torch.randn(10, 15)), r"weight has shape \[10, 15\]; expected \[V, h\]"),
        ("weight_1d", dict(good, weight=torch.randn(10)), r"weight has shape \[10\]; expected \[V, h\]"),
        ("weight_dtype", dict(good, weight=weight.double()), "weight has dtype Double; expected Float"),
        ("weight_device", dict(good, weight=weight.to("meta")), "weight is on meta but hidden is on cpu"),
        ("bias_shape", dict(good, bias=torch.randn(9)), r"bias has shape \[9\]; expected \[V\] = \[10\]"),
        ("bias_dtype", dict(good, bias=b.half()), "bias has dtype Half; expected Float"),
        ("hidden_dtype", dict(good, hidden=hidden.long()), "hidden has dtype Long; expected float32"),
        ("hidden_0d", dict(good, hidden=torch.tensor(1.0)), "hidden is a 0-d tensor"),
        ("reduction", dict(good, reduction="avg"), "reduction is 'avg'; expected one of mean, sum, none"),
        ("smoothing", dict(good, label_smoothing=1.5), r"label_smoothing is 1.5; expected a value in \[0, 1\]"),
        ("softcap", dict(good, softcap=-1.0), "softcap is -1; expected a finite value >= 0"),
        ("z_loss", dict(good, z_loss=-0.1), "z_loss is -0.1; expected a finite value >= 0"),
    ]


@pytest.mark.parametrize("name, kwargs, message", bad_input_cases(), ids=[c[0] for c in bad_input_cases()])
def test_bad_inputs_raise_errors_naming_the_argument(name, kwargs, message):
    kwargs = dict(kwargs)
    hidden, weight, target = kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("target")
    with pytest.raises(RuntimeError, match=f"linear_cross_entropy: {message}"):
        torch_offload.linear_cross_entropy(hidden, weight, target, **kwargs)
    # So do both paths of a call with a gradient to compute.
    if hidden.is_floating_point():
        for gradients_in_forward in (None, False):
            with pytest.raises(RuntimeError, match=f"linear_cross_entropy: {message}"):
                torch_offload.linear_cross_entropy(
                    hidden.detach().requires_grad_(),
                    weight,
                    target,
                    gradients_in_forward=gradients_in_forward,
                    **kwargs,
                )
    # The backward op checks the same.
    args = [
        hidden,
        weight,
        kwargs.get("bias"),
        target,
        torch.zeros(3),
        -100,
        kwargs.get("label_smoothing", 0.0),
        kwargs.get("softcap", 0.0),
        kwargs.get("z_loss", 0.0),
        kwargs.get("reduction", "sum"),
        0,
        0,
        [True] * 3,
    ]
    with pytest.raises(RuntimeError, match=f"linear_cross_entropy_backward: {message}"):
        torch.ops.offload.linear_cross_entropy_backward(torch.tensor(1.0), *args)


def test_missing_tensors_and_bad_grad_loss_are_rejected_by_name():
    hidden, weight, _, target = [t.detach() if t is not None else None for t in make_inputs((3, 16), 10)]
    with pytest.raises(RuntimeError, match="linear_cross_entropy: weight is NoneType; expected a defined tensor"):
        torch_offload.linear_cross_entropy(hidden, None, target)
    with pytest.raises(
        RuntimeError,
        match=r"linear_cross_entropy_backward: grad_loss has shape \[3\]; expected a "
        "scalar",
    ):
        torch.ops.offload.linear_cross_entropy_backward(
            torch.ones(3), hidden, weight, None, target, torch.zeros(3), -100, 0.0, 0.0, 0.0, "mean", 0, 0, [True] * 3
        )
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy_backward: lse has shape \[2\]; expected \[tokens\]"):
        torch.ops.offload.linear_cross_entropy_backward(
            torch.ones(3), hidden, weight, None, target, torch.zeros(2), -100, 0.0, 0.0, 0.0, "none", 0, 0, [True] * 3
        )


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_every_cpu_kernel_variant_matches_eager(capability):
    # ATen picks the widest vector kernels this CPU runs; the environment variable lowers
    # that choice for ATen's kernels and ours, in a fresh process.
    script = (
        "import torch, torch_offload, test_linear_cross_entropy as t\n"
        "for dtype in (torch.float32, torch.float64, torch.bfloat16):\n"
        "    for kwargs in ({}, {'label_smoothing': 0.1, 'softcap': 3.0, 'z_loss': 1e-2}):\n"
        "        h, w, b, target = t.make_inputs((3, 45, 16), 77, bias=True, dtype=dtype, ignored_every=4)\n"
        "        got, got_grads = t.loss_and_grads(lambda: t.call(h, w, b, target, tile_tokens=16, tile_vocab=37,\n"
        "                                                         **kwargs), [h, w, b])\n"
        "        ref, ref_grads = t.loss_and_grads(lambda: t.reference(h.double(), w.double(), target, b.double(),\n"
        "                                                              **kwargs), [h, w, b])\n"
        "        for a, e in zip([got, *got_grads], [ref, *ref_grads]):\n"
        "            if dtype == torch.bfloat16:\n"
        "                assert t.relative_error(a, e) < 1e-2\n"
        "            else:\n"
        "                t.assert_close_f32(a.double(), e.double())\n"
        "    h, w, b, target = t.improbable_tail_inputs(dtype)\n"
        "    _, (gh, gw, gb) = t.loss_and_grads(lambda: t.call(h, w, b, target, tile_tokens=16, tile_vocab=20,\n"
        "                                                      filter_eps='auto'), [h, w, b])\n"
        "    _, (uh, uw, ub) = t.loss_and_grads(lambda: t.call(h, w, b, target, tile_tokens=16, tile_vocab=20,\n"
        "                                                      gradients_in_forward=False),\n"
        "                                       [h, w, b])\n"
        "    assert (gw[40:] == 0).all() and (uw[40:] != 0).all() and torch.equal(gw[:40], uw[:40])\n"
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
