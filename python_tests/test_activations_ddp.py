"""DDP (2 CPU ranks, Gloo) with offloaded non-reentrant checkpointing of every layer."""

import torch
from distributed import run_ranks
from models import TinyTransformer
from torch.nn.parallel import DistributedDataParallel

import torch_offload

DDP_OPTIONS = [
    {"find_unused_parameters": False},
    {"find_unused_parameters": True},
    {"static_graph": True},
]
STEPS = 3


def data():
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 16, 32, generator=generator), torch.randn(8, 16, 1, generator=generator)) for _ in range(STEPS)
    ]


def initial_state():
    torch.manual_seed(0)
    return TinyTransformer().state_dict()


def train_steps(model, batches, shard=slice(None)):
    """SGD steps with offloaded checkpointing of every layer; returns the last step's grads."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, target in batches:
        optimizer.zero_grad(set_to_none=True)
        with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0):
            out = model(x[shard], torch_offload.checkpoint)
            loss = torch.nn.functional.mse_loss(out, target[shard])
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return grads


def ddp_rank(rank, world_size, out_path):
    batches = data()
    per_rank = batches[0][0].shape[0] // world_size
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    results = []
    for options in DDP_OPTIONS:
        model = TinyTransformer()
        model.load_state_dict(initial_state())
        results.append(train_steps(DistributedDataParallel(model, **options), batches, shard))
    if rank == 0:
        torch.save(results, out_path)


def test_ddp_with_offloaded_checkpointing_matches_one_process(tmp_path):
    out_path = tmp_path / "grads.pt"
    run_ranks(ddp_rank, 2, str(out_path))
    model = TinyTransformer()
    model.load_state_dict(initial_state())
    want = train_steps(model, data())
    for options, got in zip(DDP_OPTIONS, torch.load(out_path)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{options}: {m}")
