"""Run a function on N CPU ranks (Gloo) in fresh processes, for DDP/FSDP tests."""
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size, *args):
    """fn(rank, world_size, *args) on each rank; fn must be importable (module level).

    Results travel through files the caller names in args (e.g. under tmp_path).
    Raises if any rank fails.
    """
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
