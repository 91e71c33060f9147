"""Sequence parallelism on Gloo CPU ranks: ulysses_attention on each rank's chunk of the rows equals
segment_attention on the whole rows in one process, values and gradients, in float64."""
import pytest
import torch
import torch.distributed as dist

import torch_offload
from distributed import run_ranks
import torch_offload.sequence_parallel
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


def collated(tokens=13):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (2, tokens), generator=generator)
    labels = ids.clone()
    labels[0, 5:8] = -100  # an ignored run across the boundary of 2 ranks (7 tokens each after padding)
    labels[1, :2] = -100
    return dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_shard_batch_pads_splits_and_shifts_labels_across_ranks(ranks):
    from transformers.loss.loss_utils import ForCausalLMLoss

    batch = collated()
    parts = [torch_offload.sequence_parallel._shard(batch, rank, ranks) for rank in range(ranks)]
    padded = -13 % ranks + 13
    glued = {name: torch.cat([p[name] for p in parts], dim=1) for name in ("input_ids", "labels", "shift_labels",
                                                                          "attention_mask", "position_ids")}
    assert glued["input_ids"].shape == (2, padded) and torch.equal(glued["input_ids"][:, :13], batch["input_ids"])
    assert torch.equal(glued["position_ids"], torch.arange(padded)[None])
    assert (glued["attention_mask"][:, 13:] == 0).all() and (glued["labels"][:, 13:] == -100).all()
    # Each token's label is the next token's, across rank boundaries; the last real token's is -100.
    assert torch.equal(glued["shift_labels"][:, :12], batch["labels"][:, 1:])
    assert (glued["shift_labels"][:, 12:] == -100).all()
    # The ranks' losses on their tokens add up to the whole batch's (logits as a whole model gives them).
    logits = torch.randn(2, padded, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = ForCausalLMLoss(logits[:, :13], batch["labels"], 50)
    local = padded // ranks
    got = sum(ForCausalLMLoss(logits[:, r * local:(r + 1) * local].contiguous(), p["labels"], 50,
                              num_items_in_batch=p["num_items_in_batch"], shift_labels=p["shift_labels"])
              for r, p in enumerate(parts))
    torch.testing.assert_close(got, want)


def test_shard_batch_keeps_packed_positions_and_a_given_count_and_refuses_what_it_cannot_split():
    batch = dict(collated(), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]]),
                 num_items_in_batch=torch.tensor(40))
    first, second = (torch_offload.sequence_parallel._shard(batch, rank, 2) for rank in range(2))
    assert torch.equal(torch.cat([first["position_ids"], second["position_ids"]], 1),
                       torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8]]))
    assert first["num_items_in_batch"] == 40
    with pytest.raises(ValueError, match=r"shard_batch: inputs_embeds has shape \[2, 13, 8\]"):
        torch_offload.sequence_parallel._shard(dict(batch, inputs_embeds=torch.zeros(2, 13, 8)), 0, 2)
    with pytest.raises(ValueError, match=r"shard_batch: labels has shape \[2, 12\]; expected \[batch, 13\]"):
        torch_offload.sequence_parallel._shard(dict(batch, labels=batch["labels"][:, 1:]), 0, 2)
    with pytest.raises(ValueError, match="shard_batch: the batch has shift_labels; pass labels"):
        torch_offload.sequence_parallel._shard(dict(batch, shift_labels=batch["labels"]), 0, 2)
    with pytest.raises(ValueError, match="shard_batch: the batch has no input_ids"):
        torch_offload.sequence_parallel._shard({"labels": batch["labels"]}, 0, 2)


def shard_on_ranks(rank, world_size, path):
    torch.save(torch_offload.sequence_parallel.shard_batch(collated(), dist.group.WORLD), f"{path}.{rank}")


def test_shard_batch_takes_the_rank_and_count_from_the_group(tmp_path):
    path = str(tmp_path / "shard")
    run_ranks(shard_on_ranks, 2, path)
    for rank in range(2):
        got, want = torch.load(f"{path}.{rank}"), torch_offload.sequence_parallel._shard(collated(), rank, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
