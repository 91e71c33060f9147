"""attention_block's norms over each token's whole q and k projections (OLMo 2's q_norm and k_norm, weights
[heads * head_dim] and [kv_heads * head_dim]): output and every gradient against transformers' OLMo 2 arithmetic
in plain torch, across head groups and chunks of rows, with segments, gradcheck, opcheck, reduced precision, the
Meta kernel and errors (torch.compile: test_attention_block_norms.py)."""

import pytest
import torch
import torch.nn.functional as F
from test_attention_block import SEGMENTS, make_inputs, segment_mask
from test_attention_block_norms import (
    EPS,
    SHAPES,
    assert_matches,
    assert_only_the_gradients_needed_are_computed,
    assert_reduced_precision_as_close_to_float64_as_eager,
    call,
    leaves_of,
    output_and_grads,
)
from torch.testing._internal.optests import opcheck
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

pytestmark = pytest.mark.torch_range


def rms_norm(t, weight):
    """Olmo2RMSNorm's arithmetic (test_rms_norm_is_transformers_olmo2_rms_norm): over the last dimension, in float32
    (float64 for float64), times weight, rounded once."""
    wide = t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    return (weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + EPS))).to(t.dtype)


def reference(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, q_norm, k_norm, scale=None, segment_ids=None):
    """What OLMo 2's attention module computes, as transformers writes it: the norms on the whole projections, then
    the heads; with segment_ids under their dense mask (a query with no key gets 0, as from the op)."""
    batch, tokens, _ = x.shape
    head_dim = cos.shape[-1]
    q, k, v = (F.linear(x, w, b) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
    q = q if q_norm is None else rms_norm(q, q_norm)
    k = k if k_norm is None else rms_norm(k, k_norm)
    q, k, v = (t.view(batch, tokens, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    mask = None if segment_ids is None else segment_mask(segment_ids)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        has_keys = mask.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_keys, scale=scale, enable_gqa=True)
        out = out * has_keys
    return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), w_o, b_o)


def make_row_norm_inputs(norms="both", dtype=torch.float32, **shape):
    """make_inputs' 11 tensors, then q_norm [heads * head_dim] and k_norm [kv_heads * head_dim] (random weights near
    1, requiring grad) or None."""
    inputs = make_inputs(dtype=dtype, **shape)
    generator = torch.Generator().manual_seed(7)

    def weight(wanted, width):
        if not wanted:
            return None
        return (1 + 0.5 * torch.randn(width, generator=generator, dtype=torch.float64)).to(dtype).requires_grad_()

    q_width, kv_width = inputs[1].shape[0], inputs[2].shape[0]
    return [*inputs, weight(norms in ("q", "both"), q_width), weight(norms in ("k", "both"), kv_width)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_is_transformers_olmo2_rms_norm(dtype):
    module = Olmo2RMSNorm(16, eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(16))
    t = (torch.randn(5, 3, 16) * 4).to(dtype)
    assert torch.equal(rms_norm(t, module.weight), module(t))


@pytest.mark.parametrize("norms", ["q", "k", "both"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_olmo2_attention_float32(shape, norms):
    inputs = make_row_norm_inputs(norms, **SHAPES[shape])
    got = output_and_grads(call, inputs)
    assert_matches(got, output_and_grads(reference, inputs), rtol=1e-5, atol=1e-6)
    # Over the whole row, not per head: the per-head norm of the same weights gives another result (where a norm
    # spans more than one head: one key/value head's row is one head).
    head_dim = inputs[5].shape[-1]
    if inputs[0].shape[1] > 1 and any(n is not None and n.shape[0] > head_dim for n in inputs[11:]):
        per_head = reference_per_head(inputs)
        assert not torch.allclose(got[0], per_head, rtol=1e-3, atol=1e-3)


def reference_per_head(inputs):
    """The same weights applied per head (each head's own scale): what the op must not compute here."""
    x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, q_norm, k_norm = inputs
    head_dim = cos.shape[-1]

    def per_head(t, weight):
        if weight is None:
            return t
        heads = t.unflatten(-1, (-1, head_dim))
        return (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + EPS)).flatten(-2) * weight

    q, k, v = (F.linear(x, w, b) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
    batch, tokens, _ = x.shape
    q, k, v = (
        t.view(batch, tokens, -1, head_dim).transpose(1, 2) for t in (per_head(q, q_norm), per_head(k, k_norm), v)
    )
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), w_o, b_o).detach()


def test_head_groups_and_chunks_of_rows_match_float64():
    # 2 x 1500 tokens of 64-wide heads: each key/value head is a group of its own, and the norms' passes take the rows
    # in chunks (q: 2 MiB over 256 x 4 bytes a row, 2048 rows, so a whole chunk and a partial one of 952 rows).
    inputs = make_row_norm_inputs(batch=2, tokens=1500, h=32, heads=4, kv_heads=2, head_dim=64, bias=True)
    inputs = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    segments = torch.arange(1500).div(700, rounding_mode="floor")[None].repeat(2, 1)
    got = output_and_grads(lambda *a: call(*a, segment_ids=segments), inputs)
    assert_matches(got, output_and_grads(lambda *a: reference(*a, segment_ids=segments), inputs))


def test_one_long_sequence_with_its_queries_in_chunks_matches_float64():
    # 4100 tokens in one row: backward takes the queries' side in chunks of 2048 rows (test_attention_block's), their
    # whole-row norms' gradients kept by rows for the pass after the groups.
    inputs = make_row_norm_inputs(batch=1, tokens=4100, h=16, heads=4, kv_heads=2, head_dim=8, bias=True)
    inputs = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    assert_matches(output_and_grads(call, inputs), output_and_grads(reference, inputs))


def test_packed_and_padded_rows_match_float64():
    inputs = make_row_norm_inputs(batch=3, tokens=13, dtype=torch.float64, bias=True)
    got = output_and_grads(lambda *a: call(*a, scale=0.3, segment_ids=SEGMENTS), inputs)
    assert_matches(got, output_and_grads(lambda *a: reference(*a, scale=0.3, segment_ids=SEGMENTS), inputs))


@pytest.mark.parametrize("norms", ["q", "both"])
def test_gradcheck_float64(norms):
    inputs = make_row_norm_inputs(
        norms, batch=2, tokens=6, h=6, heads=4, kv_heads=2, head_dim=4, bias=True, dtype=torch.float64
    )
    cos, sin = inputs[5:7]
    segments = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, -1, -1]])
    names = [name for name, _ in leaves_of(inputs)]

    def fn(*leaves):
        given = dict(zip(names, leaves))
        args = [given.get(name) for name in ("x", "w_q", "w_k", "w_v", "w_o")]
        rest = [given.get(name) for name in ("b_q", "b_k", "b_v", "b_o", "q_norm", "k_norm")]
        return call(*args, cos, sin, *rest, 0.4, segments)

    assert torch.autograd.gradcheck(fn, [t for _, t in leaves_of(inputs)])


def test_per_head_q_norm_and_whole_row_k_norm_together():
    inputs = make_row_norm_inputs("k", batch=3, tokens=13, dtype=torch.float64)
    head_dim = inputs[5].shape[-1]
    inputs[11] = (1 + 0.5 * torch.randn(head_dim, dtype=torch.float64)).requires_grad_()  # per head
    x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, q_norm, k_norm = inputs

    def mixed(*args):
        # The k norm over the row (reference), the q norm per head, as Qwen3's.
        batch, tokens, _ = x.shape
        heads_q = F.linear(args[0], args[1]).unflatten(-1, (-1, head_dim))
        wide = heads_q * torch.rsqrt(heads_q.pow(2).mean(-1, keepdim=True) + EPS)
        normed_q = (args[11] * wide).flatten(-2)
        k = rms_norm(F.linear(args[0], args[2]), args[12])
        q, k, v = (
            t.view(batch, tokens, -1, head_dim).transpose(1, 2) for t in (normed_q, k, F.linear(args[0], args[3]))
        )
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), args[4])

    got = output_and_grads(call, inputs)
    assert_matches(got, output_and_grads(mixed, inputs))


def test_opcheck():
    inputs = make_row_norm_inputs(batch=3, tokens=13, bias=True)
    detached = [t.detach() if t is not None else None for t in inputs]
    opcheck(
        torch.ops.offload.attention_block.default,
        (*inputs[:11], None, SEGMENTS),
        dict(q_norm=inputs[11], k_norm=inputs[12], norm_eps=EPS),
    )
    grad_out = torch.randn(3, 13, 16)
    for mask in ([True] * 11, [False] * 9 + [True, True], [True] + [False] * 10):
        opcheck(
            torch.ops.offload.attention_block_backward.default,
            (grad_out, *detached[:11], None, SEGMENTS, mask),
            dict(q_norm=detached[11], k_norm=detached[12], norm_eps=EPS),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    assert_reduced_precision_as_close_to_float64_as_eager(make_row_norm_inputs, reference, dtype)


@pytest.mark.parametrize(
    "expected_mask",
    [
        [False] * 9 + [True, True],
        [True] * 9 + [False, False],
        [False] * 9 + [True, False],
        [False] * 3 + [True] + [False] * 7,
    ],
    ids=["norms_only", "frozen_norms", "q_norm_only", "w_v_only"],
)
def test_gradients_not_needed_are_not_computed(expected_mask):
    assert_only_the_gradients_needed_are_computed(make_row_norm_inputs, reference, expected_mask)


def test_meta_tensors_give_shapes_only():
    inputs = [t.detach().to("meta") if t is not None else None for t in make_row_norm_inputs(bias=True)]
    assert call(*inputs).shape == (2, 7, 16)
    mask = [False] * 9 + [True, True]
    grads = torch.ops.offload.attention_block_backward(
        torch.empty(2, 7, 16, device="meta"), *inputs[:11], None, None, mask, None, *inputs[11:], EPS
    )
    assert [g.shape if g is not None else None for g in grads] == [None] * 9 + [(16,), (8,)]


@pytest.mark.parametrize(
    "norm_arguments, message",
    [
        (dict(q_norm=torch.ones(12)), r"q_norm has shape \[12\]; expected \[head_dim\] or \[heads \* head_dim\]"),
        (dict(k_norm=torch.ones(16)), r"k_norm has shape \[16\]; expected \[head_dim\] or \[kv_heads \* head_dim\]"),
    ],
    ids=["q_norm_width", "k_norm_width_of_q"],
)
def test_widths_other_than_a_head_or_the_projection_are_refused(norm_arguments, message):
    tensors = [t.detach() if t is not None else None for t in make_inputs()]  # 4 heads, 2 kv heads of 4
    with pytest.raises(RuntimeError, match=f"attention_block: {message}"):
        torch.ops.offload.attention_block(*tensors, **norm_arguments)
