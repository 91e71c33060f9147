"""attention_block's per-head norms of q and k (Qwen3's q_norm and k_norm): output and every gradient against
transformers' Qwen3 arithmetic in plain torch, with head groups and segments, gradcheck, opcheck, reduced
precision, gradients that are not needed, the Meta kernel, torch.compile, errors."""

import pytest
import torch
import torch.nn.functional as F
from op_recording import RecordBackwardMask
from test_attention_block import SEGMENTS, make_inputs, relative_error, segment_mask
from torch.testing._internal.optests import opcheck
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import torch_offload

pytestmark = pytest.mark.torch_range

EPS = 1e-5
NAMES = ("x", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "q_norm", "k_norm")


def rms_norm(t, weight):
    """Qwen3RMSNorm's arithmetic (test_rms_norm_is_transformers_qwen3_rms_norm), in float64 for float64 tensors,
    which the module itself would round to float32."""
    wide = t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + EPS)).to(t.dtype)


def reference(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, q_norm, k_norm, scale=None, segment_ids=None):
    """What Qwen3's attention module computes, as transformers writes it; with segment_ids, under their dense mask
    (a query with no key gets 0, as from the op)."""
    batch, tokens, _ = x.shape
    head_dim = cos.shape[-1]
    q, k, v = (F.linear(x, w, b).view(batch, tokens, -1, head_dim) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
    q = q if q_norm is None else rms_norm(q, q_norm)
    k = k if k_norm is None else rms_norm(k, k_norm)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v = v.transpose(1, 2)
    if segment_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = segment_mask(segment_ids)
        has_keys = mask.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_keys, scale=scale, enable_gqa=True)
        out = out * has_keys
    return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), w_o, b_o)


def make_norm_inputs(norms="both", dtype=torch.float32, **shape):
    """make_inputs' 11 tensors, then q_norm and k_norm [head_dim] (random weights near 1, requiring grad) or None."""
    inputs = make_inputs(dtype=dtype, **shape)
    head_dim = inputs[5].shape[-1]
    generator = torch.Generator().manual_seed(7)

    def weight(wanted):
        if not wanted:
            return None
        return (1 + 0.5 * torch.randn(head_dim, generator=generator, dtype=torch.float64)).to(dtype).requires_grad_()

    return [*inputs, weight(norms in ("q", "both")), weight(norms in ("k", "both"))]


def call(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, q_norm, k_norm, scale=None, segment_ids=None):
    return torch_offload.attention_block(
        x,
        w_q,
        w_k,
        w_v,
        w_o,
        cos,
        sin,
        b_q=b_q,
        b_k=b_k,
        b_v=b_v,
        b_o=b_o,
        scale=scale,
        segment_ids=segment_ids,
        q_norm=q_norm,
        k_norm=k_norm,
        norm_eps=EPS,
    )


def leaves_of(inputs):
    return [(name, t) for name, t in zip(NAMES, inputs[:5] + inputs[7:]) if t is not None and t.requires_grad]


def output_and_grads(fn, inputs, grad_out=None):
    out = fn(*inputs)
    names, leaves = zip(*leaves_of(inputs))
    grad_out = torch.randn_like(out, generator=torch.Generator().manual_seed(1)) if grad_out is None else grad_out
    return out.detach(), dict(zip(names, torch.autograd.grad(out, leaves, grad_out)))


def assert_matches(got, want, **tolerances):
    torch.testing.assert_close(got[0], want[0], **tolerances)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **tolerances, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_is_transformers_qwen3_rms_norm(dtype):
    module = Qwen3RMSNorm(8, eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(8))
    t = (torch.randn(5, 3, 8) * 4).to(dtype)
    assert torch.equal(rms_norm(t, module.weight), module(t))


SHAPES = {
    "gqa": dict(heads=4, kv_heads=2),
    "mha_biases": dict(heads=4, kv_heads=4, bias=True),
    "one_kv_head": dict(heads=4, kv_heads=1, head_dim=8),
    "one_token": dict(tokens=1),
}


@pytest.mark.parametrize("norms", ["q", "k", "both"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_qwen3_attention_float32(shape, norms):
    inputs = make_norm_inputs(norms, **SHAPES[shape])
    got = output_and_grads(call, inputs)
    assert_matches(got, output_and_grads(reference, inputs), rtol=1e-5, atol=1e-6)
    # The norms change the result (a lone token's output is its value, whatever q and k are): a test of them that
    # would pass without them proves nothing.
    if inputs[0].shape[1] > 1:
        plain = [*inputs[:11], None, None]
        assert not torch.allclose(got[0], output_and_grads(reference, plain)[0], rtol=1e-3, atol=1e-3)


def test_head_groups_and_segments_match_float64():
    # 2048 tokens of 64-wide heads: each key/value head is a group of its own (test_attention_block's budget).
    inputs = make_norm_inputs(batch=1, tokens=2048, h=32, heads=4, kv_heads=2, head_dim=64, bias=True)
    inputs = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    segments = torch.arange(2048).div(700, rounding_mode="floor")[None]
    got = output_and_grads(lambda *a: call(*a, segment_ids=segments), inputs)
    assert_matches(got, output_and_grads(lambda *a: reference(*a, segment_ids=segments), inputs))


def test_one_long_sequence_with_its_queries_in_chunks_matches_float64():
    # 4100 tokens in one row: backward takes the queries' side in chunks of 2048 rows (test_attention_block's).
    inputs = make_norm_inputs(batch=1, tokens=4100, h=16, heads=4, kv_heads=2, head_dim=8, bias=True)
    inputs = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    assert_matches(output_and_grads(call, inputs), output_and_grads(reference, inputs))


def test_packed_and_padded_rows_match_float64():
    inputs = make_norm_inputs(batch=3, tokens=13, dtype=torch.float64, bias=True)
    got = output_and_grads(lambda *a: call(*a, scale=0.3, segment_ids=SEGMENTS), inputs)
    assert_matches(got, output_and_grads(lambda *a: reference(*a, scale=0.3, segment_ids=SEGMENTS), inputs))


def test_gradcheck_float64():
    inputs = make_norm_inputs(batch=2, tokens=6, h=6, heads=4, kv_heads=2, head_dim=4, bias=True, dtype=torch.float64)
    cos, sin = inputs[5:7]
    segments = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, -1, -1]])

    def fn(x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, q_norm, k_norm):
        return call(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, q_norm, k_norm, 0.4, segments)

    assert torch.autograd.gradcheck(fn, [t for _, t in leaves_of(inputs)])


@pytest.mark.parametrize("norms", ["k", "both"])
def test_opcheck(norms):
    inputs = make_norm_inputs(norms, batch=3, tokens=13, bias=True)
    detached = [t.detach() if t is not None else None for t in inputs]
    tensors, (q_norm, k_norm) = inputs[:11], inputs[11:]
    opcheck(
        torch.ops.offload.attention_block.default,
        (*tensors, None, SEGMENTS),
        dict(q_norm=q_norm, k_norm=k_norm, norm_eps=EPS),
    )
    grad_out = torch.randn(3, 13, 16)
    for mask in ([True] * 11, [False] * 9 + [True, True]):
        opcheck(
            torch.ops.offload.attention_block_backward.default,
            (grad_out, *detached[:11], None, SEGMENTS, mask),
            dict(q_norm=detached[11], k_norm=detached[12], norm_eps=EPS),
        )


def assert_reduced_precision_as_close_to_float64_as_eager(make, reference, dtype):
    """The op in dtype on make's inputs against reference in float64: at most twice eager's relative error (or 1e-2),
    the output and every gradient."""
    inputs = make(tokens=40, h=32, heads=4, kv_heads=2, head_dim=8, bias=True, dtype=dtype)
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    grad_out = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = output_and_grads(reference, inputs64, grad_out.double())
    eager = output_and_grads(reference, inputs, grad_out)
    got = output_and_grads(call, inputs, grad_out)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1].values())
    assert relative_error(got[0], want[0]) <= max(2 * relative_error(eager[0], want[0]), 1e-2)
    for name in want[1]:
        error, eager_error = relative_error(got[1][name], want[1][name]), relative_error(eager[1][name], want[1][name])
        assert error <= max(2 * eager_error, 1e-2), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    assert_reduced_precision_as_close_to_float64_as_eager(make_norm_inputs, reference, dtype)


def assert_only_the_gradients_needed_are_computed(make, reference, expected_mask):
    """The op's backward asked for exactly expected_mask's gradients (the leaves make gives, requiring grad where the
    mask says), and those gradients are reference's."""
    inputs = make(bias=True)
    for (_, t), wanted in zip(leaves_of(inputs), expected_mask):
        t.requires_grad_(wanted)
    with RecordBackwardMask(torch.ops.offload.attention_block_backward.default) as mode:
        got = output_and_grads(call, inputs)
    assert mode.masks == [expected_mask]
    assert_matches(got, output_and_grads(reference, inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "expected_mask",
    [[True] * 11, [False] * 9 + [True, True], [True] * 9 + [False, False], [False] * 9 + [True, False]],
    ids=["all", "norms_only", "frozen_norms", "q_norm_only"],
)
def test_gradients_not_needed_are_not_computed(expected_mask):
    assert_only_the_gradients_needed_are_computed(make_norm_inputs, reference, expected_mask)


def test_meta_tensors_give_shapes_only():
    inputs = [t.detach().to("meta") if t is not None else None for t in make_norm_inputs("k", bias=True)]
    assert call(*inputs).shape == (2, 7, 16)
    mask = [False] * 9 + [True, True]
    grads = torch.ops.offload.attention_block_backward(
        torch.empty(2, 7, 16, device="meta"), *inputs[:11], None, None, mask, None, *inputs[11:], EPS
    )
    assert [g.shape if g is not None else None for g in grads] == [None] * 10 + [(4,)]


class NormedAttention(torch.nn.Module):
    """The op with q and k norms per head, or with whole_rows over each token's whole projection (OLMo 2's)."""

    def __init__(self, h=16, heads=4, kv_heads=2, head_dim=4, whole_rows=False):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(h, n * head_dim, bias=False) for n in (heads, kv_heads, kv_heads))
        self.o = torch.nn.Linear(heads * head_dim, h, bias=False)
        widths = (heads * head_dim, kv_heads * head_dim) if whole_rows else (head_dim, head_dim)
        self.q_norm, self.k_norm = (torch.nn.Parameter(1 + 0.3 * torch.randn(width)) for width in widths)
        self.head_dim = head_dim

    def forward(self, x):
        angles = (torch.arange(x.shape[1], dtype=torch.float32)[:, None] / 3).repeat(1, self.head_dim)[None]
        return torch_offload.attention_block(
            x,
            self.q.weight,
            self.k.weight,
            self.v.weight,
            self.o.weight,
            angles.cos(),
            angles.sin(),
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            norm_eps=EPS,
        )


@pytest.mark.parametrize("whole_rows", [False, True], ids=["per_head", "whole_rows"])
def test_compile_fullgraph_dynamic_matches_eager_over_changing_tokens(whole_rows):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = NormedAttention(whole_rows=whole_rows)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for tokens in (12, 29):
        x = torch.randn(2, tokens, 16, requires_grad=True)
        leaves = [x, *module.parameters()]
        want, got = module(x), compiled(x)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
            torch.testing.assert_close(g, w)


def bad_norm_cases():
    return [
        ("q_norm_shape", dict(q_norm=torch.ones(3)), r"q_norm has shape \[3\]; expected \[head_dim\]"),
        ("k_norm_dim", dict(k_norm=torch.ones(1, 4)), r"k_norm has shape \[1, 4\]; expected \[head_dim\]"),
        ("k_norm_dtype", dict(k_norm=torch.ones(4, dtype=torch.float64)), "k_norm has dtype Double; expected Float"),
        ("norm_eps_negative", dict(k_norm=torch.ones(4), norm_eps=-1.0), "norm_eps is -1; expected a finite value"),
        ("norm_eps_nan", dict(q_norm=torch.ones(4), norm_eps=float("nan")), "norm_eps is nan; expected a finite"),
    ]


@pytest.mark.parametrize("name, norm_arguments, message", bad_norm_cases(), ids=[c[0] for c in bad_norm_cases()])
def test_bad_norms_raise_errors_naming_the_argument(name, norm_arguments, message):
    tensors = [t.detach() if t is not None else None for t in make_inputs()]
    with pytest.raises(RuntimeError, match=f"attention_block: {message}"):
        torch.ops.offload.attention_block(*tensors, **norm_arguments)
    with pytest.raises(RuntimeError, match=f"attention_block_backward: {message}"):
        torch.ops.offload.attention_block_backward(
            torch.zeros(2, 7, 16), *tensors, None, None, [True] * 11, **norm_arguments
        )
