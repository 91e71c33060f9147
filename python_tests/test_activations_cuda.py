"""offload_activations() on a GPU: races, prefetch, custom streams, peak memory. Skipped without one."""

import contextlib

import pytest
import torch
from models import TinyTransformer

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def offload(**kwargs):
    kwargs.setdefault("min_bytes", 0)
    return torch_offload.offload_activations(**kwargs)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_training_step_matches_without_offload(tier, tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer(layers=4, width=64).cuda()
    x, target = torch.randn(8, 128, 64, device="cuda"), torch.randn(8, 128, 1, device="cuda")
    torch.nn.functional.mse_loss(model(x), target).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with offload(**(dict(tier="disk", spill_directory=str(tmp_path)) if tier == "disk" else {})) as context:
        loss = torch.nn.functional.mse_loss(model(x, torch_offload.checkpoint), target)
    loss.backward()
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w)
    stats = context.stats()
    assert stats["disk_bytes" if tier == "disk" else "packed_bytes"] > 0 and stats["live_entries"] == 0
    assert list(tmp_path.iterdir()) == []  # the spill file has no name


def test_source_freed_and_reused_right_after_pack():
    x = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    want = torch.autograd.grad((x * 2).sin().sum(), x)[0]
    with offload():
        h = (x * 2).sin()  # sin saves x * 2, which is freed right after
    # New allocations that would take the freed block if the copy had not read it yet.
    garbage = [torch.full((4096, 4096), float("nan"), device="cuda") for _ in range(3)]
    grad = torch.autograd.grad(h.sum(), x)[0]
    torch.testing.assert_close(grad, want)
    del garbage


def test_prefetch_order_and_hits():
    h = torch.randn(1 << 20, device="cuda", requires_grad=True) * 1
    with offload(prefetch_bytes=64 << 20) as context:
        for _ in range(8):
            h = h.sin()
    h.sum().backward()
    assert context.stats()["prefetch_hits"] == 7


def test_side_stream_forward_and_backward():
    # FSDP2 and checkpoint recompute run work on streams other than the default.
    side = torch.cuda.Stream()
    x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    want = torch.autograd.grad(x.sin().cos().sum(), x)[0]
    side.wait_stream(torch.cuda.current_stream())  # x and want are made on the default stream
    with torch.cuda.stream(side):
        with offload():
            y = x.sin().cos()
        grad = torch.autograd.grad(y.sum(), x)[0]
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(grad, want)


def test_activations_leave_the_device():
    torch.manual_seed(0)
    model = TinyTransformer(layers=4, width=256).cuda()
    x = torch.randn(4, 1024, 256, device="cuda")

    def peak(context):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with context:
            loss = model(x).square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain = peak(contextlib.nullcontext())
    offloaded = peak(offload(min_bytes=1 << 16))
    assert offloaded < 0.6 * plain, (offloaded, plain)


def test_layers_alternating_between_two_streams_with_prefetch_give_the_gradients_without_offload():
    # ~200 MB of saved activations. Each layer runs on the other stream than its neighbours, and
    # autograd runs its backward there too: a prefetch started while restoring one layer is read
    # by the next on the other stream, which must wait for the copy and hold its memory.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2048, 2048).cuda() for _ in range(6)]
    x = torch.randn(4096, 2048, device="cuda", requires_grad=True)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def loss():
        h = x
        for i, layer in enumerate(layers):
            stream = streams[i % 2]
            stream.wait_stream(torch.cuda.current_stream())
            h.record_stream(stream)  # made on another stream, read on this one
            with torch.cuda.stream(stream):
                h = torch.nn.functional.gelu(layer(h))
            torch.cuda.current_stream().wait_stream(stream)
        return h.square().mean()

    params = [x, *(p for layer in layers for p in layer.parameters())]
    want = torch.autograd.grad(loss(), params)
    with offload(prefetch_bytes=64 << 20) as context:
        value = loss()
    got = torch.autograd.grad(value, params)
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    stats = context.stats()
    assert stats["prefetch_hits"] > 0 and stats["packed_bytes"] > 100 << 20


SLEEP_CYCLES = 1 << 30  # about half a second on an H100


def test_a_saved_tensor_read_again_on_another_stream_waits_for_its_copy():
    # Backward unpacks one saved tensor twice, the second time on a side stream: that hand-out
    # is the copy the first one started, and the side stream must wait for it too. The copy
    # waits behind a long kernel the forward stream ran before the pack; the side stream does not.
    side, forward_stream = torch.cuda.Stream(), torch.cuda.Stream()
    seen = []

    class ReadTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (first,) = ctx.saved_tensors
            with torch.cuda.stream(side):
                (second,) = ctx.saved_tensors
                seen.append(second.clone())
            return grad * first

    a = torch.randn(1 << 24, device="cuda", requires_grad=True)
    x = a + 3
    want = x.detach().clone()
    forward_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(forward_stream):
        with offload():
            torch.cuda._sleep(SLEEP_CYCLES)
            y = ReadTwice.apply(x)
    del x  # backward reads the copy, not x's storage
    torch.cuda.current_stream().wait_stream(forward_stream)
    (grad,) = torch.autograd.grad(y.sum(), a)
    torch.cuda.synchronize()
    assert torch.equal(seen[0], want)
    assert torch.equal(grad, want)


def test_a_saved_tensor_read_again_on_another_stream_keeps_its_memory_until_that_stream_read_it():
    # The second hand-out, on a side stream that sleeps first, records that stream as a user of
    # the restored memory: freed with the graph, it must not go to the next restore (an
    # allocation on the same copy stream, of the same size) before the side stream read it.
    side = torch.cuda.Stream()
    seen = []
    n = 1 << 24

    class ReadLater(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (first,) = ctx.saved_tensors
            side.wait_stream(torch.cuda.current_stream())  # the copy has landed: only its memory is at stake
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                (second,) = ctx.saved_tensors
                seen.append(second * 1)
            return grad * first

    a = torch.ones(n, device="cuda", requires_grad=True)
    x = a * 1
    with offload():
        y = ReadLater.apply(x)
    del x
    torch.autograd.grad(y.sum(), a)
    torch.cuda.current_stream().synchronize()  # all done but the side stream's sleep and read
    b = torch.full((n,), 2.0, device="cuda", requires_grad=True)
    h = b * 1
    with offload():
        z = h.sin()
    del h
    torch.autograd.grad(z.sum(), b)  # restores h on the copy stream while the side stream sleeps
    torch.cuda.synchronize()
    assert torch.equal(seen[0], torch.ones(n, device="cuda"))
