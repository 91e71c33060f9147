"""Each attention forward once per training step: attention_block_attend's output and log-sum-exps handed to
attention_block (its forward the output projection alone, its backward no attention forward), against the op that
recomputes; and apply()'s layers checkpointed whole with an offload tier (the GPU default's plan, offload="cpu" on
a CPU) running each layer's attention forward kernel once per step, with the un-applied model's loss and gradients."""

import warnings

import pytest
import torch
from test_apply import assert_close_runs, make_model
from test_attention_block import SEGMENTS, make_inputs
from test_attention_block_norms import make_norm_inputs
from test_attention_block_row_norms import make_row_norm_inputs
from test_real_batches import packed, padded, step
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

NAMES = ("w_q", "w_k", "w_v", "w_o", "cos", "sin", "b_q", "b_k", "b_v", "b_o", "q_norm", "k_norm")
ATTEND_NAMES = ("w_q", "w_k", "w_v", "cos", "sin", "b_q", "b_k", "b_v", "q_norm", "k_norm")


def as_arguments(inputs):
    """make_inputs' (or make_norm_inputs') tensors as attention_block's keyword arguments."""
    return dict(zip(NAMES, inputs[1:]))


def recomputing(x, segment_ids=None, **arguments):
    return torch_offload.attention_block(x, **arguments, segment_ids=segment_ids)


def attending_once(x, segment_ids=None, **arguments):
    attend = {name: arguments[name] for name in ATTEND_NAMES if name in arguments}
    attention, logsumexp = torch_offload.attention_block_attend(x, **attend, segment_ids=segment_ids)
    assert not attention.requires_grad and not logsumexp.requires_grad  # not differentiable
    return torch_offload.attention_block(
        x, **arguments, segment_ids=segment_ids, attention=attention, logsumexp=logsumexp
    )


def output_and_grads(fn, inputs, segment_ids=None):
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    for t in leaves:
        t.grad = None
    out = fn(inputs[0], segment_ids, **as_arguments(inputs))
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype))
    return [out.detach()] + [t.grad.clone() for t in leaves]


CASES = {
    "gqa": (lambda: make_inputs(batch=3, tokens=13, dtype=torch.float64), None),
    "biases": (lambda: make_inputs(batch=3, tokens=13, bias=True, rotary_batch=3, dtype=torch.float64), None),
    "packed_and_padded": (lambda: make_inputs(batch=3, tokens=13, bias=True, dtype=torch.float64), SEGMENTS),
    "per_head_norms": (lambda: make_norm_inputs(batch=3, tokens=13, dtype=torch.float64), SEGMENTS),
    "whole_row_norms": (lambda: make_row_norm_inputs(batch=3, tokens=13, dtype=torch.float64), None),
    # One sequence of 4096 tokens or more: the CPU backward's query chunks (the recomputing op merges each chunk's
    # own keys and the keys before it; attending once hands each chunk the forward's output and log-sum-exps).
    "query_chunks": (
        lambda: make_inputs(
            batch=1, tokens=4100, h=16, heads=4, kv_heads=2, head_dim=8, bias=True, dtype=torch.float64
        ),
        None,
    ),
    # One head, odd batch x heads: the CPU kernels' balanced pieces, merged by their log-sum-exps.
    "balanced_pieces": (
        lambda: make_inputs(batch=1, tokens=1024, h=8, heads=1, kv_heads=1, head_dim=8, dtype=torch.float64),
        None,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_attending_once_gives_the_recomputing_ops_output_and_gradients(case):
    make, segment_ids = CASES[case]
    inputs = make()
    want = output_and_grads(recomputing, inputs, segment_ids)
    got = output_and_grads(attending_once, inputs, segment_ids)
    for w, g in zip(want, got):
        # The same kernels on the same numbers, but for the output projection's one GEMM over every head and the
        # query chunks' merged log-sum-exps.
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)


def test_gradcheck_float64():
    inputs = make_norm_inputs(batch=2, tokens=6, h=8, heads=2, kv_heads=1, head_dim=4, bias=True, dtype=torch.float64)
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [-1, 0, 0, 0, 0, 0]])

    def fn(*tensors):
        return attending_once(tensors[0], segment_ids, **as_arguments(tensors))

    assert torch.autograd.gradcheck(fn, tuple(inputs))


def test_opcheck():
    inputs = [t.detach() if t is not None else None for t in make_inputs(bias=True)]
    x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o = inputs
    attend = (x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v, 0.3, SEGMENTS[:2, :7])
    opcheck(torch.ops.offload.attention_block_attend.default, attend)
    attention, logsumexp = torch.ops.offload.attention_block_attend(*attend)
    saved = dict(attention=attention, logsumexp=logsumexp)
    trainable = [t.clone().requires_grad_(i not in (5, 6)) if t is not None else None for i, t in enumerate(inputs)]
    opcheck(torch.ops.offload.attention_block.default, (*trainable, 0.3, SEGMENTS[:2, :7]), saved)
    grad_out = torch.randn(x.shape[0], x.shape[1], w_o.shape[0])
    opcheck(
        torch.ops.offload.attention_block_backward.default,
        (grad_out, *inputs, 0.3, SEGMENTS[:2, :7], [True] * 11),
        saved,
    )


def test_meta_tensors_give_the_saved_shapes():
    inputs = [t.detach().to("meta") if t is not None else None for t in make_inputs(batch=2, tokens=7, heads=4)]
    x, w_q, w_k, w_v, _, cos, sin = inputs[:7]
    attention, logsumexp = torch.ops.offload.attention_block_attend(x, w_q, w_k, w_v, cos, sin)
    assert (attention.shape, attention.dtype) == ((2, 7, 16), torch.float32)
    assert (logsumexp.shape, logsumexp.dtype) == ((4, 2, 7), torch.float32)


def test_saved_attention_that_does_not_fit_is_refused_naming_the_argument():
    inputs = make_inputs()
    attention, logsumexp = torch_offload.attention_block_attend(inputs[0], *inputs[1:4], *inputs[5:7])
    arguments = as_arguments(inputs)
    cases = [
        (dict(attention=attention), "attention is given but logsumexp is None"),
        (dict(attention=attention[:, :-1], logsumexp=logsumexp), "attention has shape"),
        (dict(attention=attention, logsumexp=logsumexp.double()), "logsumexp has dtype"),
        (dict(attention=attention.clone().requires_grad_(), logsumexp=logsumexp), "or logsumexp requires grad"),
    ]
    for saved, message in cases:
        with pytest.raises(RuntimeError, match=message):
            torch_offload.attention_block(inputs[0], **arguments, **saved)


# attention_block's own forward kernel on the CPU, and its backward.
FORWARD = "aten::_scaled_dot_product_flash_attention_for_cpu"
BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"
BATCHES = {
    "one_sequence": lambda: dict(input_ids=(ids := torch.randint(3, 128, (1, 24))), labels=ids),
    "packed": packed,  # 4 documents: a kernel call each
    "right_padded": lambda: padded("right"),
    "left_padded": lambda: padded("left"),
}
# Per layer and pass: one per document or row's real tokens, one per padding run that sees keys (left padding: none).
KERNEL_CALLS = {"one_sequence": 1, "packed": 4, "right_padded": 5, "left_padded": 3}


def kernel_calls(model, batch):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = step(model, batch)
    names = [event.name for event in profile.events()]
    return result, names.count(FORWARD), names.count(BACKWARD)


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("batch", BATCHES)
def test_the_gpu_plan_on_a_cpu_runs_each_attention_forward_once_with_the_unapplied_results(name, batch):
    model, inputs = make_model(name).double(), BATCHES[batch]()
    want, own_forwards, _ = kernel_calls(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload="cpu" moves nothing from a CPU model: it says so
        handle = torch_offload.apply(model, offload="cpu", num_shards=2)
    assert handle.checkpointing == dict.fromkeys(handle.checkpointing, "layer") and handle.attention_blocks == 3
    got, forwards, backwards = kernel_calls(model, inputs)
    assert_close_runs(want, got)
    # Three layers: the forward kernel once per layer (the last one, kept on the device, too), as is the backward.
    assert forwards == backwards == 3 * KERNEL_CALLS[batch]
    handle.remove()
    assert kernel_calls(model, inputs)[1] == own_forwards  # the model's own SDPA again


def test_checkpointing_in_place_without_a_tier_keeps_recomputing_the_attention():
    # No tier: keeping each layer's attention output would double what the checkpoints hold on the device.
    model, inputs = make_model("llama").double(), BATCHES["one_sequence"]()
    want = step(model, inputs)
    handle = torch_offload.apply(model, offload=None, checkpoint="layer", num_shards=2)
    got, forwards, _ = kernel_calls(model, inputs)
    assert_close_runs(want, got)
    assert forwards == 3 * 3  # forward, the layer's recompute, the op's backward
    handle.remove()


def test_whole_layers_with_the_disk_tier_keep_their_attention_there_the_last_layer_too(tmp_path):
    # checkpoint="layer" with the disk tier: the layers offloaded to disk and the last one kept in memory (keep_last)
    # keep their attention's output through the tier alike.
    model, inputs = make_model("llama").double(), BATCHES["packed"]()
    want = step(model, inputs)
    handle = torch_offload.apply(
        model, offload="disk", checkpoint="layer", spill_directory=str(tmp_path), min_bytes=0, num_shards=2
    )
    assert [row["saved"] for row in handle.report()["layers"]] == ["disk", "in place"]
    packed_before = handle.stats()["packed_bytes"]
    got, forwards, _ = kernel_calls(model, inputs)
    assert_close_runs(want, got)
    assert forwards == 3 * KERNEL_CALLS["packed"]
    # To the file: the offloaded layers' inputs and every layer's attention output, [24, 32] float64 each (without
    # the attention outputs, 15,744 bytes in all).
    assert handle.stats()["packed_bytes"] - packed_before >= (2 + 3) * 24 * 32 * 8
    assert handle.stats()["live_entries"] == 0  # freed with the graph
    handle.remove()
