"""attention_block: output and gradients against transformers' own attention arithmetic (projections,
apply_rotary_pos_emb, F.scaled_dot_product_attention) in plain torch, head groups, gradcheck, opcheck,
torch.compile, autocast, gradients that are not needed, errors."""

import pytest
import torch
import torch.nn.functional as F
from op_recording import RecordBackwardMask, peak_allocated_bytes
from torch.testing._internal.optests import opcheck
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import torch_offload

pytestmark = pytest.mark.torch_range

NAMES = ("x", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def reference(x, w_q, w_k, w_v, w_o, cos, sin, b_q=None, b_k=None, b_v=None, b_o=None, scale=None):
    """What a Llama-style attention module computes, written as transformers writes it."""
    batch, tokens, _ = x.shape
    head_dim = cos.shape[-1]
    q, k, v = (
        F.linear(x, w, b).view(batch, tokens, -1, head_dim).transpose(1, 2)
        for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))
    )
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), w_o, b_o)


def make_inputs(
    batch=2,
    tokens=7,
    h=16,
    heads=4,
    kv_heads=2,
    head_dim=4,
    bias=False,
    out_features=None,
    rotary_batch=1,
    dtype=torch.float32,
    seed=0,
):
    """(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o): the first five and the biases require grad."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*size, scale=1.0, grad=True):
        t = (torch.randn(*size, generator=generator, dtype=torch.float64) * scale).to(dtype)
        return t.requires_grad_(grad)

    out_features = out_features or h
    x = rand(batch, tokens, h)
    weights = [rand(rows, h, scale=h**-0.5) for rows in (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)]
    w_o = rand(out_features, heads * head_dim, scale=(heads * head_dim) ** -0.5)
    angles = rand(rotary_batch, tokens, head_dim // 2, scale=3.0, grad=False).repeat(1, 1, 2)
    biases = (
        [rand(n, scale=0.5) for n in (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim, out_features)]
        if bias
        else [None] * 4
    )
    return [x, *weights, w_o, angles.cos(), angles.sin(), *biases]


def call(x, w_q, w_k, w_v, w_o, cos, sin, b_q=None, b_k=None, b_v=None, b_o=None, scale=None, segment_ids=None):
    return torch_offload.attention_block(
        x, w_q, w_k, w_v, w_o, cos, sin, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o, scale=scale, segment_ids=segment_ids
    )


def leaves_of(inputs):
    return [t for t in inputs[:5] + inputs[7:] if t is not None]


def output_and_grads(fn, inputs, grad_out=None):
    out = fn(*inputs)
    leaves = leaves_of(inputs)
    grad_out = torch.randn_like(out, generator=torch.Generator().manual_seed(1)) if grad_out is None else grad_out
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


SHAPES = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=4, kv_heads=2),
    "one_kv_head": dict(heads=4, kv_heads=1, head_dim=8),
    "biases": dict(bias=True),
    "one_token": dict(tokens=1, bias=True),
    "odd_tokens": dict(tokens=33, head_dim=8),
    "per_sample_rotary": dict(rotary_batch=2),
    "wider_output": dict(out_features=24, bias=True),
    "batch_1": dict(batch=1, tokens=13),
}


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_transformers_attention_float32(shape, scale):
    inputs = make_inputs(**SHAPES[shape])
    got, got_grads = output_and_grads(lambda *a: call(*a, scale=scale), inputs)
    want, want_grads = output_and_grads(lambda *a: reference(*a, scale=scale), inputs)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = [n for n, t in zip(NAMES, inputs[:5] + inputs[7:]) if t is not None]
    for name, g, w in zip(names, got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def flash_attention_calls(fn):
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu")


def test_long_sequences_run_in_head_groups_and_still_match():
    # 4096 tokens of 2 query heads per key/value head (64 wide): one key/value head's tensors exceed
    # half the 16 MiB group budget, so each is a group of its own.
    inputs = make_inputs(batch=1, tokens=4096, h=32, heads=4, kv_heads=2, head_dim=64, bias=True)
    assert flash_attention_calls(lambda: call(*inputs)) == 2
    short = make_inputs(batch=1, tokens=64, h=32, heads=4, kv_heads=2, head_dim=64)
    assert flash_attention_calls(lambda: call(*short)) == 1
    got, got_grads = output_and_grads(call, inputs)
    want, want_grads = output_and_grads(reference, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Weight gradients sum over 4096 tokens in float32, in another order than eager's: compared as a whole.
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert relative_error(g, w) < 1e-5, name


BALANCED_SPLIT_SHAPES = {
    "one_head": dict(batch=1, heads=1, kv_heads=1),
    "three_sequences": dict(batch=3, heads=1, kv_heads=1),
    "three_query_heads_per_kv_head": dict(batch=1, heads=3, kv_heads=1),
    "three_sequences_of_three_heads_per_sample_rotary": dict(batch=3, heads=3, kv_heads=1, rotary_batch=3),
    "tokens_not_a_multiple_of_the_kernels_blocks": dict(batch=1, heads=1, kv_heads=1, tokens=1028),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", BALANCED_SPLIT_SHAPES)
def test_odd_batch_times_heads_at_long_sequences_runs_as_balanced_pieces_and_still_matches(shape, dtype):
    # An odd batch x heads of 1024 tokens or more is computed as pieces (five flash calls per forward:
    # the causal halves, and the cross block in 4 chunks of its queries) merged by log-sum-exp; in
    # float64 that must agree with eager to rounding, in float32 and bfloat16 be as close to float64 as
    # eager is.
    kwargs = dict(tokens=1024, h=32, head_dim=16, bias=True) | BALANCED_SPLIT_SHAPES[shape]
    inputs = make_inputs(**kwargs, dtype=dtype)
    assert flash_attention_calls(lambda: call(*inputs)) == 5
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    grad_out = torch.randn(kwargs["batch"], kwargs["tokens"], 32, generator=torch.Generator().manual_seed(3))
    want, want_grads = output_and_grads(reference, inputs64, grad_out.double())
    got, got_grads = output_and_grads(call, inputs, grad_out.to(dtype))
    if dtype == torch.float64:
        assert relative_error(got, want) < 1e-12
        for name, g, w in zip(NAMES, got_grads, want_grads):
            assert relative_error(g, w) < 1e-12, name
    else:
        eager, eager_grads = output_and_grads(reference, inputs, grad_out.to(dtype))
        assert relative_error(got, want) <= max(2 * relative_error(eager, want), 1e-2)
        for name, g, e, w in zip(NAMES, got_grads, eager_grads, want_grads):
            assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-2), name


def test_balanced_pieces_hold_little_more_than_one_flash_call():
    # The pieces' temporaries are a fraction of a [tokens, head_dim] tensor ("unit"): sequence-parallel
    # ranks attend one head over the whole rows. Forward holds the output and a chunk's temporaries
    # (1.7 units; 3.1 when the cross block was one call); backward, which recomputes the output, one
    # flash backward's own peak, the output and a chunk's (1.8 units over the flash call; 4.0 before).
    tokens, head_dim = 8192, 64
    q, k, v, grad_out = torch.randn(4, 1, 1, tokens, head_dim, generator=torch.Generator().manual_seed(0)).unbind(0)
    segment_ids = torch.zeros(1, tokens, dtype=torch.long)
    unit = q.nbytes
    forward = peak_allocated_bytes(lambda: torch.ops.offload.segment_attention(q, k, v, segment_ids))
    assert forward <= 2 * unit
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    one_call = peak_allocated_bytes(
        lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, logsumexp, 0.0, True
        )
    )
    backward = peak_allocated_bytes(
        lambda: torch.ops.offload.segment_attention_backward(grad_out, q, k, v, segment_ids, None, [True] * 4)
    )
    assert backward <= one_call + 2 * unit


QUERY_CHUNK_SHAPES = {
    "mha": dict(heads=2, kv_heads=2),
    "gqa_biases": dict(heads=4, kv_heads=2, bias=True),
    "one_head_and_a_short_last_chunk": dict(heads=1, kv_heads=1, tokens=4100),
}


@pytest.mark.parametrize(
    "shape, dtype",
    [(shape, torch.float64) for shape in QUERY_CHUNK_SHAPES] + [("gqa_biases", torch.float32), ("mha", torch.bfloat16)],
    ids=str,
)
def test_one_long_sequence_backward_takes_its_queries_in_chunks_and_still_matches(shape, dtype):
    # One sequence of 4096 tokens or more: backward takes the queries' side in chunks of 2048 rows (4100: a last
    # chunk of 4), each against its own keys and every key before it. Float64 agrees with eager to rounding, float32
    # and bfloat16 are as close to float64 as eager is.
    kwargs = dict(batch=1, tokens=4096, h=16, head_dim=8) | QUERY_CHUNK_SHAPES[shape]
    inputs = make_inputs(**kwargs, dtype=dtype)
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    grad_out = torch.randn(1, kwargs["tokens"], 16, generator=torch.Generator().manual_seed(3))
    want, want_grads = output_and_grads(reference, inputs64, grad_out.double())
    got, got_grads = output_and_grads(call, inputs, grad_out.to(dtype))
    if dtype == torch.float64:
        for name, g, w in zip(NAMES, got_grads, want_grads):
            assert relative_error(g, w) < 1e-12, name
    else:
        _, eager_grads = output_and_grads(reference, inputs, grad_out.to(dtype))
        for name, g, e, w in zip(NAMES, got_grads, eager_grads, want_grads):
            assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-2), name


def test_one_long_sequence_backward_holds_a_chunk_of_its_queries_side():
    # One 64-wide head over 16384 tokens (a "unit" is one [tokens, 64] float32 tensor): besides x's gradient (1 unit
    # at this width) backward holds the keys, values and their gradients whole (4 units), and a chunk of the queries,
    # the output and their gradients (2048 rows, an eighth of a unit each): 6.8 units in all. With the queries' side
    # whole it held 12.5.
    tokens = 16384
    x, w_q, w_k, w_v, w_o, cos, sin, *_ = make_inputs(batch=1, tokens=tokens, h=64, heads=1, kv_heads=1, head_dim=64)
    x, w_q, w_k, w_v, w_o = (t.detach() for t in (x, w_q, w_k, w_v, w_o))
    grad_out = torch.randn_like(x)
    unit = x.nbytes
    peak = peak_allocated_bytes(
        lambda: torch.ops.offload.attention_block_backward(
            grad_out, x, w_q, w_k, w_v, w_o, cos, sin, None, None, None, None, None, None, [True] * 5 + [False] * 6
        )
    )
    assert peak <= 8 * unit


def test_even_batch_times_heads_and_short_sequences_run_in_one_flash_call():
    for kwargs in (
        dict(batch=2, heads=1, kv_heads=1, tokens=1024),
        dict(batch=1, heads=1, kv_heads=1, tokens=1020),
        dict(batch=1, heads=1, kv_heads=1, tokens=1026),
    ):
        inputs = make_inputs(h=32, head_dim=16, **kwargs)
        assert flash_attention_calls(lambda: call(*inputs)) == 1, kwargs


def test_gradcheck_float64():
    inputs = make_inputs(
        batch=2, tokens=5, h=6, heads=4, kv_heads=2, head_dim=4, bias=True, rotary_batch=2, dtype=torch.float64
    )
    leaves = leaves_of(inputs)
    cos, sin = inputs[5:7]

    def fn(x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o):
        return call(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale=0.4)

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    inputs = make_inputs(tokens=40, h=32, heads=4, kv_heads=2, head_dim=8, bias=True, dtype=dtype)
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    grad_out = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    want, want_grads = output_and_grads(reference, inputs64, grad_out.double())
    eager, eager_grads = output_and_grads(reference, inputs, grad_out)
    got, got_grads = output_and_grads(call, inputs, grad_out)
    assert got.dtype == dtype and all(g.dtype == dtype for g in got_grads)
    assert relative_error(got, want) <= max(2 * relative_error(eager, want), 1e-2)
    for name, g, e, w in zip(NAMES, got_grads, eager_grads, want_grads):
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-2), name


def test_autocast_is_as_close_to_float32_as_the_module_under_autocast():
    inputs = make_inputs(tokens=40, h=32, heads=4, kv_heads=2, head_dim=8, bias=True)
    want = reference(*inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = call(*inputs)
        eager = reference(*inputs)  # as transformers runs the module under autocast
    assert got.dtype == torch.bfloat16
    assert relative_error(got, want) <= max(2 * relative_error(eager, want), 1e-2)


@pytest.mark.parametrize(
    "trainable, expected_mask",
    [
        ("all", [True] * 9 + [False] * 2),  # no norms given
        ("x", [True] + [False] * 10),
        ("weights", [False] + [True] * 8 + [False] * 2),
        ("w_o", [False, False, False, False, True, False, False, False, True, False, False]),
    ],
    ids=["all", "x_only", "frozen_input", "output_projection_only"],
)
def test_gradients_not_needed_are_not_computed(trainable, expected_mask):
    inputs = make_inputs(bias=True)
    for name, t in zip(NAMES, inputs[:5] + inputs[7:]):
        t.requires_grad_(
            trainable == "all"
            or name == trainable
            or (trainable == "weights" and name != "x")
            or (trainable == "w_o" and name == "b_o")
        )
    want = reference(*inputs)
    with RecordBackwardMask(torch.ops.offload.attention_block_backward.default) as mode:
        got = call(*inputs)
        leaves = [t for t in leaves_of(inputs) if t.requires_grad]
        got_grads = torch.autograd.grad(got.sum(), leaves)
    assert mode.masks == [expected_mask]
    for g, w in zip(got_grads, torch.autograd.grad(want.sum(), leaves)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


OPCHECK_CASES = {
    "gqa": dict(),
    "biases_and_scale": dict(bias=True, rotary_batch=2),
    "one_token": dict(tokens=1, heads=2, kv_heads=2),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    inputs = make_inputs(**OPCHECK_CASES[case])
    scale = 0.3 if OPCHECK_CASES[case].get("bias") else None
    opcheck(torch.ops.offload.attention_block.default, (*inputs, scale))
    grad_out = torch.randn(inputs[0].shape[0], inputs[0].shape[1], inputs[4].shape[0])
    detached = [t.detach() if t is not None else None for t in inputs]
    opcheck(torch.ops.offload.attention_block_backward.default, (grad_out, *detached, scale, None, [True] * 11))
    opcheck(
        torch.ops.offload.attention_block_backward.default,
        (grad_out, *detached, scale, None, [False, True] + [False] * 9),
    )


class Attention(torch.nn.Module):
    def __init__(self, h=16, heads=4, kv_heads=2, head_dim=4):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(h, n * head_dim) for n in (heads, kv_heads, kv_heads))
        self.o = torch.nn.Linear(heads * head_dim, h)
        self.head_dim = head_dim

    def rotary(self, tokens):
        angles = torch.arange(tokens, dtype=torch.float32)[:, None] / 10 ** torch.arange(self.head_dim // 2)
        angles = angles.repeat(1, 2)[None]
        return angles.cos(), angles.sin()

    def forward(self, x, segment_ids=None):
        cos, sin = self.rotary(x.shape[1])
        return torch_offload.attention_block(
            x,
            self.q.weight,
            self.k.weight,
            self.v.weight,
            self.o.weight,
            cos,
            sin,
            b_q=self.q.bias,
            b_k=self.k.bias,
            b_v=self.v.bias,
            b_o=self.o.bias,
            segment_ids=segment_ids,
        )


def test_compile_fullgraph_dynamic_matches_eager_over_changing_tokens():
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = Attention()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for tokens in (12, 29, 40):
        x = torch.randn(2, tokens, 16, requires_grad=True)
        leaves = [x, *module.parameters()]
        want = module(x)
        got = compiled(x)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
            torch.testing.assert_close(g, w)
    explanation = torch._dynamo.explain(module)(torch.randn(2, 12, 16))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_meta_tensors_give_shapes_only():
    inputs = [t.detach().to("meta") if t is not None else None for t in make_inputs(out_features=24, bias=True)]
    assert call(*inputs).shape == (2, 7, 24)
    grads = torch.ops.offload.attention_block_backward(
        torch.empty(2, 7, 24, device="meta"),
        *inputs,
        None,
        None,
        [True, False, True, False, True, True, False, True, False, True, True],
    )
    want = [
        t.shape if m else None
        for t, m in zip(inputs[:5] + inputs[7:], [True, False, True, False, True, True, False, True, False])
    ] + [None, None]  # no norms given
    assert [g.shape if g is not None else None for g in grads] == want


def bad_input_cases():
    good = dict(zip(("x", "w_q", "w_k", "w_v", "w_o", "cos", "sin"), [t.detach() for t in make_inputs()[:7]]))
    x, w_q, w_k, cos = good["x"], good["w_q"], good["w_k"], good["cos"]
    return [
        ("x_dim", dict(good, x=x[0]), r"x has shape \[7, 16\]; expected \[batch, tokens, h\]"),
        ("x_dtype", dict(good, x=x.long()), "x has dtype Long; expected float32, float64, bfloat16 or float16"),
        ("w_q_width", dict(good, w_q=w_q[:, :8]), r"w_q has shape \[16, 8\]; expected \[heads \* head_dim, h\]"),
        ("w_q_rows", dict(good, w_q=w_q[:14]), "w_q has 14 rows; expected a multiple > 0 of the head dimension 4"),
        ("heads", dict(good, w_q=w_q[:12]), "w_q has 3 heads and w_k 2; the query heads must be a multiple"),
        ("w_v_shape", dict(good, w_v=w_k[:4]), r"w_v has shape \[4, 16\]; expected w_k's shape"),
        ("w_o_shape", dict(good, w_o=good["w_o"][:, :8]), r"w_o has shape \[16, 8\]; expected \[out_features, heads"),
        ("w_k_dtype", dict(good, w_k=w_k.double()), "w_k has dtype Double; expected Float"),
        (
            "cos_odd",
            dict(good, cos=cos[..., :3], sin=good["sin"][..., :3]),
            r"cos has shape \[1, 7, 3\]; its last dimension is the head dimension, which must be even",
        ),
        ("cos_tokens", dict(good, cos=cos[:, :5]), r"cos has shape \[1, 5, 4\]; expected \[1 or batch, tokens"),
        ("cos_batch", dict(good, cos=cos.expand(3, -1, -1)), r"cos has shape \[3, 7, 4\]; expected \[1 or batch"),
        ("sin_shape", dict(good, sin=good["sin"][:, :6]), r"sin has shape \[1, 6, 4\]; expected cos's shape"),
        ("b_q_shape", dict(good, b_q=torch.zeros(3)), r"b_q has shape \[3\]; expected \[heads \* head_dim\]"),
        ("b_o_dtype", dict(good, b_o=torch.zeros(16, dtype=torch.half)), "b_o has dtype Half; expected Float"),
        ("scale", dict(good, scale=-1.0), "scale is -1; expected a finite value > 0"),
        ("segment_ids_dtype", dict(good, segment_ids=torch.zeros(2, 7)), "segment_ids has dtype Float; expected int64"),
        (
            "segment_ids_shape",
            dict(good, segment_ids=torch.zeros(2, 6, dtype=torch.long)),
            r"segment_ids has shape \[2, 6\]; expected \[batch, tokens\] = \[2, 7\]",
        ),
        (
            "segment_ids_dim",
            dict(good, segment_ids=torch.zeros(14, dtype=torch.long)),
            r"segment_ids has shape \[14\]; expected \[batch, tokens\]",
        ),
        ("w_o_missing", dict(good, w_o=None), "w_o"),
    ]


@pytest.mark.parametrize("name, kwargs, message", bad_input_cases(), ids=[c[0] for c in bad_input_cases()])
def test_bad_inputs_raise_errors_naming_the_argument(name, kwargs, message):
    with pytest.raises(RuntimeError, match=f"attention_block: {message}"):
        torch_offload.attention_block(**kwargs)
    if name == "w_o_missing":
        return
    # The backward op checks the same.
    args = [kwargs[n] for n in ("x", "w_q", "w_k", "w_v", "w_o", "cos", "sin")]
    args += [kwargs.get(n) for n in ("b_q", "b_k", "b_v", "b_o", "scale", "segment_ids")] + [[True] * 11]
    with pytest.raises(RuntimeError, match=f"attention_block_backward: {message}"):
        torch.ops.offload.attention_block_backward(torch.zeros(2, 7, 16), *args)


def test_rotary_tables_that_require_grad_and_bad_grad_out_are_refused():
    inputs = make_inputs()
    inputs[5].requires_grad_()
    with pytest.raises(RuntimeError, match="attention_block: cos requires grad; the op computes no gradient"):
        call(*inputs)
    inputs[5].requires_grad_(False)
    detached = [t.detach() if t is not None else None for t in inputs]
    with pytest.raises(RuntimeError, match=r"attention_block_backward: grad_out has shape \[2, 7, 15\]"):
        torch.ops.offload.attention_block_backward(torch.zeros(2, 7, 15), *detached, None, None, [True] * 11)


def segment_mask(segment_ids):
    """The segments as a dense [batch, 1, T, T] boolean mask: a token of a non-negative run sees the
    earlier tokens of its run; a padding token (negative id) sees all of the nearest non-negative run
    before it, or nothing (SDPA then gives 0, as the op)."""
    tokens = segment_ids.shape[1]
    run = torch.cat(
        [torch.zeros_like(segment_ids[:, :1]), (segment_ids[:, 1:] != segment_ids[:, :-1]).long()], 1
    ).cumsum(1)
    sequence = segment_ids >= 0
    # The run whose tokens each token sees: its own, or for padding the last sequence run before it.
    seen = torch.where(sequence, run, -1).cummax(1).values
    mask = (seen[:, :, None] == run[:, None, :]) & sequence[:, None, :]
    return (mask & torch.ones(tokens, tokens, dtype=torch.bool, device=segment_ids.device).tril())[:, None]


def segment_reference(
    x, w_q, w_k, w_v, w_o, cos, sin, b_q=None, b_k=None, b_v=None, b_o=None, scale=None, segment_ids=None
):
    """reference() with segment_mask(segment_ids). A query with no key gets 0, as from the op (SDPA gives NaN
    or 0 for an all-False mask row, depending on the backend)."""
    batch, tokens, _ = x.shape
    head_dim = cos.shape[-1]
    q, k, v = (
        F.linear(x, w, b).view(batch, tokens, -1, head_dim).transpose(1, 2)
        for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))
    )
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    mask = segment_mask(segment_ids)
    has_keys = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_keys, scale=scale, enable_gqa=True) * has_keys
    return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), w_o, b_o)


# Row 0: three packed documents, an id repeated after another (each run is its own segment);
# row 1: real tokens, then right padding (masked: negative ids); row 2: left padding, then two documents.
SEGMENTS = torch.tensor([[0] * 5 + [1] * 4 + [0] * 4, [0] * 10 + [-1] * 3, [-1] * 3 + [1] * 6 + [2] * 4])


@pytest.mark.parametrize("shape", ["gqa", "biases", "per_sample_rotary"])
def test_segments_match_a_dense_masked_attention(shape):
    kwargs = dict(SHAPES[shape], rotary_batch=3) if shape == "per_sample_rotary" else SHAPES[shape]
    inputs = make_inputs(batch=3, tokens=13, dtype=torch.float64, **kwargs)
    got, got_grads = output_and_grads(lambda *a: call(*a, segment_ids=SEGMENTS), inputs)
    want, want_grads = output_and_grads(lambda *a: segment_reference(*a, segment_ids=SEGMENTS), inputs)
    torch.testing.assert_close(got, want)
    for name, g, w in zip(NAMES, got_grads, want_grads):
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")
    # One segment per row is the unsegmented op, and int32 ids are the same ids.
    one_each = torch.zeros(3, 13, dtype=torch.int32)
    torch.testing.assert_close(call(*inputs, segment_ids=one_each), call(*inputs))
    torch.testing.assert_close(call(*inputs, segment_ids=SEGMENTS.int()), got)


def test_segments_gradcheck_float64():
    inputs = make_inputs(batch=2, tokens=6, h=6, heads=4, kv_heads=2, head_dim=4, bias=True, dtype=torch.float64)
    leaves = leaves_of(inputs)
    cos, sin = inputs[5:7]
    segments = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 7, 7]])

    def fn(x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o):
        return call(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale=0.4, segment_ids=segments)

    assert torch.autograd.gradcheck(fn, leaves)


def test_segments_opcheck():
    inputs = make_inputs(batch=3, tokens=13, bias=True)
    opcheck(torch.ops.offload.attention_block.default, (*inputs, None, SEGMENTS))
    grad_out = torch.randn(3, 13, 16)
    detached = [t.detach() if t is not None else None for t in inputs]
    opcheck(torch.ops.offload.attention_block_backward.default, (grad_out, *detached, None, SEGMENTS, [True] * 11))


def test_long_segments_run_as_balanced_pieces_and_still_match():
    # One head, two documents of 1024 tokens: each segment's call is an odd batch x heads at a
    # length the balanced split takes.
    inputs = make_inputs(batch=1, tokens=2048, h=16, heads=1, kv_heads=1, head_dim=16)
    segments = torch.arange(2048).div(1024, rounding_mode="floor")[None]
    got, got_grads = output_and_grads(lambda *a: call(*a, segment_ids=segments), inputs)
    want, want_grads = output_and_grads(lambda *a: segment_reference(*a, segment_ids=segments), inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert relative_error(g, w) < 1e-5, name


def test_segments_compile_fullgraph_dynamic_over_changing_tokens_and_document_counts():
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = Attention()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for tokens, documents in ((12, 2), (29, 5), (40, 1)):
        x = torch.randn(2, tokens, 16, requires_grad=True)
        position_ids = torch.arange(tokens).remainder(-(-tokens // documents))[None]
        segments = torch_offload.attention_block_segment_ids(position_ids=position_ids, batch=2)
        leaves = [x, *module.parameters()]
        want = module(x, segments)
        got = compiled(x, segments)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
            torch.testing.assert_close(g, w)
    explanation = torch._dynamo.explain(module)(torch.randn(2, 12, 16), torch.zeros(2, 12, dtype=torch.long))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_segment_ids_follow_transformers_packing_and_padding():
    from transformers.masking_utils import find_packed_sequence_indices

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    segments = torch_offload.attention_block_segment_ids(position_ids=position_ids)
    assert torch.equal(segments, find_packed_sequence_indices(position_ids))
    one_row = torch_offload.attention_block_segment_ids(position_ids=position_ids[:1], batch=3)
    assert one_row.shape == (3, 10) and torch.equal(one_row[2], segments[0])
    # A mask wins over position_ids, as in transformers: real tokens are one run, padding is masked.
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    padded = torch_offload.attention_block_segment_ids(position_ids=position_ids[:, :6], attention_mask=mask)
    assert padded.tolist() == [[1, 1, 1, 1, -1, -1], [-1, -1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert torch_offload.attention_block_segment_ids() is None
