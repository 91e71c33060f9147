"""tiled_mlp (TiledMLP) and tiled_apply (a LoRA-like module) under DDP and FSDP2, 2 CPU ranks with Gloo.

Each autograd node returns every parameter gradient once, so DDP's hooks fire once per
step ("marked ready twice" would raise) and FSDP2 reduce-scatters each gradient once.
FSDP2's fully_shard runs on the CPU with Gloo in the torch this project pins (2.13).
"""

import torch
import torch.distributed as dist
from distributed import run_ranks
from test_tiled_mlp import GatedMLP, lora_mlp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import torch_offload

MODES = ["tiled_mlp", "tiled_apply"]
WRAPPERS = ["ddp", "ddp_find_unused", "ddp_static_graph", "fsdp2"]
STEPS = 2


class Block(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.norm = nn.LayerNorm(16)
        self.mlp = torch_offload.TiledMLP(GatedMLP(bias=True), num_shards=3) if mode == "tiled_mlp" else lora_mlp()

    def forward(self, x):
        h = self.norm(x)
        if self.mode == "tiled_apply":
            h = torch_offload.tiled_apply(self.mlp, h, [p for p in self.mlp.parameters() if p.requires_grad], 3)
        else:
            h = self.mlp(h)
        return x + h


class Model(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(mode) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches():
    generator = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 6, 8, generator=generator), torch.randn(8, 6, 1, generator=generator)) for _ in range(STEPS)
    ]


def train(model, params, shard=slice(None)):
    """SGD steps on the sequences in `shard`; the gradients of every step, as full tensors."""
    optimizer = torch.optim.SGD(params, lr=0.1)
    history = []
    for x, target in batches():
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x[shard]), target[shard]).backward()
        grads = [p.grad for p in params]
        history.append([g.full_tensor() if hasattr(g, "full_tensor") else g.clone() for g in grads])
        optimizer.step()
    return history


def wrap(model, wrapper):
    if wrapper == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    options = {
        "ddp": {},
        "ddp_find_unused": {"find_unused_parameters": True},
        "ddp_static_graph": {"static_graph": True},
    }[wrapper]
    return DistributedDataParallel(model, **options)


def rank_main(rank, world_size, out_path):
    per_rank = batches()[0][0].shape[0] // world_size
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    results = {}
    for mode in MODES:
        for wrapper in WRAPPERS:
            model = wrap(Model(mode), wrapper)
            results[mode, wrapper] = train(model, [p for p in model.parameters() if p.requires_grad], shard)
    dist.barrier()
    if rank == 0:
        torch.save(results, out_path)


def test_ddp_and_fsdp2_match_one_process(tmp_path):
    out_path = tmp_path / "grads.pt"
    run_ranks(rank_main, 2, str(out_path))
    results = torch.load(out_path)
    for mode in MODES:
        model = Model(mode)
        want = train(model, [p for p in model.parameters() if p.requires_grad])
        for wrapper in WRAPPERS:
            got = results[mode, wrapper]
            assert len(got) == len(want) == STEPS
            for step_got, step_want in zip(got, want):
                for g, w in zip(step_got, step_want, strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode}/{wrapper}: {m}")
