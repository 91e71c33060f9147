"""apply() (tiled MLPs, checkpointing, the fused loss; under DDP the chunk-recurrent step) on a Hugging Face model
under DDP and FSDP2, 2 CPU ranks with Gloo: each rank's gradients equal one process training on the whole batch."""

import torch
import torch.distributed as dist
from distributed import run_ranks
from test_apply import batch, make_model
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import torch_offload

WRAPPERS = ["ddp", "fsdp2"]


def grads_of_one_step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {
        name.removeprefix("module."): p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def rank_main(rank, world_size, out_path, spill_directory):
    ids = batch()
    per_rank = ids.shape[0] // world_size
    results = {}
    for wrapper in WRAPPERS:
        model = make_model("llama")
        handle = torch_offload.apply(model, offload="disk", spill_directory=spill_directory)  # the step's route
        assert handle.loss == "linear_cross_entropy"
        if wrapper == "fsdp2":
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            model = DistributedDataParallel(model)
        results[wrapper] = grads_of_one_step(model, ids[rank * per_rank : (rank + 1) * per_rank])
        # The chunk-recurrent step under DDP (one gradient per parameter); FSDP2's hooks send calls to the layers.
        results[f"{wrapper} chunk-recurrent steps"] = handle.chunk_recurrent_calls
    dist.barrier()
    if rank == 0:
        torch.save(results, out_path)


def test_applied_model_under_ddp_and_fsdp2_matches_one_process(tmp_path):
    out_path = tmp_path / "grads.pt"
    run_ranks(rank_main, 2, str(out_path), str(tmp_path))
    results = torch.load(out_path)
    want = grads_of_one_step(make_model("llama"), batch())  # plain model, plain loss, whole batch
    assert (results["ddp chunk-recurrent steps"], results["fsdp2 chunk-recurrent steps"]) == (1, 0)
    for wrapper in WRAPPERS:
        got = results[wrapper]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{wrapper} {name}: {m}"
            )
