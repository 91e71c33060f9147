"""Sequence parallelism over NCCL on CUDA ranks (as many as there are GPUs, up to 2; one GPU makes a group of
one, which still runs every collective): ulysses_attention and attention_block with a group, values and
gradients against the same ops on the whole rows in one process, and an applied Llama's step. Skipped
without CUDA."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_attention_block import NAMES, segment_reference
from test_attention_block import make_inputs as make_block_inputs
from test_attention_block_cuda import assert_as_close_as_eager
from test_segment_attention import reference as qkv_reference
from test_sequence_parallel import (
    APPLIED,
    BLOCK_SEGMENTS,
    call_counting_collectives,
    inputs,
    one_process,
    sp_model,
    whole,
)

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def ranks():
    return min(2, torch.cuda.device_count())


def on_cuda_ranks(rank, world_size, path):
    device = torch.device("cuda", rank)
    # float32: the CUDA attention kernels take no float64.
    q, k, v, segment_ids, grad_out = (
        t.to(device, torch.float32 if t.is_floating_point() else t.dtype) for t in inputs(4, 2)
    )
    local = q.shape[2] // world_size
    chunk = [t.narrow(2, rank * local, local).clone().requires_grad_() for t in (q, k, v)]
    out = torch_offload.ulysses_attention(*chunk, segment_ids, dist.group.WORLD, scale=0.3)
    grads = torch.autograd.grad(out, chunk, grad_out.narrow(2, rank * local, local))
    model = sp_model("llama_one_kv_head").to(device, torch.float32)
    torch_offload.apply(model, sequence_parallel=dist.group.WORLD, offload="cpu")
    losses = []
    for batch in APPLIED["llama_one_kv_head"][2]():
        batch = {
            n: t.to(device) if isinstance(t, torch.Tensor) else t
            for n, t in torch_offload.shard_batch(batch, dist.group.WORLD).items()
        }
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach().cpu())
    model_grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    torch.save(((out.detach().cpu(), [g.cpu() for g in grads]), (losses, model_grads)), f"{path}.{rank}")


def test_nccl_ranks_equal_one_process(tmp_path):
    path, n = str(tmp_path / "cuda"), ranks()
    run_ranks(on_cuda_ranks, n, path, backend="nccl")
    parts = [torch.load(f"{path}.{rank}") for rank in range(n)]
    close = dict(rtol=1e-4, atol=1e-5)  # float32 on the GPU against float64 on the CPU
    want_out, want_grads = whole(4, 2)
    torch.testing.assert_close(torch.cat([p[0][0] for p in parts], dim=2), want_out.float(), **close)
    for i in range(3):
        torch.testing.assert_close(torch.cat([p[0][1][i] for p in parts], dim=2), want_grads[i].float(), **close)
    want_losses, want_model_grads = one_process("llama_one_kv_head")
    for losses, _ in (p[1] for p in parts):
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses).float(), **close)
    for name, want in want_model_grads.items():
        torch.testing.assert_close(sum(p[1][1][name] for p in parts), want.float(), **close)


def aligned_block_inputs():
    """attention_block's float64 inputs with a head dimension bf16/fp16 kernels take (8)."""
    return make_block_inputs(batch=2, tokens=12, h=32, heads=4, kv_heads=2, head_dim=8, bias=True, dtype=torch.float64)


def low_precision_on_cuda_ranks(rank, world_size, path):
    device, group = torch.device("cuda", rank), dist.group.WORLD
    local = 12 // world_size
    # What CUDA's kernels refuse is refused before any exchange, as on the CPU.
    q = torch.zeros(1, 2, local, 8, device=device, dtype=torch.float64)
    ids = torch.zeros(1, 12, dtype=torch.long, device=device)
    refused = [
        call_counting_collectives(lambda t=t: torch_offload.ulysses_attention(t, t, t, ids, group))
        for t in (q, q[..., :4].bfloat16())
    ]
    results = dict(refused=refused)
    # The exchanges give segment_attention head-major [B, H, T, D] tensors: in bf16/fp16 its dq and dk were wrong.
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, segment_ids, grad_out = (
            t.to(device, dtype if t.is_floating_point() else t.dtype) for t in inputs(4, 2, head_dim=8)
        )
        chunk = [t.narrow(2, rank * local, local).clone().requires_grad_() for t in (q, k, v)]
        out = torch_offload.ulysses_attention(*chunk, segment_ids, group, scale=0.3)
        grads = torch.autograd.grad(out, chunk, grad_out.narrow(2, rank * local, local))
        block = [t.to(device, dtype) if t is not None else None for t in aligned_block_inputs()]
        x = block[0].narrow(1, rank * local, local).detach().requires_grad_()
        cos, sin = (t.narrow(1, rank * local, local) for t in block[5:7])
        weights = [t.detach().requires_grad_() for t in block[1:5] + block[7:]]
        block_out = torch_offload.attention_block(
            x,
            *weights[:4],
            cos,
            sin,
            **dict(zip(("b_q", "b_k", "b_v", "b_o"), weights[4:])),
            segment_ids=BLOCK_SEGMENTS.to(device),
            group_name=group.group_name,
        )
        block_grad_out = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        block_grads = torch.autograd.grad(
            block_out, [x, *weights], block_grad_out.narrow(1, rank * local, local).to(device, dtype)
        )
        results[str(dtype)] = [t.cpu() for t in (out, *grads, block_out, *block_grads)]
    torch.save(results, f"{path}.{rank}")


def test_nccl_ranks_in_low_precision_are_as_close_to_float64_as_eager(tmp_path):
    path, n = str(tmp_path / "low"), ranks()
    run_ranks(low_precision_on_cuda_ranks, n, path, backend="nccl")
    parts = [torch.load(f"{path}.{rank}") for rank in range(n)]
    for rank, part in enumerate(parts):
        (float64, float64_calls), (unaligned, unaligned_calls) = part["refused"]
        assert float64.startswith("ulysses_attention: query is float64, which CUDA's attention kernels"), rank
        assert unaligned.startswith(
            "ulysses_attention: the head dimension (query's last dimension) is 4; CUDA's attention kernels need a "
            "multiple of 8 for BFloat16"
        ), rank
        assert float64_calls == unaligned_calls == 0, rank
    q, k, v, segment_ids, grad_out = inputs(4, 2, head_dim=8)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    block = aligned_block_inputs()
    block_grad_out = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def results(device, dtype):
        """ulysses_attention's and attention_block's output and gradients on the whole rows, in eager PyTorch."""
        cast = [t.detach().to(device, dtype).requires_grad_() for t in leaves]
        out = qkv_reference(cast[0], *(t.repeat_interleave(2, 1) for t in cast[1:]), segment_ids.to(device), 0.3)
        grads = torch.autograd.grad(out, cast, grad_out.to(device, dtype))
        cast_block = [t.detach().to(device, dtype).requires_grad_(i not in (5, 6)) for i, t in enumerate(block)]
        block_out = segment_reference(*cast_block, segment_ids=BLOCK_SEGMENTS.to(device))
        block_grads = torch.autograd.grad(
            block_out, [t for i, t in enumerate(cast_block) if i not in (5, 6)], block_grad_out.to(device, dtype)
        )
        return [t.detach().cpu() for t in (out, *grads, block_out, *block_grads)]

    want = results("cpu", torch.float64)
    names = ["out", "dq", "dk", "dv", "block_out", *(f"block_{name}" for name in NAMES)]
    # Each rank holds its chunk of the tokens' outputs and of x's gradient; the weights' gradients add up.
    by_tokens = {"out": 2, "dq": 2, "dk": 2, "dv": 2, "block_out": 1, "block_x": 1}
    for dtype in (torch.bfloat16, torch.float16):
        eager = results("cuda", dtype)
        for i, name in enumerate(names):
            shares = [part[str(dtype)][i] for part in parts]
            got = torch.cat(shares, by_tokens[name]) if name in by_tokens else sum(s.double() for s in shares)
            assert_as_close_as_eager(got, eager[i], want[i], dtype, f"{dtype} {name}")
