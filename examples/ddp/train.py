"""Data-parallel training with torch_offload.apply, launched by torchrun.

    torchrun --nproc-per-node 2 examples/ddp/train.py [--steps 5] [--out losses.json]
    python examples/ddp/train.py                 # the same training in one process

Each rank trains a small random-init Llama (nothing downloaded) on its share of a
batch, with tiled MLPs and offloaded non-reentrant checkpointing (the disk tier on
CPUs, pinned host memory on GPUs); DDP averages the gradients (Gloo on CPUs, NCCL on
GPUs). Rank 0 writes the loss of each step, averaged over the ranks, to --out: it
equals the one-process run's, which sees the whole batch.
"""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

import torch_offload

BATCH, SEQ_LEN = 8, 64


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    gpu = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config).to(device).train()
    spill = tempfile.TemporaryDirectory()
    handle = torch_offload.apply(model, offload="cpu" if gpu else "disk", spill_directory=spill.name, min_bytes=0)
    trained = DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # One batch, learned again each step, so that a few steps show the loss going down.
    per_rank = BATCH // world
    batch = torch.randint(3, 256, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    ids = batch[rank * per_rank : (rank + 1) * per_rank].to(device)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = trained(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        if distributed:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    handle.remove()
    if rank == 0:
        print("losses:", " ".join(f"{value:.6f}" for value in losses))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(losses, f)
    if distributed:
        del trained
        dist.barrier()  # every rank is done with its collectives before teardown
        dist.destroy_process_group()
    spill.cleanup()


if __name__ == "__main__":
    main()
