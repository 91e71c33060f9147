"""segment_attention's score mods: soft-capped scores (Gemma 2's attn_logit_softcapping), learned sinks
(GPT-OSS's) and sliding windows, against their attention written out with the dense mask the segments stand
for: values and gradients (the sinks' too), gradcheck, opcheck, reduced precision, chunks of queries, no
[T, T] tensor, gradients not needed, torch.compile, errors."""

import pytest
import torch
from op_recording import peak_allocated_bytes
from test_attention_block import SEGMENTS, segment_mask
from test_segment_attention import make_qkv
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

MODS = {"softcap": dict(softcap=2.0), "sinks": dict(sinks=True), "both": dict(softcap=2.0, sinks=True)}


def make_sinks(heads=2, dtype=torch.float64, seed=1):
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed), dtype=dtype).requires_grad_()


def reference(q, k, v, segment_ids, scale=None, softcap=None, sinks=None, window=None):
    """Eager attention as transformers writes Gemma 2's (capped scores) and GPT-OSS's (a sink column in the
    softmax, dropped after it), with segment_mask's dense mask and a window's band (transformers'
    sliding_window_overlay); a query with no key gets 0, as from the op."""
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = segment_mask(segment_ids.cpu()).to(q.device)
    if window is not None:
        positions = torch.arange(q.shape[2], device=q.device)
        mask = mask & (positions[:, None] - positions[None, :] < window)
    has_keys = mask.any(-1, keepdim=True)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        scores = torch.cat([scores, column], -1)
    probs = torch.where(has_keys, scores, 0).softmax(-1)
    return (probs[..., : k.shape[2]] @ v) * has_keys


def call(q, k, v, segment_ids, sinks=None, **mods):
    return torch_offload.segment_attention(q, k, v, segment_ids, sinks=sinks, **mods)


def output_and_grads(fn, leaves, grad_out):
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


def inputs_for(mods, dtype=torch.float64, **shape):
    leaves = make_qkv(dtype=dtype, **shape)
    if mods.get("sinks"):
        leaves.append(make_sinks(leaves[0].shape[1], dtype))
    return leaves, {name: value for name, value in mods.items() if name != "sinks"}


def run(fn, leaves, segment_ids, grad_out, **kwargs):
    """fn's output and gradients for leaves (query, key, value and, when there, sinks)."""

    def forward(q, k, v, sinks=None):
        return fn(q, k, v, segment_ids, sinks=sinks, **kwargs)

    return output_and_grads(forward, leaves, grad_out)


def assert_matches(got, want, **tolerances):
    torch.testing.assert_close(got[0], want[0], **tolerances)
    for name, g, w in zip(("query", "key", "value", "sinks"), got[1], want[1]):
        torch.testing.assert_close(g, w, **tolerances, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("mods", MODS)
def test_matches_eager_attention_with_the_dense_mask_float64(mods, scale):
    leaves, options = inputs_for(MODS[mods])
    grad_out = torch.randn_like(leaves[0])
    got = run(call, leaves, SEGMENTS, grad_out, scale=scale, **options)
    assert_matches(got, run(reference, leaves, SEGMENTS, grad_out, scale=scale, **options))
    # The mods change the result: a test of them that would pass without them proves nothing.
    plain = torch_offload.segment_attention(*leaves[:3], SEGMENTS, scale=scale)
    assert not torch.allclose(got[0], plain, rtol=1e-3, atol=1e-3)


def test_chunks_of_queries_match_one_chunk():
    # 2048 tokens of 4 heads: 128 MiB of float64 scores, so the queries run in chunks (16 MiB on a CPU).
    leaves, options = inputs_for(MODS["both"], batch=1, heads=4, tokens=2048, head_dim=8)
    segments = torch.arange(2048).div(900, rounding_mode="floor")[None]
    grad_out = torch.randn_like(leaves[0])
    assert_matches(
        run(call, leaves, segments, grad_out, **options), run(reference, leaves, segments, grad_out, **options)
    )


# Rows of packed documents (no padding: the op refuses padding whose sequence reaches past the window).
PACKED = torch.tensor([[0] * 5 + [1] * 4 + [0] * 4, [3] * 13, [1] * 6 + [2] * 7])


@pytest.mark.parametrize("window", [1, 3, 7, 13])
@pytest.mark.parametrize("mods", ["none", "both"])
def test_a_window_is_a_band_within_each_document(mods, window):
    leaves, options = inputs_for(MODS[mods] if mods != "none" else {})
    grad_out = torch.randn_like(leaves[0])
    got = run(call, leaves, PACKED, grad_out, window=window, **options)
    assert_matches(got, run(reference, leaves, PACKED, grad_out, window=window, **options))


def test_long_windowed_documents_run_in_chunks_and_match():
    # 2048 tokens, a window of 100: chunks of at most the window's length, each against fewer than 200 keys.
    leaves, options = inputs_for(MODS["both"], batch=1, heads=2, tokens=2048, head_dim=8)
    segments = torch.arange(2048).div(1500, rounding_mode="floor")[None]
    grad_out = torch.randn_like(leaves[0])
    assert_matches(
        run(call, leaves, segments, grad_out, window=100, **options),
        run(reference, leaves, segments, grad_out, window=100, **options),
    )


def test_padding_within_the_window_matches_and_past_it_is_refused():
    leaves, options = inputs_for(MODS["both"])
    grad_out = torch.randn_like(leaves[0])
    # SEGMENTS' last padding token is 12 tokens after its sequence's first: a window of 13 reaches it.
    assert_matches(
        run(call, leaves, SEGMENTS, grad_out, window=13, **options),
        run(reference, leaves, SEGMENTS, grad_out, window=13, **options),
    )
    with pytest.raises(RuntimeError, match="segment_attention: the padding at tokens 10 to 12 of row 1 would see"):
        call(*leaves[:3], SEGMENTS, leaves[3], window=12, **options)


def test_gradcheck_float64():
    leaves, options = inputs_for(MODS["both"], batch=2, heads=2, tokens=6, head_dim=3)
    segments = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, -1, -1]])
    assert torch.autograd.gradcheck(lambda *a: call(*a[:3], segments, *a[3:], scale=0.4, **options), leaves)
    packed = torch.tensor([[0, 0, 0, 0, 1, 1], [5, 5, 5, 5, 5, 5]])
    assert torch.autograd.gradcheck(lambda *a: call(*a[:3], packed, *a[3:], window=2, **options), leaves)


@pytest.mark.parametrize("mods", MODS)
def test_opcheck(mods):
    leaves, options = inputs_for(MODS[mods], dtype=torch.float32)
    detached = [t.detach() for t in leaves]
    sinks = detached[3] if len(detached) > 3 else None
    opcheck(torch.ops.offload.segment_attention.default, (*leaves[:3], SEGMENTS, None, options.get("softcap"), sinks))
    if sinks is not None:
        opcheck(torch.ops.offload.segment_attention.default, (*detached[:3], SEGMENTS, None, None, leaves[3]))
    grad_out = torch.randn_like(leaves[0])
    for mask in ([True] * 4, [False, False, False, True]):
        opcheck(
            torch.ops.offload.segment_attention_backward.default,
            (grad_out, *detached[:3], SEGMENTS, 0.5, mask, options.get("softcap"), sinks),
        )
    opcheck(torch.ops.offload.segment_attention.default, (*leaves[:3], PACKED, None, None, sinks, 3))
    opcheck(
        torch.ops.offload.segment_attention_backward.default,
        (grad_out, *detached[:3], PACKED, None, [True] * 4, options.get("softcap"), sinks, 3),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    leaves, options = inputs_for(MODS["both"], batch=2, heads=4, tokens=40, head_dim=8)
    low = [t.detach().to(dtype).requires_grad_() for t in leaves]
    # Seeded: the global generator's state depends on which tests ran before in the same worker.
    grad_out = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    segments = SEGMENTS.repeat(1, 4)[:2, :40]
    want = run(reference, leaves, segments, grad_out, **options)
    eager = run(reference, low, segments, grad_out.to(dtype), **options)
    got = run(call, low, segments, grad_out.to(dtype), **options)
    # Eager attention in float64 on the rounded inputs: the error their rounding alone makes. The sinks' gradient,
    # four sums over every query that cancel, gets up to 1.6e-2 from it, and eager's own error in low precision is
    # sometimes far less by chance (an Intel CI machine: 7.7e-3 against the op's 1.6e-2).
    rounded_inputs = [t.detach().double().requires_grad_() for t in low]
    rounded = run(reference, rounded_inputs, segments, grad_out.to(dtype).double(), **options)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1])

    def error(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def flat(result):
        return (result[0], *result[1])

    names = ("output", "query", "key", "value", "sinks")
    for name, g, e, r, w in zip(names, flat(got), flat(eager), flat(rounded), flat(want)):
        assert error(g, w) <= max(2 * error(e, w), 2 * error(r, w), 1e-2), name


def test_no_tensor_of_tokens_squared_elements():
    # 4096 tokens in one document: T * T float32 scores are 64 MiB a head; the op holds a chunk's (16 MiB).
    leaves, options = inputs_for(MODS["both"], dtype=torch.float32, batch=1, heads=1, tokens=4096, head_dim=16)
    segments = torch.zeros(1, 4096, dtype=torch.long)
    grad_out = torch.randn_like(leaves[0])
    squared = 4096 * 4096 * 4
    assert peak_allocated_bytes(lambda: run(call, leaves, segments, grad_out, **options)) < squared
    assert peak_allocated_bytes(lambda: run(reference, leaves, segments, grad_out, **options)) > squared


@pytest.mark.parametrize("needed", [(True, False, False, False), (False, False, False, True), (True, True, True, True)])
def test_gradients_not_needed_are_not_computed(needed):
    leaves, options = inputs_for(MODS["both"])
    for t, wanted in zip(leaves, needed):
        t.requires_grad_(wanted)
    call(*leaves[:3], SEGMENTS, leaves[3], **options).sum().backward()
    assert [t.grad is not None for t in leaves] == list(needed)
    grads = torch.ops.offload.segment_attention_backward(
        torch.ones_like(leaves[0]), *(t.detach() for t in leaves[:3]), SEGMENTS, None, list(needed), 2.0, leaves[3]
    )
    assert [g is not None for g in grads] == list(needed)


def test_compile_fullgraph_dynamic_over_changing_tokens():
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, dynamic=True)
    for tokens, documents in ((12, 2), (29, 5)):
        leaves, options = inputs_for(MODS["both"], dtype=torch.float32, batch=2, tokens=tokens, seed=tokens)
        position_ids = torch.arange(tokens).remainder(-(-tokens // documents))[None]
        segments = torch_offload.attention_block_segment_ids(position_ids=position_ids, batch=2)
        grad_out = torch.randn_like(leaves[0])
        assert_matches(
            run(compiled, leaves, segments, grad_out, **options),
            run(reference, leaves, segments, grad_out, **options),
            rtol=1e-5,
            atol=1e-6,
        )


def bad_score_mod_cases():
    return [
        ("softcap_zero", dict(softcap=0.0), "softcap is 0; expected a finite value > 0"),
        ("softcap_inf", dict(softcap=float("inf")), "softcap is inf; expected a finite value > 0"),
        ("sinks_shape", dict(sinks=torch.zeros(2)), r"sinks has shape \[2\]; expected \[heads\] = \[3\]"),
        ("sinks_dim", dict(sinks=torch.zeros(1, 3)), r"sinks has shape \[1, 3\]; expected \[heads\] = \[3\]"),
        ("sinks_dtype", dict(sinks=torch.zeros(3, dtype=torch.long)), "sinks has dtype Long; expected a floating"),
        ("sinks_device", dict(sinks=torch.zeros(3, device="meta")), "sinks is on meta but query is on cpu"),
        ("window_zero", dict(window=0), "window is 0; expected a number of tokens > 0"),
        ("window_negative", dict(window=-4), "window is -4; expected a number of tokens > 0"),
    ]


@pytest.mark.parametrize("name, mods, message", bad_score_mod_cases(), ids=[c[0] for c in bad_score_mod_cases()])
def test_bad_score_mods_raise_errors_naming_the_argument(name, mods, message):
    q, ids = torch.zeros(2, 3, 5, 4), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(RuntimeError, match=f"segment_attention: {message}"):
        torch_offload.segment_attention(q, q, q, ids, **mods)
    args = (q, q, q, q, ids, None, [True] * 4, mods.get("softcap"), mods.get("sinks"), mods.get("window"))
    with pytest.raises(RuntimeError, match=f"segment_attention_backward: {message}"):
        torch.ops.offload.segment_attention_backward(*args)
