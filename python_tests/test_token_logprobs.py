"""token_logprobs against eager torch: log_softmax(F.linear(...) / temperature) gathered at the ids and the entropy
of that softmax, their gradients for random upstream gradients of either output, gradcheck in float64, opcheck,
bf16/fp16 against float64 with eager's error as the scale, autocast, torch.compile, meta tensors, bad arguments, and
no [tokens, V] allocation."""

import pytest
import torch
import torch.nn.functional as F
from op_recording import peak_allocated_bytes
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range


def scores(hidden, weight, bias=None, temperature=1.0, softcap=0.0, logit_scale=1.0):
    """The whole [..., V] scores as TRL's fused head makes them: scaled, soft-capped, over the temperature (in
    float32 for bf16/fp16 logits)."""
    logits = F.linear(hidden, weight, bias)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def reference(hidden, weight, ids, bias=None, temperature=1.0, softcap=0.0, logit_scale=1.0, ignore_index=None):
    """(log-probabilities, entropies) from the whole scores, as TRL's selective_log_softmax and
    entropy_from_logits compute them; 0 where the id is ignore_index, as TRL masks them."""
    counted = torch.ones_like(ids, dtype=torch.bool) if ignore_index is None else ids != ignore_index
    ids = ids.masked_fill(~counted, 0)
    log_p = torch.log_softmax(scores(hidden, weight, bias, temperature, softcap, logit_scale), dim=-1)
    # p log p is 0 where a logit is masked to -inf (not 0 * -inf = NaN, nor a NaN gradient through it).
    finite_log_p = log_p.masked_fill(log_p.isneginf(), 0.0)
    logprobs, entropies = log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * finite_log_p).sum(-1)
    return logprobs.masked_fill(~counted, 0), entropies.masked_fill(~counted, 0)


def make_inputs(shape, vocab, bias=False, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = shape[-1]
    hidden = torch.randn(shape, generator=generator, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=generator, dtype=dtype) / h**0.5).requires_grad_()
    b = torch.randn(vocab, generator=generator, dtype=dtype).requires_grad_() if bias else None
    ids = torch.randint(0, vocab, shape[:-1], generator=generator)
    return hidden, weight, b, ids


def outputs_and_grads(outputs, upstream, leaves):
    """The outputs, and the gradients of sum(output * upstream) over both outputs by the leaves."""
    total = sum((o * u).sum() for o, u in zip(outputs, upstream) if u is not None)
    return outputs, torch.autograd.grad(total, leaves, allow_unused=True)


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


SHAPES = [((2, 7, 16), 19), ((1030, 8), 4099)]  # one tile; two tiles of tokens and three of the vocabulary


@pytest.mark.parametrize("shape, vocab", SHAPES, ids=["one_tile", "many_tiles"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("which", ["logprobs", "entropy", "both"])
def test_matches_eager_float64_for_any_upstream_gradient(shape, vocab, temperature, bias, which):
    hidden, weight, b, ids = make_inputs(shape, vocab, bias=bias)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    generator = torch.Generator().manual_seed(1)
    upstream = [torch.randn(shape[:-1], generator=generator, dtype=torch.float64) for _ in range(2)]
    if which == "logprobs":
        upstream[1] = None
    if which == "entropy":
        upstream[0] = None
    want, want_grads = outputs_and_grads(reference(hidden, weight, ids, b, temperature), upstream, leaves)
    got, got_grads = outputs_and_grads(
        torch_offload.token_logprobs(hidden, weight, ids, bias=b, temperature=temperature, entropy=True),
        upstream,
        leaves,
    )
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and g.shape == shape[:-1]
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


# Gemma 2's final soft-capping, Cohere's logit scale, and labels with ignored positions, as TRL's fused head passes
# them; each alone and together.
SCORINGS = {
    "softcap": dict(softcap=3.0),
    "logit_scale": dict(logit_scale=0.0625 * 8),
    "ignore_index": dict(ignore_index=-100),
    "all": dict(softcap=2.0, logit_scale=4.0, ignore_index=7),
}


@pytest.mark.parametrize("shape, vocab", SHAPES, ids=["one_tile", "many_tiles"])
@pytest.mark.parametrize("scoring", list(SCORINGS))
def test_softcap_logit_scale_and_ignore_index_match_eager_float64(shape, vocab, scoring):
    kwargs = SCORINGS[scoring]
    hidden, weight, b, ids = make_inputs(shape, vocab, bias=True)
    if "ignore_index" in kwargs:
        ids = ids.masked_fill(
            torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.3, kwargs["ignore_index"]
        )
    leaves = [hidden, weight, b]
    upstream = [
        torch.randn(shape[:-1], generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in (3, 4)
    ]
    want, want_grads = outputs_and_grads(reference(hidden, weight, ids, b, 0.7, **kwargs), upstream, leaves)
    got, got_grads = outputs_and_grads(
        torch_offload.token_logprobs(hidden, weight, ids, bias=b, temperature=0.7, entropy=True, **kwargs),
        upstream,
        leaves,
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    # The summaries take the same scores, and give 0 (False) at ignored ids.
    mean, top1, log_sum_sq = torch_offload.token_logprob_summaries(
        hidden, weight, ids, bias=b, temperature=0.7, **kwargs
    )
    kept = ids != kwargs.get("ignore_index", -100)
    s = scores(hidden, weight, b, 0.7, kwargs.get("softcap", 0.0), kwargs.get("logit_scale", 1.0)).detach()
    safe_ids = ids.masked_fill(~kept, 0)
    torch.testing.assert_close(mean, s.mean(-1).masked_fill(~kept, 0), rtol=1e-12, atol=1e-12)
    assert torch.equal(top1, (s.argmax(-1) == safe_ids) & kept)
    torch.testing.assert_close(log_sum_sq, (2 * s.log_softmax(-1)).logsumexp(-1).masked_fill(~kept, 0))


@pytest.mark.parametrize("scoring", ["softcap", "all"])
def test_gradcheck_float64_with_softcap_and_logit_scale(scoring):
    kwargs = dict(SCORINGS[scoring], entropy=True, temperature=0.7)
    hidden, weight, b, ids = make_inputs((2, 5, 6), 11, bias=True)
    ids[0, 1] = kwargs.get("ignore_index", ids[0, 1])

    def both(hidden, weight, b):
        return torch_offload.token_logprobs(hidden, weight, ids, bias=b, **kwargs)

    assert torch.autograd.gradcheck(both, (hidden, weight, b))


def test_default_log_probabilities_and_gradients_match_eager_on_odd_layouts():
    # entropy=False (the default), int32 ids, a strided hidden and a transposed weight.
    base, weight_t, b, ids = make_inputs((3, 10, 8), 23, bias=True)
    hidden = base[:, ::2]
    weight = torch.randn(8, 23, dtype=torch.float64).t().requires_grad_()
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    ids = ids[:, ::2].int()
    upstream = torch.randn(ids.shape, dtype=torch.float64)
    leaves = [base, weight, b]
    got, got_grads = outputs_and_grads([torch_offload.token_logprobs(hidden, weight, ids, bias=b)], [upstream], leaves)
    want, want_grads = outputs_and_grads([reference(hidden, weight, ids.long(), b)[0]], [upstream], leaves)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "hidden_shape, ids_shape, vocab",
    [((0, 8), (0,), 11), ((8,), (), 11), ((2, 3, 0), (2, 3), 11)],
    ids=["no_tokens", "one_vector", "hidden_size_zero"],
)
def test_edge_shapes_match_eager(hidden_shape, ids_shape, vocab):
    hidden = torch.randn(hidden_shape, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_shape[-1], dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, vocab, ids_shape)
    upstream = [torch.randn(ids_shape, dtype=torch.float64), torch.randn(ids_shape, dtype=torch.float64)]
    got, got_grads = outputs_and_grads(
        torch_offload.token_logprobs(hidden, weight, ids, entropy=True), upstream, [hidden, weight]
    )
    want, want_grads = outputs_and_grads(reference(hidden, weight, ids), upstream, [hidden, weight])
    for g, w in zip([*got, *got_grads], [*want, *want_grads]):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


def test_entropy_changed_in_place_after_forward_still_backpropagates():
    # RL code masks or cleans the entropies in place; the backward keeps its own copy.
    hidden, weight, _, ids = make_inputs((2, 6, 8), 17)
    logprobs, entropy = torch_offload.token_logprobs(hidden, weight, ids, entropy=True)
    want_logprobs, want_entropy = reference(hidden, weight, ids)
    mask = torch.arange(6) < 4
    entropy.masked_fill_(~mask, 0.0)
    loss = logprobs.sum() + entropy.sum()
    want_loss = want_logprobs.sum() + want_entropy.masked_fill(~mask, 0.0).sum()
    for g, w in zip(torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(want_loss, (hidden, weight))):
        torch.testing.assert_close(g, w)


def test_without_entropy_returns_the_log_probabilities_alone():
    hidden, weight, b, ids = make_inputs((3, 5, 8), 23, bias=True)
    got = torch_offload.token_logprobs(hidden, weight, ids, bias=b, temperature=0.7)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, reference(hidden, weight, ids, b, 0.7)[0])
    logprobs, placeholder = torch.ops.offload.token_logprobs(hidden, weight, ids)
    assert placeholder.shape == (0,) and not placeholder.requires_grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck_float64_both_outputs(temperature):
    hidden, weight, b, ids = make_inputs((2, 3, 6), 11, bias=True)  # odd V
    assert torch.autograd.gradcheck(
        lambda x, w, bb: torch_offload.token_logprobs(x, w, ids, bias=bb, temperature=temperature, entropy=True),
        (hidden, weight, b),
    )


def test_gradcheck_float64_tied_weight():
    # The head's weight is also the embedding the hidden states come from: both paths reach it.
    _, weight, _, ids = make_inputs((2, 5, 6), 13)
    projection = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)

    def tied(w, p):
        hidden = F.embedding(ids, w) @ p
        return torch_offload.token_logprobs(hidden, w, ids.roll(1, -1), temperature=0.7, entropy=True)

    assert torch.autograd.gradcheck(tied, (weight, projection))


def test_frozen_weight_gets_no_gradient_and_hidden_gets_eagers():
    hidden, weight, _, ids = make_inputs((4, 9, 8), 37)
    weight.requires_grad_(False)
    logprobs, entropy = torch_offload.token_logprobs(hidden, weight, ids, entropy=True)
    upstream = [torch.randn_like(logprobs), torch.randn_like(entropy)]
    (grad,) = torch.autograd.grad((logprobs * upstream[0]).sum() + (entropy * upstream[1]).sum(), hidden)
    want_logprobs, want_entropy = reference(hidden, weight, ids)
    (want,) = torch.autograd.grad((want_logprobs * upstream[0]).sum() + (want_entropy * upstream[1]).sum(), hidden)
    torch.testing.assert_close(grad, want)
    assert torch.autograd.gradcheck(
        lambda x: torch_offload.token_logprobs(x, weight, ids[:2, :3], entropy=True),
        (hidden[:2, :3].detach().requires_grad_(),),
    )


def test_vocabulary_masked_by_minus_infinity_matches_eager():
    # Masked logits have p = 0: they add nothing to the entropy or its gradient (not 0 * -inf = NaN), in
    # every vocabulary tile, a tile that is all masked included.
    hidden, weight, b, ids = make_inputs((1030, 8), 4099, bias=True)
    with torch.no_grad():
        b[:1500] = float("-inf")  # the first vocabulary tile of three, and more
        b[2000:2100] = float("-inf")
        b[2734:] = float("-inf")  # the last tile
    ids = torch.randint(1500, 2000, ids.shape)
    leaves = [hidden, weight, b]
    upstream = [torch.randn(ids.shape, dtype=torch.float64), torch.randn(ids.shape, dtype=torch.float64)]
    want, want_grads = outputs_and_grads(reference(hidden, weight, ids, b, 0.7), upstream, leaves)
    got, got_grads = outputs_and_grads(
        torch_offload.token_logprobs(hidden, weight, ids, bias=b, temperature=0.7, entropy=True), upstream, leaves
    )
    for g, w in zip([*got, *got_grads], [*want, *want_grads]):
        assert g.isfinite().all()
        torch.testing.assert_close(g, w)
    assert (got_grads[2][~b.isfinite()] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    hidden64, weight64, b64, ids = make_inputs((2, 600, 32), 5000, bias=True)
    rounded = [t.detach().to(dtype) for t in (hidden64, weight64, b64)]
    inputs = [t.clone().requires_grad_() for t in rounded]
    inputs64 = [t.double().requires_grad_() for t in rounded]
    upstream = [torch.randn(ids.shape, dtype=torch.float32), torch.randn(ids.shape, dtype=torch.float32)]
    want, want_grads = outputs_and_grads(reference(*inputs64[:2], ids, inputs64[2], 0.7), upstream, inputs64)
    eager, eager_grads = outputs_and_grads(reference(*inputs[:2], ids, inputs[2], 0.7), upstream, inputs)
    got, got_grads = outputs_and_grads(
        torch_offload.token_logprobs(*inputs[:2], ids, bias=inputs[2], temperature=0.7, entropy=True),
        upstream,
        inputs,
    )
    for name, g, e, w in zip(["logprobs", "entropy"], got, eager, want):
        assert g.dtype == torch.float32, name
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-3), name
    for name, g, e, w in zip(["hidden", "weight", "bias"], got_grads, eager_grads, want_grads):
        assert g.dtype == dtype, name
        assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2), name


@pytest.mark.parametrize("size", [40.0, 1e4])
def test_float32_at_large_logits_is_as_close_to_float64_as_eager(size):
    # Logits near `size` with a spread of a few units: a float32 log-sum-exp near 1e4 is off by up to 5e-4 (half a
    # unit in its last place), which backward's s - lse handed on to every probability (the hidden states' gradient
    # 3.5x further from float64's than eager's before the log-sum-exp was kept in float64).
    generator = torch.Generator().manual_seed(0)
    tokens, vocab, h = 64, 300, 16
    hidden = 3 * torch.nn.functional.normalize(torch.randn(tokens, h, generator=generator, dtype=torch.float64), dim=1)
    weight = torch.nn.functional.normalize(torch.randn(vocab, h, generator=generator, dtype=torch.float64), dim=1)
    b = torch.full((vocab,), size, dtype=torch.float64)
    ids = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream = [torch.randn(tokens, generator=generator, dtype=torch.float64)]

    def run(dtype, fn):
        leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight, b)]
        (logprobs, *_), grads = outputs_and_grads([fn(*leaves)], [u.to(dtype) for u in upstream], leaves)
        return [logprobs, *grads]

    def ours(*leaves):
        return torch_offload.token_logprobs(*leaves[:2], ids, bias=leaves[2])

    def eager(*leaves):
        return reference(*leaves[:2], ids, leaves[2], 1.0)[0]

    want, got, eager32 = run(torch.float64, eager), run(torch.float32, ours), run(torch.float32, eager)
    for name, w, g, e in zip(["logprobs", "hidden", "weight", "bias"], want, got, eager32):
        error, eagers = (g.double() - w).abs().max(), (e.double() - w).abs().max()
        assert error <= 2 * eagers, (name, error.item(), eagers.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_logits_are_not_rounded_before_the_softmax(dtype):
    # The products of bf16/fp16 inputs stay float32 through the bias and the temperature: against float64 on the
    # same (rounded) inputs, float32's error, where eager's rounding of each logit (logits near 8) puts them 5e-2
    # off in bf16, 6e-3 in fp16.
    hidden, weight, b, ids = (t.detach() for t in make_inputs((2, 300, 32), 3000, bias=True))
    b = b + 8
    rounded = [t.to(dtype) for t in (hidden, weight, b)]
    want = [t.to(torch.float32) for t in reference(*[t.double() for t in rounded[:2]], ids, rounded[2].double(), 0.7)]
    got = torch_offload.token_logprobs(*rounded[:2], ids, bias=rounded[2], temperature=0.7, entropy=True)
    summaries = torch_offload.token_logprob_summaries(*rounded[:2], ids, bias=rounded[2], temperature=0.7)
    logits = F.linear(*[t.double() for t in rounded]) / 0.7
    want_mean = logits.mean(-1)
    for name, g, w in zip(["logprobs", "entropy", "mean logit"], [*got, summaries[0]], [*want, want_mean]):
        torch.testing.assert_close(g, w.float(), rtol=0, atol=2e-5, msg=name)


def test_summaries_under_autocast_run_in_the_autocast_dtype():
    # As token_logprobs: the GEMMs in the autocast dtype (the inputs cast to it), mixed input dtypes taken.
    hidden, weight, b, ids = (t.detach() for t in make_inputs((2, 9, 16), 40, bias=True, dtype=torch.float32))
    want = torch_offload.token_logprob_summaries(hidden.bfloat16(), weight.bfloat16(), ids, bias=b.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch_offload.token_logprob_summaries(hidden, weight, ids, bias=b)
        mixed = torch_offload.token_logprob_summaries(hidden.bfloat16(), weight, ids, bias=b)
    for g, m, w in zip(got, mixed, want):
        assert torch.equal(g, w) and torch.equal(m, w)


def test_autocast_runs_the_gemms_in_the_autocast_dtype_and_returns_float32():
    hidden, weight, b, ids = make_inputs((2, 9, 16), 40, bias=True, dtype=torch.float32)
    upstream = [torch.randn(ids.shape), torch.randn(ids.shape)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_grads = outputs_and_grads(
            torch_offload.token_logprobs(hidden, weight, ids, bias=b, entropy=True), upstream, [hidden, weight, b]
        )
        logits = F.linear(hidden, weight, b).float()
    want, want_grads = outputs_and_grads(
        (
            logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1),
            -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1),
        ),
        upstream,
        [hidden, weight, b],
    )
    for g, w in zip([*got, *got_grads], [*want, *want_grads]):
        assert g.dtype == torch.float32
        assert relative_error(g, w) < 2e-2


def test_no_tensor_of_tokens_by_vocabulary_is_allocated():
    tokens, vocab = 2048, 32768
    hidden, weight, b, ids = make_inputs((tokens, 16), vocab, bias=True, dtype=torch.float32)
    upstream = [torch.randn(tokens), torch.randn(tokens)]
    full = tokens * vocab * 4

    def step(fn):
        outputs_and_grads(fn(), upstream, [hidden, weight, b])

    ours = peak_allocated_bytes(
        lambda: step(lambda: torch_offload.token_logprobs(hidden, weight, ids, bias=b, entropy=True))
    )
    eager = peak_allocated_bytes(lambda: step(lambda: reference(hidden, weight, ids, b)))
    assert eager > full  # the measure sees [tokens, V]
    assert ours < full / 4, (ours, full)


def test_opcheck():
    for bias in (False, True):
        hidden, weight, b, ids = make_inputs((2, 7, 16), 19, bias=bias, dtype=torch.float32)
        scoring = (2.0, 0.5, int(ids[0, 0]))  # softcap, logit_scale, and an id present as ignore_index
        for entropy in (False, True):
            opcheck(
                torch.ops.offload.token_logprobs.default,
                (hidden, weight, ids),
                dict(bias=b, temperature=0.7, entropy=entropy),
            )
        opcheck(
            torch.ops.offload.token_logprobs.default,
            (hidden, weight, ids),
            dict(bias=b, temperature=0.7, entropy=True, softcap=2.0, logit_scale=0.5, ignore_index=scoring[2]),
        )
        detached = [t.detach() if t is not None else None for t in (hidden, weight, b)]
        opcheck(
            torch.ops.offload.token_logprobs_forward.default,
            (detached[0], detached[1], ids, detached[2], 0.7, True, *scoring),
        )
        logprobs, entropy, lse = torch.ops.offload.token_logprobs_forward(
            detached[0], detached[1], ids, detached[2], 0.7, True, *scoring
        )
        grad = torch.randn(ids.shape)
        for grads, mask in (
            ((grad, grad), [True, True, True]),
            ((grad, None), [False, True, False]),
            ((None, grad), [True, False, True]),
        ):
            opcheck(
                torch.ops.offload.token_logprobs_backward.default,
                (*grads, detached[0], detached[1], ids, detached[2], lse, entropy, 0.7, *scoring, mask),
            )


def test_compile_fullgraph_dynamic_matches_eager():
    torch._dynamo.reset()
    head = torch.nn.Linear(16, 37, bias=False)

    def per_token(x, ids):
        logprobs, entropy = torch_offload.token_logprobs(x, head.weight, ids, temperature=0.7, entropy=True)
        return logprobs.sum() + 0.5 * entropy.sum()

    compiled = torch.compile(per_token, fullgraph=True, dynamic=True)
    for tokens in (12, 29):
        x = torch.randn(2, tokens, 16, requires_grad=True)
        ids = torch.randint(0, 37, (2, tokens))
        want, want_grads = outputs_and_grads([per_token(x, ids)], [torch.ones(())], [x, head.weight])
        got, got_grads = outputs_and_grads([compiled(x, ids)], [torch.ones(())], [x, head.weight])
        torch.testing.assert_close(got[0], want[0])
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w)
    explanation = torch._dynamo.explain(per_token)(torch.randn(2, 12, 16), torch.randint(0, 37, (2, 12)))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_meta_tensors_give_shapes_only():
    hidden = torch.empty(2, 5, 16, device="meta", dtype=torch.bfloat16)
    weight = torch.empty(30, 16, device="meta", dtype=torch.bfloat16)
    ids = torch.empty(2, 5, dtype=torch.long, device="meta")
    logprobs, entropy, lse = torch.ops.offload.token_logprobs_forward(
        hidden, weight, ids, None, 1.0, True, 0.0, 1.0, -100
    )
    assert [(t.shape, t.dtype, t.is_meta) for t in (logprobs, entropy, lse)] == [
        ((2, 5), torch.float32, True),
        ((2, 5), torch.float32, True),
        ((10,), torch.float64, True),  # the log-sum-exp kept for backward: float64 for every input dtype
    ]
    grads = torch.ops.offload.token_logprobs_backward(
        logprobs, None, hidden, weight, ids, None, lse, None, 1.0, 0.0, 1.0, -100, [False, True, True]
    )
    assert [g.shape if g is not None else None for g in grads] == [None, (30, 16), None]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(ids=torch.tensor([[0, 19, 1]])),
            r"token_logprobs: ids holds 19 at \(flattened\) index 1; expected token ids in \[0, 19\) "
            r"or ignore_index \(-100\)",
        ),
        (dict(ids=torch.tensor([[0, -1, 1]])), r"ids holds -1 at \(flattened\) index 1"),
        (dict(ids=torch.zeros(1, 3)), r"token_logprobs: ids has dtype Float; expected int64 \(or int32\) token ids"),
        (dict(ids=torch.zeros(1, 4, dtype=torch.long)), r"token_logprobs: ids"),
        (dict(weight=torch.randn(19, 5)), r"token_logprobs: weight"),
        (dict(bias=torch.randn(18)), r"token_logprobs: bias"),
        (dict(temperature=0.0), r"token_logprobs: temperature is 0; expected a finite value > 0"),
        (dict(temperature=float("inf")), r"token_logprobs: temperature is inf"),
        (dict(softcap=-1.0), r"token_logprobs: softcap is -1; expected a finite value >= 0 \(0: no softcap\)"),
        (dict(softcap=float("inf")), r"token_logprobs: softcap is inf"),
        (dict(logit_scale=float("nan")), r"token_logprobs: logit_scale is nan; expected a finite value"),
        (dict(ids=torch.tensor([[0, -100, 1]]), ignore_index=-1), r"ids holds -100 at \(flattened\) index 1"),
        (dict(hidden=torch.zeros(1, 3, 8, dtype=torch.long)), r"token_logprobs: hidden has dtype Long"),
        (dict(hidden=None), r"token_logprobs: hidden is NoneType; expected a defined tensor"),
    ],
    ids=[
        "id_too_large",
        "negative_id",
        "float_ids",
        "ids_shape",
        "weight_shape",
        "bias_shape",
        "zero_temperature",
        "inf_temperature",
        "negative_softcap",
        "inf_softcap",
        "nan_logit_scale",
        "ignore_index_other_than_the_id",
        "integer_hidden",
        "no_hidden",
    ],
)
def test_bad_arguments_are_refused_by_name(change, message):
    arguments = dict(hidden=torch.randn(1, 3, 8), weight=torch.randn(19, 8), ids=torch.tensor([[0, 1, 2]]))
    arguments.update(change)
    keywords = {
        k: arguments.pop(k) for k in ("bias", "temperature", "softcap", "logit_scale", "ignore_index") if k in arguments
    }
    with pytest.raises(RuntimeError, match=message):
        torch_offload.token_logprobs(arguments["hidden"], arguments["weight"], arguments["ids"], **keywords)


@pytest.mark.parametrize("shape, vocab", SHAPES, ids=["one_tile", "many_tiles"])
def test_summaries_match_eager_and_carry_no_gradient(shape, vocab):
    hidden, weight, b, ids = make_inputs(shape, vocab, bias=True)
    with torch.no_grad():  # half the ids the argmax, so that top-1 is true and false
        best = F.linear(hidden, weight, b).argmax(-1)
    ids = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.5, best, ids)
    mean, top1, log_sum_sq = torch_offload.token_logprob_summaries(hidden, weight, ids, bias=b, temperature=0.7)
    logits = F.linear(hidden, weight, b) / 0.7
    p = logits.softmax(-1)
    torch.testing.assert_close(mean, logits.mean(-1))
    assert torch.equal(top1, logits.argmax(-1) == ids) and 0 < top1.float().mean() < 1
    torch.testing.assert_close(log_sum_sq, (p * p).sum(-1).log())
    assert not (mean.requires_grad or log_sum_sq.requires_grad) and top1.dtype == torch.bool


def test_summaries_count_a_tie_as_top1_for_the_first_maximum_only():
    hidden, weight = torch.zeros(2, 4), torch.zeros(6, 4)  # every logit equal: argmax is column 0
    _, top1, _ = torch_offload.token_logprob_summaries(hidden, weight, torch.tensor([0, 3]))
    assert top1.tolist() == [True, False]


def test_summaries_opcheck_and_meta():
    hidden, weight, b, ids = make_inputs((2, 7, 16), 19, bias=True, dtype=torch.float32)
    opcheck(torch.ops.offload.token_logprob_summaries.default, (hidden, weight, ids), dict(bias=b, temperature=0.7))
    meta = [torch.empty(2, 5, 16, device="meta", dtype=torch.bfloat16), torch.empty(30, 16, device="meta")]
    meta[1] = meta[1].bfloat16()
    outputs = torch.ops.offload.token_logprob_summaries(*meta, torch.empty(2, 5, dtype=torch.long, device="meta"))
    assert [(o.shape, o.dtype) for o in outputs] == [
        ((2, 5), torch.float32),
        ((2, 5), torch.bool),
        ((2, 5), torch.float32),
    ]
