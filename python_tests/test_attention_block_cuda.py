"""attention_block on a GPU (PyTorch's flash attention kernels inside for bf16/fp16 on sm80/sm90, its
memory-efficient ones otherwise): against the same attention in eager torch and the CPU op. Skipped without a GPU."""

import pytest
import torch
from cuda_allocations import allocation_sizes
from test_attention_block import (
    NAMES,
    SEGMENTS,
    call,
    make_inputs,
    output_and_grads,
    reference,
    relative_error,
    segment_reference,
)
from test_attention_block_norms import call as norm_call
from test_attention_block_norms import make_norm_inputs
from test_attention_block_norms import output_and_grads as norm_output_and_grads
from test_attention_block_norms import reference as head_norm_reference
from test_attention_block_row_norms import make_row_norm_inputs
from test_attention_block_row_norms import reference as row_norm_reference
from test_segment_attention import make_qkv
from test_segment_attention import output_and_grads as qkv_output_and_grads
from test_segment_attention import reference as qkv_reference
from test_segment_attention_score_mods import MODS, PACKED
from test_segment_attention_score_mods import call as score_mod_call
from test_segment_attention_score_mods import inputs_for as score_mod_inputs
from test_segment_attention_score_mods import reference as score_mod_reference
from test_segment_attention_score_mods import run as score_mod_run
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NORMS = {
    "per_head": (make_norm_inputs, head_norm_reference),
    "whole_rows": (make_row_norm_inputs, row_norm_reference),
}


def to_cuda(inputs, dtype=None):
    return [t.detach().to("cuda", dtype).requires_grad_(t.requires_grad) if t is not None else None for t in inputs]


def gradient_error(got, want, scale):
    """relative_error, but against a hundredth of `scale` (the largest gradient's norm) where want is smaller: one
    token's w_q and w_k get a zero gradient, in float32 a few rounding errors that two kernels make differently (the
    first H200 run failed on it; the second passed)."""
    return ((got.double() - want.double()).norm() / max(want.double().norm(), 1e-2 * float(scale))).item()


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(bias=True, heads=4, kv_heads=1, head_dim=8),
        dict(tokens=1),
        dict(tokens=300, h=64, heads=8, kv_heads=4, head_dim=16, rotary_batch=2),
    ],
    ids=["gqa", "one_kv_head_biases", "one_token", "longer"],
)
def test_cuda_matches_eager_and_the_cpu_op_float32(shape):
    inputs = make_inputs(**shape)
    gpu = to_cuda(inputs)
    grad_out = torch.randn(*inputs[0].shape[:2], inputs[4].shape[0])
    got, got_grads = output_and_grads(call, gpu, grad_out.cuda())
    assert got.is_cuda
    want, want_grads = output_and_grads(reference, gpu, grad_out.cuda())
    cpu, cpu_grads = output_and_grads(call, inputs, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-4, atol=1e-5)
    scale = max(w.norm() for w in want_grads)
    for name, g, w, c in zip(NAMES, got_grads, want_grads, cpu_grads):
        assert gradient_error(g, w, scale) < 1e-4 and gradient_error(g.cpu(), c, scale) < 1e-4, name


def test_cuda_bf16_is_as_close_to_float32_as_eager():
    inputs = to_cuda(make_inputs(tokens=128, h=64, heads=8, kv_heads=2, head_dim=16, bias=True))
    low = to_cuda(inputs, torch.bfloat16)
    grad_out = torch.randn(2, 128, 64, device="cuda")
    want, want_grads = output_and_grads(reference, inputs, grad_out)
    eager, eager_grads = output_and_grads(reference, low, grad_out.bfloat16())
    got, got_grads = output_and_grads(call, low, grad_out.bfloat16())
    assert got.dtype == torch.bfloat16
    assert relative_error(got, want) <= max(2 * relative_error(eager, want), 1e-2)
    for name, g, e, w in zip(NAMES, got_grads, eager_grads, want_grads):
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-2), name


FLASH_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() in ((8, 0), (9, 0))


def attention_kernels_run(run):
    """The names of the CUDA kernels `run` launches whose name says which attention they are, once per launch."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    names = [event.name for event in profile.events()]
    return [name for name in names if "flash" in name.lower() or "fmha" in name.lower()]


@pytest.mark.skipif(not FLASH_GPU, reason="flash attention's kernels are built for sm80 and sm90")
@pytest.mark.parametrize("segmented", [False, True], ids=["whole_rows", "segments"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_low_precision_runs_flash_attention_both_ways_and_float32_the_memory_efficient_kernels(dtype, segmented):
    inputs = to_cuda(make_inputs(tokens=64, h=64, heads=4, kv_heads=2, head_dim=16), dtype)
    grad_out = torch.randn(*inputs[0].shape[:2], inputs[4].shape[0], device="cuda", dtype=dtype)
    runs_of_20 = torch.arange(64, device="cuda").div(20, rounding_mode="floor").expand(inputs[0].shape[0], -1)
    segment_ids = runs_of_20 if segmented else None
    kernels = attention_kernels_run(
        lambda: output_and_grads(lambda *a: call(*a, segment_ids=segment_ids), inputs, grad_out)
    )
    flash = {name for name in kernels if "flash" in name.lower()}
    if dtype == torch.float32:
        assert kernels and not flash, kernels
    else:  # forward and backward kernels both
        assert any("fwd" in name.lower() for name in flash) and any("bwd" in name.lower() for name in flash), kernels


# Documents of 2 to 20 tokens, padding after some (two adjacent padding runs seeing one document),
# and padding before any document (no keys: output 0): 10 runs see keys.
MANY_RUNS = torch.tensor(
    [
        [0] * 3 + [1] * 5 + [-1] * 2 + [-2] * 2 + [2] * 4 + [3] * 6 + [-1] * 2 + [4] * 2,
        [-1] * 4 + [0] * 20 + [1] * 2,
    ]
)


@pytest.mark.skipif(not FLASH_GPU, reason="flash attention's kernels are built for sm80 and sm90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_low_precision_segments_take_one_flash_call_for_the_documents_and_one_for_the_padding(dtype):
    leaves = make_qkv(batch=2, heads=4, tokens=26, head_dim=16)
    grad_out = torch.randn_like(leaves[0])
    want, want_grads = qkv_output_and_grads(lambda *a: qkv_reference(*a, MANY_RUNS), leaves, grad_out)
    low = [t.detach().to("cuda", dtype).requires_grad_() for t in leaves]
    segments, low_grad_out = MANY_RUNS.cuda(), grad_out.to("cuda", dtype)
    eager, eager_grads = qkv_output_and_grads(lambda *a: qkv_reference(*a, segments), low, low_grad_out)
    results = []
    kernels = attention_kernels_run(
        lambda: results.append(
            qkv_output_and_grads(lambda *a: torch_offload.segment_attention(*a, segments), low, low_grad_out)
        )
    )
    # Forward, and backward's recomputed forward: two variable-length calls each (a call may launch
    # a second kernel to combine its splits), where one call per run would launch 20.
    assert len([name for name in kernels if "fwd" in name.lower()]) <= 8, kernels
    got, got_grads = results[0]
    for name, g, e, w in zip(("out", *"qkv"), (got, *got_grads), (eager, *eager_grads), (want, *want_grads)):
        assert_as_close_as_eager(g, e, w, dtype, name)


def test_cuda_holds_one_head_group_at_a_time():
    # 65536 tokens, 8 heads of 64: eager's q, k, v, attention output and their gradients are
    # 8 x 128 MiB; each head's share of a group is 160 MiB, over half a GPU's group budget (256 MiB
    # at most), so the op's backward holds out, dx and one head's share of those.
    tokens = 65536
    inputs = to_cuda(make_inputs(batch=1, tokens=tokens, h=512, heads=8, kv_heads=8, head_dim=64))
    grad_out = torch.randn(1, tokens, 512, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call(*inputs)
    out.backward(grad_out)
    torch.cuda.synchronize()
    one_tensor = tokens * 512 * 4
    assert torch.cuda.max_memory_allocated() - before < 8 * one_tensor


def llama_8b_inputs(tokens):
    """x [1, tokens, 4096] and Llama-8B's attention weights (32 query heads over 8 key/value heads of 128), cos, sin:
    bf16 on the GPU."""
    h, heads, kv_heads, head_dim = 4096, 32, 8, 128
    generator = torch.Generator("cuda").manual_seed(0)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, device="cuda", generator=generator) * scale).bfloat16()

    x = rand(1, tokens, h)
    w_q, w_o = rand(heads * head_dim, h, scale=h**-0.5), rand(h, heads * head_dim, scale=h**-0.5)
    w_k, w_v = (rand(kv_heads * head_dim, h, scale=h**-0.5) for _ in range(2))
    angles = torch.arange(tokens, device="cuda")[:, None] * 10000 ** (
        -torch.arange(head_dim // 2, device="cuda") / (head_dim // 2)
    )
    angles = torch.cat([angles, angles], dim=-1)[None]
    return x, w_q, w_k, w_v, w_o, angles.cos().bfloat16(), angles.sin().bfloat16()


def test_cuda_runs_several_key_value_heads_per_group_at_llama_8b_shapes():
    # At 8192 tokens each key/value head's share of a group is 68 MiB: the CPU's 16 MiB budget would run the 8 one
    # per group (narrow GEMMs, and an exchange each under sequence parallelism); a GPU's budget holds several. One
    # attention call per group.
    inputs = llama_8b_inputs(8192)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(*inputs)
    kernels = ("aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention")
    groups = sum(e.count for e in prof.key_averages() if e.key in kernels)  # flash for bf16 on sm80/sm90
    assert 1 <= groups < 8


def test_cuda_opcheck():
    inputs = to_cuda(make_inputs(bias=True))
    opcheck(torch.ops.offload.attention_block.default, (*inputs, None))
    detached = [t.detach() if t is not None else None for t in inputs]
    opcheck(
        torch.ops.offload.attention_block_backward.default,
        (torch.randn(2, 7, 16, device="cuda"), *detached, 0.5, None, [True] * 11),
    )


def test_cuda_float64_and_unaligned_head_dimensions_are_refused_by_name():
    inputs = to_cuda(make_inputs(dtype=torch.float64))
    with pytest.raises(RuntimeError, match="attention_block: x is float64, which CUDA's attention kernels do not"):
        call(*inputs)
    inputs = to_cuda(make_inputs(head_dim=4), torch.bfloat16)
    with pytest.raises(
        RuntimeError,
        match="attention_block: the head dimension .cos's last dimension. is 4; CUDA's "
        "attention kernels need a multiple of 8 for BFloat16",
    ):
        call(*inputs)


def test_cuda_bf16_backward_holds_no_float32_product_as_large_as_x():
    # 8192 tokens of h 4096 in bf16, 32 heads of 128 over 8 key/value heads, weights frozen:
    # x's float32 gradient accumulator is 128 MiB. Adding each projection's product into it
    # through a whole [tokens, h] float32 GEMM result would allocate one more as large per
    # projection and head group; the op adds each product into it in the GEMM.
    tokens, h = 8192, 4096
    x, *weights = llama_8b_inputs(tokens)
    x.requires_grad_()
    out = call(x, *weights)
    grad_out = torch.randn_like(out)
    sizes = allocation_sizes(lambda: out.backward(grad_out))
    accumulator = tokens * h * 4
    assert sum(size >= accumulator for size in sizes) == 1  # x's accumulator, nothing else as large
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_autocast_is_as_close_to_float32_as_the_module_under_autocast(dtype):
    inputs = to_cuda(make_inputs(tokens=128, h=64, heads=8, kv_heads=2, head_dim=16, bias=True))
    grad_out = torch.randn(2, 128, 64, device="cuda")
    want, want_grads = output_and_grads(reference, inputs, grad_out)
    with torch.autocast("cuda", dtype=dtype):
        got, got_grads = output_and_grads(call, inputs, grad_out)
        eager, eager_grads = output_and_grads(reference, inputs, grad_out)  # as transformers runs the module
    assert got.dtype == eager.dtype == dtype
    assert relative_error(got, want) <= max(2 * relative_error(eager, want), 1e-2)
    for name, g, e, w in zip(NAMES, got_grads, eager_grads, want_grads):
        assert g.dtype == torch.float32, name  # the leaves' own dtype
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 2e-2), name


def test_cuda_segments_match_a_dense_masked_attention():
    inputs = to_cuda(make_inputs(batch=3, tokens=13, h=32, heads=4, kv_heads=2, head_dim=8, bias=True))
    segments = SEGMENTS.cuda()
    grad_out = torch.randn(3, 13, 32, device="cuda")
    got, got_grads = output_and_grads(lambda *a: call(*a, segment_ids=segments), inputs, grad_out)
    want, want_grads = output_and_grads(lambda *a: segment_reference(*a, segment_ids=segments), inputs, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert relative_error(g, w) < 1e-4, name


def test_cuda_packed_documents_allocate_nothing_of_tokens_squared():
    # 8192 tokens in 4 documents: one float32 [T, T] score matrix would be 256 MiB.
    tokens = 8192
    inputs = to_cuda(make_inputs(batch=1, tokens=tokens, h=256, heads=4, kv_heads=4, head_dim=64))
    segments = torch.arange(tokens, device="cuda").div(tokens // 4, rounding_mode="floor")[None]
    torch.cuda.synchronize()
    sizes = allocation_sizes(lambda: call(*inputs, segment_ids=segments).sum().backward())
    assert max(sizes) < tokens * tokens * 4 / 8, max(sizes)


def test_cuda_segment_attention_matches_sdpa_with_the_dense_mask_and_allocates_nothing_of_tokens_squared():
    leaves = make_qkv(heads=4, head_dim=8, dtype=torch.float32, device="cuda")
    segments = SEGMENTS.cuda()
    grad_out = torch.randn_like(leaves[0])
    got, got_grads = qkv_output_and_grads(lambda *a: torch_offload.segment_attention(*a, segments), leaves, grad_out)
    want, want_grads = qkv_output_and_grads(lambda *a: qkv_reference(*a, segments), leaves, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert relative_error(g, w) < 1e-4, name
    tokens = 8192
    q, k, v = (torch.randn(1, 4, tokens, 64, device="cuda", requires_grad=True) for _ in range(3))
    documents = torch.arange(tokens, device="cuda").div(tokens // 4, rounding_mode="floor")[None]
    sizes = allocation_sizes(lambda: torch_offload.segment_attention(q, k, v, documents).sum().backward())
    assert max(sizes) < tokens * tokens * 4 / 8, max(sizes)


def assert_as_close_as_eager(got, eager, want, dtype, name):
    """got and eager, results on the GPU, against want (float64): got's relative error at most 3 times eager
    PyTorch's on the same inputs, and at least the dtype's epsilon; in float32 at least 1e-5, as the other float32
    tests here: eager's error there is a few roundings, which a kernel summing in another order can triple."""
    floor = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    tolerance = max(3 * relative_error(eager.cpu(), want), floor)
    assert relative_error(got.cpu(), want) <= tolerance, name


def in_layout(t, layout):
    """t [B, H, T, D] in contiguous [B, H, T, D] memory (head-major) or as a transpose of contiguous [B, T, H, D]
    (token-major, as transformers' projections give it)."""
    return t.contiguous() if layout == "head_major" else t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_segment_attention_in_low_precision_is_as_close_to_float64_as_eager(dtype, layout):
    # CUDA's memory-efficient backward reads the output with a token stride of heads * head_dim whatever its
    # strides (in bf16/fp16; float32 computes that term with the real strides): the runs' output, assembled
    # in the query's layout, gave a head-major query wrong dq and dk.
    leaves = make_qkv(heads=4, head_dim=8)  # float64, on the CPU
    grad_out = torch.randn_like(leaves[0], generator=torch.Generator().manual_seed(1))
    want, want_grads = qkv_output_and_grads(lambda *a: qkv_reference(*a, SEGMENTS), leaves, grad_out)
    low = [in_layout(t.detach().to("cuda", dtype), layout).requires_grad_() for t in leaves]
    assert low[0].is_contiguous() == (layout == "head_major")
    segments, low_grad_out = SEGMENTS.cuda(), grad_out.to("cuda", dtype)
    eager, eager_grads = qkv_output_and_grads(lambda *a: qkv_reference(*a, segments), low, low_grad_out)
    got, got_grads = qkv_output_and_grads(lambda *a: torch_offload.segment_attention(*a, segments), low, low_grad_out)
    assert got.dtype == dtype
    for name, g, e, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (eager, *eager_grads), (want, *want_grads)):
        assert_as_close_as_eager(g, e, w, dtype, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_segments_in_low_precision_are_as_close_to_float64_as_eager(dtype):
    inputs = make_inputs(batch=3, tokens=13, h=32, heads=4, kv_heads=2, head_dim=8, bias=True, dtype=torch.float64)
    grad_out = torch.randn(3, 13, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want, want_grads = output_and_grads(lambda *a: segment_reference(*a, segment_ids=SEGMENTS), inputs, grad_out)
    low, segments, low_grad_out = to_cuda(inputs, dtype), SEGMENTS.cuda(), grad_out.to("cuda", dtype)
    eager, eager_grads = output_and_grads(lambda *a: segment_reference(*a, segment_ids=segments), low, low_grad_out)
    got, got_grads = output_and_grads(lambda *a: call(*a, segment_ids=segments), low, low_grad_out)
    assert got.dtype == dtype
    for name, g, e, w in zip(("out", *NAMES), (got, *got_grads), (eager, *eager_grads), (want, *want_grads)):
        assert_as_close_as_eager(g, e, w, dtype, name)


def device_to_host_copies(run):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return sum("memcpy dtoh" in event.name.lower() for event in profile.events())


def test_cuda_segment_ids_are_read_once_while_they_are_unchanged():
    # Each layer of a step passes the same ids: one blocking device-to-host copy for them all, and
    # one more once they change (through their own version counter).
    q, k, v = (torch.randn(2, 4, 64, 16, device="cuda") for _ in range(3))
    ids = torch.arange(64, device="cuda").div(20, rounding_mode="floor").expand(2, -1).contiguous()
    assert device_to_host_copies(lambda: [torch_offload.segment_attention(q, k, v, ids) for _ in range(4)]) == 1
    assert device_to_host_copies(lambda: torch_offload.segment_attention(q, k, v, ids)) == 0
    want = torch_offload.segment_attention(q, k, v, ids.flip(1).contiguous())
    ids.copy_(ids.flip(1))
    got = []
    assert device_to_host_copies(lambda: got.append(torch_offload.segment_attention(q, k, v, ids))) == 1
    torch.testing.assert_close(got[0], want)


def test_cuda_graph_capture_with_segment_ids_is_refused_by_name():
    # The ids are read on the host: a copy that fails mid-capture (and that a replay would not redo).
    segments = torch.tensor([[0] * 8 + [1] * 8], device="cuda")
    q, k, v = (torch.randn(1, 2, 16, 8, device="cuda") for _ in range(3))
    inputs = to_cuda(make_inputs(batch=1, tokens=16, head_dim=8))
    for op, run in (
        ("segment_attention", lambda: torch_offload.segment_attention(q, k, v, segments)),
        ("attention_block", lambda: call(*inputs, segment_ids=segments)),
    ):
        refused = f"{op}: cannot run while a CUDA graph is being captured on cuda.*reads segment_ids on the host"
        with pytest.raises(RuntimeError, match=refused):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                run()
        assert torch.isfinite(run()).all()  # outside a capture, as before


@pytest.mark.parametrize("norms", ["per_head", "whole_rows"])
def test_cuda_norms_match_the_cpu_op_and_bf16_is_as_close_to_float32_as_eager(norms):
    # Qwen3's per-head norms, or OLMo 2's over each token's whole q and k projections.
    make, norm_reference = NORMS[norms]
    inputs = make(batch=3, tokens=13, h=32, heads=4, kv_heads=2, head_dim=8, bias=True)
    grad_out = torch.randn(3, 13, 32)
    got = norm_output_and_grads(lambda *a: norm_call(*a, segment_ids=SEGMENTS.cuda()), to_cuda(inputs), grad_out.cuda())
    cpu = norm_output_and_grads(lambda *a: norm_call(*a, segment_ids=SEGMENTS), inputs, grad_out)
    torch.testing.assert_close(got[0].cpu(), cpu[0], rtol=1e-4, atol=1e-5)
    scale = max(w.norm() for w in cpu[1].values())
    for name, want in cpu[1].items():
        assert gradient_error(got[1][name].cpu(), want, scale) < 1e-4, name
    gpu, low = to_cuda(inputs), to_cuda(inputs, torch.bfloat16)
    want = norm_output_and_grads(norm_reference, gpu, grad_out.cuda())
    eager = norm_output_and_grads(norm_reference, low, grad_out.cuda().bfloat16())
    got = norm_output_and_grads(norm_call, low, grad_out.cuda().bfloat16())
    assert relative_error(got[0], want[0]) <= max(2 * relative_error(eager[0], want[0]), 1e-2)
    for name in want[1]:
        error, eager_error = relative_error(got[1][name], want[1][name]), relative_error(eager[1][name], want[1][name])
        assert error <= max(2 * eager_error, 1e-2), name


def test_cuda_score_mods_match_the_cpu_op_and_bf16_is_as_close_to_float32_as_eager():
    leaves, options = score_mod_inputs(MODS["both"], dtype=torch.float32, batch=3, heads=4, tokens=13, head_dim=8)
    grad_out = torch.randn_like(leaves[0])
    cpu = score_mod_run(score_mod_call, leaves, SEGMENTS, grad_out, **options)
    got = score_mod_run(score_mod_call, to_cuda(leaves), SEGMENTS.cuda(), grad_out.cuda(), **options)
    torch.testing.assert_close(got[0].cpu(), cpu[0], rtol=1e-4, atol=1e-5)
    for g, c in zip(got[1], cpu[1]):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-4, atol=1e-5)
    windowed = score_mod_run(score_mod_call, to_cuda(leaves), PACKED.cuda(), grad_out.cuda(), window=3, **options)
    want = score_mod_run(score_mod_call, leaves, PACKED, grad_out, window=3, **options)
    for g, c in zip((windowed[0], *windowed[1]), (want[0], *want[1])):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-4, atol=1e-5)
    gpu, low = to_cuda(leaves), to_cuda(leaves, torch.bfloat16)
    want = score_mod_run(score_mod_reference, gpu, SEGMENTS.cuda(), grad_out.cuda(), **options)
    eager = score_mod_run(score_mod_reference, low, SEGMENTS.cuda(), grad_out.cuda().bfloat16(), **options)
    got = score_mod_run(score_mod_call, low, SEGMENTS.cuda(), grad_out.cuda().bfloat16(), **options)
    assert relative_error(got[0], want[0]) <= max(2 * relative_error(eager[0], want[0]), 1e-2)
    for name, g, e, w in zip(("query", "key", "value", "sinks"), got[1], eager[1], want[1]):
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-2), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_segment_attention_with_a_narrower_value_head_as_deepseeks_is_as_close_to_float64_as_eager(dtype):
    # Multi-head latent attention's shapes (DeepSeek-V3: query and key heads 192 wide, value heads 128, here 24 and
    # 16): value a slice of one projection's output, transposed; the kernels get it padded to the query's width.
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(3, 13, 4, 24, generator=generator, dtype=torch.float64).transpose(1, 2)
    k, v = torch.randn(3, 13, 4, 24 + 16, generator=generator, dtype=torch.float64).transpose(1, 2).split([24, 16], -1)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn(3, 4, 13, 16, generator=generator, dtype=torch.float64)
    want, want_grads = qkv_output_and_grads(lambda *a: score_mod_reference(*a, SEGMENTS), leaves, grad_out)
    low = [t.detach().to("cuda", dtype).requires_grad_() for t in leaves]
    segments, low_grad_out = SEGMENTS.cuda(), grad_out.to("cuda", dtype)
    eager, eager_grads = qkv_output_and_grads(lambda *a: score_mod_reference(*a, segments), low, low_grad_out)
    got, got_grads = qkv_output_and_grads(lambda *a: torch_offload.segment_attention(*a, segments), low, low_grad_out)
    assert got.shape == (3, 4, 13, 16) and got.dtype == dtype
    for name, g, e, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (eager, *eager_grads), (want, *want_grads)):
        assert_as_close_as_eager(g, e, w, dtype, name)
