"""Sequence-parallel training with torch_offload.apply, launched by torchrun: the demo's model on one long
sequence split across the ranks.

    torchrun --nproc-per-node 2 examples/sequence_parallel/train.py [--tokens 4096] [--steps 3] [--out losses.json]
    python examples/sequence_parallel/train.py   # the same training in one process

Every rank builds the demo's Llama (examples/demo.py: random weights, 32K vocabulary, reading
examples/data/corpus.txt one byte per token) and passes the same whole batch (packed documents,
position_ids restarting) to torch_offload.shard_batch, which gives it its contiguous chunk of the
tokens. apply(model, sequence_parallel=group) runs each attention over the whole sequence with the
ulysses_attention op (Gloo on CPUs, NCCL on GPUs) and makes every rank's loss the whole batch's. Each
rank's gradients are its share: they are summed over the group before the optimizer step, after which
every rank holds one process's gradients and the ranks stay identical. Rank 0 prints the losses and
writes them to --out: they equal the one-process run's.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers

import torch_offload

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from demo import PACKED_DOCUMENTS, model_config, token_batch  # noqa: E402  (the demo's model and corpus)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the whole sequence")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    gpu = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if gpu else "gloo")
    group = dist.group.WORLD if distributed else None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(model_config(args, args.tokens)).to(device).train()
    spill = tempfile.TemporaryDirectory()
    tier = dict(offload="cpu") if gpu else dict(offload="disk", spill_directory=spill.name)
    handle = torch_offload.apply(model, min_bytes=1 << 16, sequence_parallel=group, **tier)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    ids = token_batch(args.tokens)
    batch = dict(
        input_ids=ids,
        labels=ids,
        position_ids=torch.arange(args.tokens).remainder(args.tokens // PACKED_DOCUMENTS)[None],
    )
    if distributed:
        batch = torch_offload.shard_batch(batch, group)  # this rank's tokens, labels shifted across ranks
    batch = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()}
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss  # the whole batch's, on every rank
        loss.backward()
        if distributed:  # each rank's gradients are its tokens' share: one process's are their sum
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
        optimizer.step()
        losses.append(loss.item())
    handle.remove()
    if not distributed or dist.get_rank() == 0:
        print("losses:", " ".join(f"{value:.6f}" for value in losses))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(losses, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    spill.cleanup()


if __name__ == "__main__":
    main()
