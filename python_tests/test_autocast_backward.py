"""Gradients asked for inside an autocast region (`loss.backward()` under `with torch.autocast(...)`, as many
training loops write it) are the gradients asked for outside it: the backward ops run in the dtypes their forward
chose. Before, autocast recast the formulas' own operations (CPU's matrix products to bf16, CUDA's sums to
float32) and attention_block's backward failed on mixed dtypes."""

import pytest
import torch
from test_attention_block import SEGMENTS, make_inputs
from test_segment_attention import make_qkv

import torch_offload

pytestmark = pytest.mark.torch_range


def attention_block_case(generator):
    x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o = make_inputs(
        batch=3, tokens=13, h=32, heads=4, kv_heads=2, head_dim=8, bias=True
    )
    leaves = [x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o]
    out = torch_offload.attention_block(
        x, w_q, w_k, w_v, w_o, cos, sin, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o, segment_ids=SEGMENTS
    )
    return out, leaves


def segment_attention_case(generator):
    leaves = make_qkv(heads=4, head_dim=8, dtype=torch.float32)
    sinks = torch.randn(4, generator=generator, requires_grad=True)
    return torch_offload.segment_attention(*leaves, SEGMENTS, softcap=20.0, sinks=sinks), [*leaves, sinks]


def tiled_mlp_case(generator):
    x = torch.randn(2, 24, 16, generator=generator, requires_grad=True)
    w_gate, w_up = (torch.randn(40, 16, generator=generator, requires_grad=True) for _ in range(2))
    w_down = torch.randn(16, 40, generator=generator, requires_grad=True)
    return torch_offload.tiled_mlp(x, w_gate, w_up, w_down, num_shards=3), [x, w_gate, w_up, w_down]


def linear_cross_entropy_case(generator):
    hidden = torch.randn(48, 16, generator=generator, requires_grad=True)
    weight = torch.randn(101, 16, generator=generator, requires_grad=True)
    target = torch.randint(0, 101, (48,), generator=generator)
    # Gradients in backward, so that its backward op runs (reduction "none" takes any upstream gradient).
    loss = torch_offload.linear_cross_entropy(hidden, weight, target, reduction="none", gradients_in_forward=False)
    return loss, [hidden, weight]


CASES = {
    "attention_block": attention_block_case,
    "segment_attention": segment_attention_case,
    "tiled_mlp": tiled_mlp_case,
    "linear_cross_entropy": linear_cross_entropy_case,
}


@pytest.mark.parametrize("forward_under_autocast", [False, True], ids=["float32_forward", "autocast_forward"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_gradients_inside_an_autocast_region_equal_those_outside(case, dtype, forward_under_autocast):
    generator = torch.Generator().manual_seed(0)
    with torch.autocast("cpu", dtype=dtype, enabled=forward_under_autocast):
        out, leaves = CASES[case](generator)
    grad_out = torch.randn(out.shape, generator=generator).to(out.dtype)
    outside = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    with torch.autocast("cpu", dtype=dtype):
        inside = torch.autograd.grad(out, leaves, grad_out)
    for index, (got, want) in enumerate(zip(inside, outside)):
        assert got.dtype == want.dtype == leaves[index].dtype, index
        assert torch.equal(got, want), f"gradient {index}: {(got - want).abs().max().item()}"
