"""Sequence parallelism over NCCL on CUDA ranks (as many as there are GPUs, up to 2; one GPU makes a group of
one, which still runs every collective): ulysses_attention and attention_block with a group, values and
gradients against the same ops on the whole rows in one process, and an applied Llama's step. Skipped
without CUDA."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_sequence_parallel import APPLIED, inputs, one_process, sp_model, whole

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
