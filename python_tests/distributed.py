"""Run a function on N CPU ranks (Gloo) in fresh processes, for DDP/FSDP tests."""

import multiprocessing
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, backend="gloo"):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        fn(rank, world_size, *args)
        dist.barrier()  # no collective still in flight on either rank
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: Gloo's threads may still hold work objects whose
    # destruction during finalization aborts the process ("terminate called without
    # an active exception", a known c10d/Gloo exit race). The results are on disk.
    os._exit(0)


def run_ranks(fn, world_size, *args, backend="gloo"):
    """fn(rank, world_size, *args) on each rank; fn must be importable (module level). With backend
    "nccl", rank r uses CUDA device r.

    Results travel through files the caller names in args (e.g. under tmp_path).
    Raises if any rank fails.

    The ranks are forks of a server process (multiprocessing's forkserver) that imported torch, transformers and the
    first caller's test module once: spawned afresh, each rank imported them itself (5-10 s a rank on 2 cores, most of
    the sequence-parallel tests' time). The server imports no CUDA (a fork after CUDA's start would break it): the
    NCCL tests spawn.
    """
    start_method = "spawn" if backend == "nccl" else "forkserver"
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "transformers", fn.__module__])
    mp.start_processes(
        _entry,
        args=(world_size, free_port(), fn, args, backend),
        nprocs=world_size,
        join=True,
        start_method=start_method,
    )
