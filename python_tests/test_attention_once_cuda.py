"""Each attention forward once per step on a GPU: attention_block_attend's output and log-sum-exps handed to
attention_block's backward (flash attention's for bf16/fp16 on sm80/sm90, the memory-efficient kernels' otherwise),
against the op that recomputes and float64; and apply()'s GPU default launching one attention forward per layer.
Skipped without a GPU."""

import pytest
import torch
from test_apply import batch, loss_and_grads, make_model
from test_attention_block import SEGMENTS, make_inputs, relative_error
from test_attention_block_cuda import FLASH_GPU, attention_kernels_run, to_cuda
from test_attention_once import attending_once, output_and_grads, recomputing

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("segmented", [False, True], ids=["whole_rows", "packed_and_padded"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_attending_once_is_as_close_to_float64_as_recomputing(dtype, segmented):
    inputs = make_inputs(batch=3, tokens=13, h=64, heads=4, kv_heads=2, head_dim=16, bias=True, dtype=torch.float64)
    segment_ids = SEGMENTS if segmented else None
    want = output_and_grads(recomputing, inputs, segment_ids)
    low = to_cuda(inputs, dtype)
    cuda_ids = segment_ids.cuda() if segmented else None
    recomputed = output_and_grads(recomputing, low, cuda_ids)
    got = output_and_grads(attending_once, low, cuda_ids)
    for g, r, w in zip(got, recomputed, want):
        assert g.dtype == dtype
        assert relative_error(g.cpu(), w) <= max(1.5 * relative_error(r.cpu(), w), torch.finfo(dtype).eps)


@pytest.mark.skipif(not FLASH_GPU, reason="flash attention's kernels are built for sm80 and sm90")
def test_cuda_gpu_default_launches_one_attention_forward_per_layer_and_step():
    model = make_model("llama").cuda().bfloat16()
    ids = batch().cuda()
    handle = torch_offload.apply(model, num_shards=2)  # offload="cpu", whole layers recomputed
    loss_and_grads(model, ids)  # warm-up
    kernels = attention_kernels_run(lambda: loss_and_grads(model, ids))
    forwards = [name for name in kernels if "fwd" in name.lower()]
    # Three layers, one sequence a row: one forward launch each (a launch may add a kernel to combine its splits),
    # where recomputing ran three per layer.
    assert 3 <= len(forwards) <= 6, kernels
    handle.remove()


def test_cuda_attend_is_refused_under_graph_capture_with_segment_ids_by_name():
    inputs = to_cuda(make_inputs(batch=3, tokens=13, h=64, heads=4, kv_heads=2, head_dim=16), torch.bfloat16)
    x, w_q, w_k, w_v, _, cos, sin = inputs[:7]
    segments = SEGMENTS.cuda()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="attention_block_attend"), torch.cuda.graph(graph):
        torch_offload.attention_block_attend(x.detach(), w_q, w_k, w_v, cos, sin, segment_ids=segments)


def host_to_device_copies(run):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return sum("HtoD" in event.name for event in profile.events())


@pytest.mark.skipif(not FLASH_GPU, reason="flash attention's variable-length kernels are built for sm80 and sm90")
def test_cuda_packed_rows_copy_their_segment_indices_to_the_device_once_per_thread():
    inputs = to_cuda(make_inputs(batch=3, tokens=13, h=64, heads=4, kv_heads=2, head_dim=16), torch.bfloat16)
    segments = SEGMENTS.cuda()
    x, w_q, w_k, w_v, _, cos, sin = (t.detach() if t is not None else None for t in inputs[:7])

    def attend():
        torch_offload.attention_block_attend(x, w_q, w_k, w_v, cos, sin, segment_ids=segments)

    attend()  # the indices of both variable-length calls (documents, padding) packed and copied
    # Every later layer and head group of the step: the same runs on the same stream, nothing copied again.
    assert host_to_device_copies(attend) == 0
