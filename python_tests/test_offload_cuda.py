"""Stream semantics of pack/unpack on a GPU. Skipped on machines without one."""

import pytest
import torch
from test_activations_cuda import SLEEP_CYCLES
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def slow_producer(n=4096):
    """Queue enough work on the current stream that a racing copy would read stale data."""
    a = torch.randn(n, n, device="cuda")
    for _ in range(8):
        a = a @ a / n
    return a


def test_round_trip_and_pinned_result():
    src = torch.randn(257, 33, device="cuda")
    packed = torch_offload.offload_pack(src)
    assert packed.device.type == "cpu" and packed.is_pinned()
    assert torch.equal(packed, src.cpu())
    back = torch_offload.offload_unpack(packed, "cuda")
    assert back.device.type == "cuda" and torch.equal(back, src)


def test_pack_waits_for_the_producer_on_the_current_stream():
    src = slow_producer()
    expected = src.clone()
    packed = torch_offload.offload_pack(src)
    assert torch.equal(packed, expected.cpu())


def test_restore_never_writes_a_block_the_current_stream_still_reads():
    # A block freed on the current stream is reusable there at once, while kernels queued before
    # the free may still read it: a restore allocated there, and written by the copy stream
    # without waiting, would overwrite the twos before the queued clone reads them.
    packed = torch_offload.offload_pack(torch.ones(1 << 22, device="cuda"))
    slow_producer()
    twos = torch.full((1 << 22,), 2.0, device="cuda")
    clone = twos.clone()  # queued behind the producer
    del twos
    restored = torch_offload.offload_unpack(packed, "cuda")
    assert torch.equal(clone, torch.full_like(clone, 2.0))
    assert torch.equal(restored, torch.ones_like(restored))


def test_offload_inside_a_cuda_graph_capture_is_refused():
    src = torch.randn(1024, device="cuda")
    packed = torch_offload.offload_pack(src)
    with pytest.raises(RuntimeError, match="offload_pack: cannot run while a CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch_offload.offload_pack(src)
    with pytest.raises(RuntimeError, match="offload_unpack: cannot run while a CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch_offload.offload_unpack(packed, "cuda")


def test_source_overwritten_in_place_after_blocking_pack():
    src = torch.randn(1 << 20, device="cuda")
    expected = src.cpu()
    packed = torch_offload.offload_pack(src)
    src.fill_(float("nan"))
    assert torch.equal(torch_offload.offload_unpack(packed, "cuda").cpu(), expected)


def test_source_freed_and_memory_reused_after_non_blocking_pack():
    src = slow_producer(2048)
    expected = src.cpu()
    packed = torch_offload.offload_pack(src, non_blocking=True)
    del src
    # The caching allocator must not hand the source's block to this overwrite
    # before the copy stream has read it.
    garbage = [torch.full((2048, 2048), float("nan"), device="cuda") for _ in range(4)]
    back = torch_offload.offload_unpack(packed, "cuda")
    assert torch.equal(back.cpu(), expected)
    del garbage


def test_unpack_result_is_ready_on_a_custom_current_stream():
    src = torch.randn(1 << 20, device="cuda")
    packed = torch_offload.offload_pack(src, non_blocking=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        back = torch_offload.offload_unpack(packed, "cuda")
        doubled = back * 2  # runs on `side`, which must wait for the copy
    side.synchronize()
    assert torch.equal(doubled, src * 2)


def test_reading_a_non_blocking_pack_on_the_host_via_unpack_cpu():
    src = slow_producer(2048)
    expected = src.cpu()
    packed = torch_offload.offload_pack(src, non_blocking=True)
    assert torch.equal(torch_offload.offload_unpack(packed, "cpu"), expected)


def test_pinned_arena_reuses_slices_without_new_host_allocations():
    torch_offload.offload_pack(torch.ones(1024, device="cuda"))  # the arena has a chunk now
    torch.cuda.synchronize()
    before = torch_offload.pinned_arena_stats()
    for _ in range(100):
        packed = torch_offload.offload_pack(torch.randn(1 << 16, device="cuda"))
        torch_offload.offload_unpack(packed, "cuda")
        del packed
    torch.cuda.synchronize()
    after = torch_offload.pinned_arena_stats()
    assert after["chunk_allocations"] == before["chunk_allocations"]
    assert after["slice_allocations"] >= before["slice_allocations"] + 100
    assert after["in_use_bytes"] <= before["in_use_bytes"] + (1 << 18)


def test_over_budget_falls_back_to_pageable_memory():
    old = torch_offload.pinned_arena_stats()["budget_bytes"]
    torch_offload.set_pinned_budget(0)
    try:
        src = torch.randn(4096, device="cuda")
        packed = torch_offload.offload_pack(src, non_blocking=True)
        assert not packed.is_pinned()
        assert torch.equal(torch_offload.offload_unpack(packed, "cuda"), src)
    finally:
        torch_offload.set_pinned_budget(old)


def test_no_call_synchronizes_through_aten():
    src = torch.randn(1 << 16, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = torch_offload.offload_pack(src, non_blocking=True)
        back = torch_offload.offload_unpack(packed, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(back, src)


def test_gradients_cross_devices():
    x = torch.randn(64, 8, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch_offload.offload_pack(t), (x,))
    assert torch.autograd.gradcheck(lambda t: torch_offload.offload_unpack(t.cpu(), "cuda"), (x,))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_on_cuda(requires_grad):
    src = torch.randn(3, 5, device="cuda", requires_grad=requires_grad)
    opcheck(torch.ops.offload.offload_pack.default, (src,))
    opcheck(
        torch.ops.offload.offload_unpack.default,
        (src.detach().cpu().requires_grad_(requires_grad), torch.device("cuda")),
    )


def test_compile_on_cuda_matches_eager():
    def step(x):
        packed = torch.ops.offload.offload_pack(x * 2, True)
        return (torch.ops.offload.offload_unpack(packed, x.device) * x).sum()

    x = torch.randn(16, 4, device="cuda", requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), step(x))


def test_disk_spill_of_pinned_memory_and_of_a_pack_still_in_flight(tmp_path):
    # Pinned memory goes through the spill worker's own buffer (O_DIRECT may refuse it), and a
    # non-blocking pack's copy is waited for first: else the worker reads, checksums and writes
    # the host bytes before the slow producer's result lands in them.
    pinned = torch.randn(1 << 20).pin_memory()
    ticket = torch_offload.disk_spill(pinned, directory=str(tmp_path))
    assert torch.equal(torch_offload.disk_restore(ticket, pinned.shape, pinned.dtype, "cpu"), pinned)
    src = slow_producer()
    expected = src.clone()
    packed = torch_offload.offload_pack(src, non_blocking=True)
    ticket = torch_offload.disk_spill(packed, directory=str(tmp_path))  # the copy is still queued
    assert torch.equal(torch_offload.disk_restore(ticket, packed.shape, packed.dtype, "cuda"), expected)


def test_disk_restore_to_the_gpu_copies_from_pinned_memory_on_the_copy_stream(tmp_path):
    # The read lands in pageable memory: the host-to-device copy reads a pinned copy of it (a slice of the arena) on
    # the copy stream, and the current stream waits for that copy alone, so the restore returns while the current
    # stream still sleeps, and what the stream reads after it is the spilled tensor.
    src = torch.randn(1 << 22, device="cuda")
    ticket = torch_offload.disk_spill(src, directory=str(tmp_path))
    torch_offload.disk_wait(ticket)
    slices = torch_offload.pinned_arena_stats()["slice_allocations"]
    torch.cuda._sleep(SLEEP_CYCLES)
    restored = torch_offload.disk_restore(ticket, src.shape, src.dtype, "cuda")
    assert not torch.cuda.current_stream().query()
    assert torch_offload.pinned_arena_stats()["slice_allocations"] == slices + 1
    assert torch.equal(restored, src)


def test_disk_restore_on_a_side_stream_keeps_its_memory_until_that_stream_read_it(tmp_path):
    # Restored on a side stream that sleeps first, and freed at once: the side stream is a recorded user of the
    # memory, so the next restore (allocated on the same copy stream, of the same size) does not take it and write
    # twos into it before the side stream read the ones.
    n = 1 << 24
    ones = torch_offload.disk_spill(torch.ones(n, device="cuda"), directory=str(tmp_path))
    twos = torch_offload.disk_spill(torch.full((n,), 2.0, device="cuda"), directory=str(tmp_path))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        restored = torch_offload.disk_restore(ones, (n,), torch.float32, "cuda")
        seen = restored * 1
    del restored
    other = torch_offload.disk_restore(twos, (n,), torch.float32, "cuda")
    side.synchronize()
    assert torch.equal(seen, torch.ones_like(seen))
    assert torch.equal(other, torch.full_like(other, 2.0))
