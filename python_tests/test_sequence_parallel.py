"""Sequence parallelism on Gloo CPU ranks: ulysses_attention on each rank's chunk of the rows equals
segment_attention on the whole rows in one process, values and gradients, in float64."""
import pytest
import torch
import torch.distributed as dist

import torch_offload
from distributed import run_ranks
from torch_offload.sequence_parallel import ulysses_attention


def inputs(heads, kv_heads, tokens=12, batch=2, head_dim=4):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, tokens, head_dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, tokens, head_dim, generator=generator, dtype=torch.float64)
            for _ in range(2))
    grad_out = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    # Row 0: three packed documents, the second crossing every rank boundary of 2, 3 and 4 ranks;
    # row 1: left padding, then one document.
    segment_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2], [-1, -1, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]])
    return q, k, v, segment_ids, grad_out


def whole(heads, kv_heads):
    q, k, v, segment_ids, grad_out = inputs(heads, kv_heads)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    groups = heads // kv_heads
    out = torch_offload.segment_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          segment_ids, scale=0.3)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


def sharded(rank, world_size, heads, kv_heads, path, compiled=False):
    q, k, v, segment_ids, grad_out = inputs(heads, kv_heads)
    local = q.shape[2] // world_size
    chunk = [t.narrow(2, rank * local, local).clone().requires_grad_() for t in (q, k, v)]
    attention = torch.compile(ulysses_attention, fullgraph=True) if compiled else ulysses_attention
    out = attention(*chunk, segment_ids, dist.group.WORLD, scale=0.3)
    grads = torch.autograd.grad(out, chunk, grad_out.narrow(2, rank * local, local))
    torch.save((out.detach(), grads), f"{path}.{rank}")


@pytest.mark.parametrize("world_size, heads, kv_heads, compiled",
                         [(2, 4, 4, False), (2, 4, 2, False), (2, 4, 1, False), (3, 6, 2, False), (4, 4, 2, False),
                          (2, 4, 2, True)],
                         ids=["mha", "gqa", "one_kv_head", "3_ranks_kv_fewer_than_ranks", "4_ranks", "compiled"])
def test_ulysses_attention_on_each_ranks_chunk_equals_the_whole_rows(world_size, heads, kv_heads, compiled, tmp_path):
    path = str(tmp_path / "result")
    run_ranks(sharded, world_size, heads, kv_heads, path, compiled)
    parts = [torch.load(f"{path}.{rank}") for rank in range(world_size)]
    want_out, want_grads = whole(heads, kv_heads)
    torch.testing.assert_close(torch.cat([out for out, _ in parts], dim=2), want_out)
    for i, name in enumerate("qkv"):
        torch.testing.assert_close(torch.cat([grads[i] for _, grads in parts], dim=2), want_grads[i],
                                   msg=lambda m: f"d{name}: {m}")


def refused(rank, world_size, path):
    messages = []
    q = torch.zeros(1, 4, 2, 4)
    for args in ((q[:, :3], q[:, :3], q[:, :3], torch.zeros(1, 4, dtype=torch.long)),  # 3 heads over 2 ranks
                 (q, q, q, torch.zeros(1, 2, dtype=torch.long))):  # segment ids of this rank's chunk only
        try:
            ulysses_attention(*args, dist.group.WORLD)
        except ValueError as error:
            messages.append(str(error))
    torch.save(messages, f"{path}.{rank}")


def test_heads_not_divisible_by_the_ranks_and_ids_of_a_chunk_are_refused_by_name(tmp_path):
    path = str(tmp_path / "errors")
    run_ranks(refused, 2, path)
    for rank in range(2):
        heads, ids = torch.load(f"{path}.{rank}")
        assert heads.startswith("ulysses_attention: 3 query heads cannot be split over 2 ranks")
        assert ids.startswith("ulysses_attention: segment_ids has shape [1, 2]; expected the whole rows, "
                              "[batch, 2 ranks x 2 tokens]")
