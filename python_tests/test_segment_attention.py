"""segment_attention: attention_block's segment-aware attention alone (for attention modules it does not
replace), against SDPA with the dense mask the segments stand for: values, gradients, gradcheck, opcheck,
torch.compile, autocast, gradients not needed, errors."""

import pytest
import torch
import torch.nn.functional as F
from test_attention_block import SEGMENTS, segment_mask
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range


def make_qkv(batch=3, heads=2, tokens=13, head_dim=4, dtype=torch.float64, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, tokens, head_dim, generator=generator, dtype=dtype).to(device).requires_grad_()
        for _ in range(3)
    ]


def reference(q, k, v, segment_ids, scale=None):
    # A padding query with no key gets 0 from the op; SDPA with an all-False row gives NaN or 0
    # depending on the backend, so such rows are compared as 0.
    mask = segment_mask(segment_ids.cpu()).to(q.device)
    has_keys = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_keys, scale=scale)
    return out * has_keys


def output_and_grads(fn, leaves, grad_out):
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_sdpa_with_the_dense_mask_float64(scale):
    leaves = make_qkv()
    grad_out = torch.randn_like(leaves[0])
    got, got_grads = output_and_grads(
        lambda *a: torch_offload.segment_attention(*a, SEGMENTS, scale=scale), leaves, grad_out
    )
    want, want_grads = output_and_grads(lambda *a: reference(*a, SEGMENTS, scale=scale), leaves, grad_out)
    torch.testing.assert_close(got, want)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, msg=lambda m: f"d{name}: {m}")
    assert got[2, :, :3].abs().max() == 0  # left padding before any sequence: output 0


def test_one_sequence_per_row_is_causal_attention_and_int32_ids_are_the_same():
    q, k, v = make_qkv(dtype=torch.float32)
    whole = torch.zeros(3, 13, dtype=torch.int32)
    torch.testing.assert_close(
        torch_offload.segment_attention(q, k, v, whole), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    torch.testing.assert_close(
        torch_offload.segment_attention(q, k, v, SEGMENTS.int()), torch_offload.segment_attention(q, k, v, SEGMENTS)
    )


def test_query_key_value_as_transposed_views_like_transformers_gives():
    # transformers' attention modules pass [B, T, H, D] projections transposed to [B, H, T, D].
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in make_qkv())
    grad_out = torch.randn(3, 13, 2, 4, dtype=torch.float64).transpose(1, 2)
    got, got_grads = output_and_grads(lambda *a: torch_offload.segment_attention(*a, SEGMENTS), [q, k, v], grad_out)
    want, want_grads = output_and_grads(lambda *a: reference(*a, SEGMENTS), [q, k, v], grad_out)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_gradcheck_float64():
    segments = torch.tensor([[0, 0, 1, 1, 1, 2], [-1, 5, 5, 5, 5, -1]])
    leaves = make_qkv(batch=2, tokens=6, head_dim=3)
    assert torch.autograd.gradcheck(
        lambda q, k, v: torch_offload.segment_attention(q, k, v, segments, scale=0.4), leaves
    )


def test_opcheck():
    q, k, v = make_qkv(dtype=torch.float32)
    opcheck(torch.ops.offload.segment_attention.default, (q, k, v, SEGMENTS, None))
    grad_out = torch.randn_like(q)
    detached = [t.detach() for t in (q, k, v)]
    opcheck(torch.ops.offload.segment_attention_backward.default, (grad_out, *detached, SEGMENTS, 0.5, [True] * 4))


def test_compile_fullgraph_dynamic_over_changing_tokens_and_document_counts():
    torch._dynamo.reset()
    compiled = torch.compile(torch_offload.segment_attention, fullgraph=True, dynamic=True)
    for tokens, documents in ((12, 2), (29, 5), (40, 1)):
        leaves = make_qkv(batch=2, tokens=tokens, dtype=torch.float32, seed=tokens)
        position_ids = torch.arange(tokens).remainder(-(-tokens // documents))[None]
        segments = torch_offload.attention_block_segment_ids(position_ids=position_ids, batch=2)
        grad_out = torch.randn_like(leaves[0])
        got, got_grads = output_and_grads(lambda *a: compiled(*a, segments), leaves, grad_out)
        want, want_grads = output_and_grads(lambda *a: reference(*a, segments), leaves, grad_out)
        torch.testing.assert_close(got, want)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w)
    explanation = torch._dynamo.explain(torch_offload.segment_attention)(
        *make_qkv(batch=2, tokens=12), torch.zeros(2, 12, dtype=torch.long)
    )
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_autocast_runs_in_the_autocast_dtype_as_sdpa_does():
    q, k, v = make_qkv(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch_offload.segment_attention(q, k, v, SEGMENTS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch_offload.segment_attention(*(t.bfloat16() for t in (q, k, v)), SEGMENTS))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(q, k, v, SEGMENTS)  # SDPA under autocast, with the dense mask
    assert want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("needed", [(True, False, False), (False, True, True)])
def test_gradients_not_needed_are_not_computed(needed):
    q, k, v = make_qkv()
    for t, n in zip((q, k, v), needed):
        t.requires_grad_(n)
    out = torch_offload.segment_attention(q, k, v, SEGMENTS)
    out.sum().backward()
    assert [t.grad is not None for t in (q, k, v)] == list(needed)
    detached = [t.detach() for t in (q, k, v)]
    grads = torch.ops.offload.segment_attention_backward(torch.ones_like(q), *detached, SEGMENTS, None, [*needed, True])
    assert [g is not None for g in grads] == [*needed, False]  # no sinks: no gradient


def test_empty_batch():
    q, k, v = (torch.zeros(0, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = torch_offload.segment_attention(q, k, v, torch.zeros(0, 5, dtype=torch.long))
    assert out.shape == (0, 2, 5, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape


def bad_input_cases():
    q = torch.zeros(2, 3, 5, 4)
    ids = torch.zeros(2, 5, dtype=torch.long)
    return [
        ("query_dim", (q[0], q[0], q[0], ids), r"query has shape \[3, 5, 4\]; expected \[batch, heads, tokens"),
        ("query_dtype", (q.long(), q.long(), q.long(), ids), "query has dtype Long; expected a floating point"),
        ("key_shape", (q, q[:, :2], q, ids), r"key has shape \[2, 2, 5, 4\]; expected query's"),
        ("value_dtype", (q, q, q.double(), ids), "value has dtype Double; expected Float"),
        ("segment_ids_dtype", (q, q, q, ids.float()), "segment_ids has dtype Float; expected int64 or int32"),
        (
            "segment_ids_shape",
            (q, q, q, ids[:, :4]),
            r"segment_ids has shape \[2, 4\]; expected \[batch, tokens\] "
            r"= \[2, 5\]",
        ),
        ("segment_ids_device", (q, q, q, ids.to("meta")), "segment_ids is on meta but query is on cpu"),
        ("scale_nan", (q, q, q, ids, float("nan")), "scale is nan; expected a finite value > 0"),
        ("scale_negative", (q, q, q, ids, -0.5), r"scale is -0.5; expected a finite value > 0"),
    ]


@pytest.mark.parametrize("name, args, message", bad_input_cases(), ids=[c[0] for c in bad_input_cases()])
def test_bad_inputs_raise_errors_naming_the_argument(name, args, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.offload.segment_attention(*args)


def test_python_wrapper_names_a_missing_tensor_and_backward_checks_grad_out():
    q = torch.zeros(2, 3, 5, 4)
    with pytest.raises(RuntimeError, match="segment_attention: segment_ids is NoneType"):
        torch_offload.segment_attention(q, q, q, None)
    with pytest.raises(RuntimeError, match=r"segment_attention_backward: grad_out has shape \[2, 3, 5, 3\]"):
        torch.ops.offload.segment_attention_backward(
            torch.zeros(2, 3, 5, 3), q, q, q, torch.zeros(2, 5, dtype=torch.long), None, [True] * 4
        )


def test_the_eager_dropout_path_attends_per_run_as_the_op_does():
    # masking's SDPA-per-run path (attention dropout in eager training), run here with dropout 0 so that
    # it must give the op's values: the same runs, causal for sequences, padding over the sequence before it.
    from torch_offload.segment_sdpa import _attention_with_dropout_per_run

    q, k, v = make_qkv(dtype=torch.float32)
    module = torch.nn.Module()
    got, _ = _attention_with_dropout_per_run(module, q, k, v, SEGMENTS, dropout=0.0, scaling=0.3)
    torch.testing.assert_close(got, torch_offload.segment_attention(q, k, v, SEGMENTS, scale=0.3).transpose(1, 2))
