"""offload_activations() and checkpoint(): bitwise-equal training, dedup, budget, prefetch, leaks."""

import contextlib
import os
import resource
import subprocess
import sys
import time
import weakref

import pytest
import torch
from models import TinyTransformer
from torch import nn

import torch_offload

pytestmark = pytest.mark.torch_range


def train(model, batches, context_factory=None, layer_fn=None, steps=5):
    """Plain SGD steps; returns the losses, the last step's gradients and the contexts used."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, contexts = [], []
    for step in range(steps):
        x, target = batches[step]
        optimizer.zero_grad(set_to_none=True)
        context = context_factory() if context_factory else contextlib.nullcontext()
        with context:
            loss = torch.nn.functional.mse_loss(model(x, layer_fn), target)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.detach())
        contexts.append(context)
    return losses, grads, contexts


def make_batches(steps=5):
    torch.manual_seed(1)
    return [(torch.randn(4, 16, 32), torch.randn(4, 16, 1)) for _ in range(steps)]


def fresh_model():
    torch.manual_seed(0)
    return TinyTransformer()


def offloaded(**kwargs):
    kwargs.setdefault("offload_cpu_tensors", True)
    kwargs.setdefault("min_bytes", 0)
    return lambda: torch_offload.offload_activations(**kwargs)


def assert_bitwise_equal(run_a, run_b):
    for a, b in zip(run_a[0], run_b[0]):
        assert torch.equal(a, b)
    for a, b in zip(run_a[1], run_b[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("with_checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_training_is_bitwise_equal_and_counted(with_checkpoint):
    layer_fn = (lambda layer, x: torch_offload.checkpoint(layer, x)) if with_checkpoint else None
    batches = make_batches()
    baseline = train(fresh_model(), batches, layer_fn=layer_fn)
    run = train(fresh_model(), batches, offloaded(), layer_fn=layer_fn)
    assert_bitwise_equal(baseline, run)
    for context in run[2]:
        stats = context.stats()
        assert stats["packed_bytes"] > 0
        # The batch's inputs, which the caller still holds, are served from their own storage.
        assert stats["unpacked_bytes"] + stats["live_bytes"] == stats["packed_bytes"]
        assert 0 < stats["live_bytes"] < stats["packed_bytes"]
        assert stats["prefetch_hits"] > 0
        assert stats["host_bytes"] == 0 and stats["live_entries"] == 0  # freed with the graph
        if not with_checkpoint:
            assert stats["dedup_hits"] > 0  # e.g. q, k, v: views of one qkv output


def test_checkpointed_layers_offload_only_their_inputs():
    model, batches = fresh_model(), make_batches(1)
    plain = train(model, batches, offloaded(), steps=1)[2][0].stats()["packed_bytes"]
    checkpointed = train(fresh_model(), batches, offloaded(), torch_offload.checkpoint, steps=1)
    stats = checkpointed[2][0].stats()
    assert 0 < stats["packed_bytes"] < plain / 4


def test_views_and_expanded_tensors_are_rebuilt_exactly():
    base = torch.randn(6, 8, requires_grad=True)
    row = torch.randn(1, 8, requires_grad=True)
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as context:
        h = base * 1.5
        loss = h.t().sin().sum() + h[:, ::2].cos().sum() + (h * row.expand(6, 8).exp()).sum()
    loss.backward()
    grads = base.grad.clone(), row.grad.clone()
    base.grad = row.grad = None
    h = base * 1.5
    (h.t().sin().sum() + h[:, ::2].cos().sum() + (h * row.expand(6, 8).exp()).sum()).backward()
    assert torch.equal(grads[0], base.grad) and torch.equal(grads[1], row.grad)
    assert context.stats()["dedup_hits"] >= 2  # h saved three times, offloaded once


def test_parameters_small_tensors_and_cpu_tensors_are_left_alone():
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with torch_offload.offload_activations() as default_context:  # CPU tensors: not offloaded
        linear(x).relu().sum().backward()
    assert default_context.stats()["packed_bytes"] == 0
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=1 << 20) as small:
        linear(x).relu().sum().backward()
    assert small.stats()["packed_bytes"] == 0
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as context:
        linear(x).relu().sum().backward()
    # x (32x64 floats) and the relu output, never the 64x64 weight.
    assert context.stats()["packed_bytes"] == 2 * 32 * 64 * 4


def test_module_buffers_are_skipped_by_storage():
    norm = torch.nn.BatchNorm1d(16)
    x = torch.randn(8, 16, requires_grad=True)
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0, module=norm) as context:
        out = norm(x)
    out.sum().backward()
    buffer_bytes = sum(b.numel() * b.element_size() for b in norm.buffers())
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as unskipped:
        out = norm(x)
    out.sum().backward()
    assert context.stats()["packed_bytes"] <= unskipped.stats()["packed_bytes"]
    assert buffer_bytes > 0


def test_host_budget_is_never_exceeded_and_training_stays_equal():
    batches = make_batches()
    baseline = train(fresh_model(), batches)
    budget = 64 << 10
    run = train(fresh_model(), batches, offloaded(max_host_bytes=budget))
    assert_bitwise_equal(baseline, run)
    for context in run[2]:
        stats = context.stats()
        assert 0 < stats["peak_host_bytes"] <= budget
        assert stats["kept_on_device_bytes"] > 0


def sin_chain_stats(prefetch_bytes, length=10, **options):
    # Not a leaf: a leaf that requires grad counts as a parameter and stays put.
    h = torch.randn(256, requires_grad=True) * 1
    with torch_offload.offload_activations(
        offload_cpu_tensors=True, min_bytes=0, prefetch_bytes=prefetch_bytes, **options
    ) as ctx:
        for _ in range(length):
            h = h.sin()  # each sin saves its input: backward needs them in reverse
    h.sum().backward()
    return ctx.stats()


def test_prefetch_restores_in_reverse_pack_order():
    stats = sin_chain_stats(prefetch_bytes=1 << 20)
    assert stats["packed_bytes"] == 10 * 256 * 4
    assert stats["prefetch_hits"] == 9  # every entry but the last packed, which backward needs first
    # A budget of one tensor still prefetches each next one in time.
    assert sin_chain_stats(prefetch_bytes=256 * 4)["prefetch_hits"] == 9
    # A budget under one tensor still has the next one in flight (one at a time).
    assert sin_chain_stats(prefetch_bytes=16)["prefetch_hits"] == 9
    assert sin_chain_stats(prefetch_bytes=0)["prefetch_hits"] == 0


def test_prefetch_within_its_budget_restores_larger_tensors_on_demand():
    # Each saved tensor is 1 KiB: a budget of one is still read ahead, one under it never is.
    assert sin_chain_stats(prefetch_bytes=256 * 4, prefetch_over_budget=False)["prefetch_hits"] == 9
    stats = sin_chain_stats(prefetch_bytes=256 * 4 - 1, prefetch_over_budget=False)
    assert stats["prefetch_hits"] == 0
    assert stats["unpacked_bytes"] == 10 * 256 * 4  # every one restored all the same
    with pytest.raises(TypeError, match="prefetch_over_budget must be True or False, got 1"):
        torch_offload.offload_activations(prefetch_over_budget=1)


def mixed_chain_stats(**options):
    # Saved tensors of 4 KiB and 1 KiB in turn (each sin saves its input); chain()'s intermediates die with its frame,
    # so backward restores every one of them rather than reading a live storage.
    def chain(h):
        for _ in range(5):
            big = h.repeat(4)
            h = (big.sin()[:256] * 1).sin()
        return h

    with torch_offload.offload_activations(
        offload_cpu_tensors=True, min_bytes=0, prefetch_bytes=2048, **options
    ) as ctx:
        out = chain(torch.randn(256, requires_grad=True) * 1)
    out.sum().backward()
    return ctx.stats()


def test_prefetch_within_its_budget_goes_on_past_a_tensor_restored_on_demand():
    # Backward restores 1, 4, 1, 4, ... KiB: within 2 KiB every 1 KiB tensor but the first restored is read ahead,
    # each 4 KiB one on demand, and the scan resumes after each of those.
    within = mixed_chain_stats(prefetch_over_budget=False)
    assert within["prefetch_hits"] == 4
    assert within["unpacked_bytes"] == 5 * (4096 + 1024)
    assert within["prefetch_scanned"] <= 2 * 10
    # The next one always (the default): all but the first restored.
    assert mixed_chain_stats()["prefetch_hits"] == 9


def test_nested_contexts_use_the_innermost_and_reentry_is_safe():
    x = torch.randn(64, requires_grad=True)
    outer = torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0)
    inner = torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0)
    with outer:
        a = x.sin()
        with inner:
            b = a.cos()
            with outer:  # the same context entered again
                c = b.exp()
        d = c.tanh()
    d.sum().backward()
    want = torch.autograd.grad(x.sin().cos().exp().tanh().sum(), x)[0]
    assert torch.equal(x.grad, want)
    assert inner.stats()["packed_bytes"] == 64 * 4  # only a, saved by cos
    assert outer.stats()["packed_bytes"] == 2 * 64 * 4  # b and c; x is a leaf that requires grad


def test_gradient_accumulation_and_retained_graph():
    model, batches = fresh_model(), make_batches(2)
    plain = fresh_model()
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0):
        losses = [torch.nn.functional.mse_loss(model(x), t) for x, t in batches]
    losses[0].backward(retain_graph=True)
    losses[0].backward()
    losses[1].backward()
    for x, t in batches[:1] * 2 + batches[1:]:
        torch.nn.functional.mse_loss(plain(x), t).backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


def test_in_place_change_of_a_saved_tensor_raises():
    a = torch.randn(5, requires_grad=True)
    for min_bytes in (0, 1 << 20):  # offloaded, and saved as it is
        with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=min_bytes):
            b = a * 2
            y = b.sin()
        b.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_in_place_change_of_an_input_kept_by_checkpoint_offload_false_raises():
    a = torch.randn(5, requires_grad=True)
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0):
        b = a * 2
        y = torch_offload.checkpoint(torch.sin, b, offload=False)
    b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def test_host_memory_does_not_grow_over_1000_steps():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256)
    context = torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0)
    step_bytes = None

    def step():
        with context:
            loss = model(x).square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(50):  # warm up allocator caches
        step()
    before = rss_bytes()
    for _ in range(1000):
        step()
        stats = context.stats()
        assert stats["host_bytes"] == 0 and stats["live_entries"] == 0
    growth = rss_bytes() - before
    step_bytes = context.stats()["packed_bytes"] // 1050
    # One step offloads ~200 KB: a leak of even one step's worth each step would be ~200 MB.
    assert growth < 8 * step_bytes + (4 << 20), f"RSS grew by {growth} bytes over 1000 steps"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="tier"):
        torch_offload.offload_activations(tier="tape")
    with pytest.raises(ValueError, match="max_host_bytes"):
        torch_offload.offload_activations(max_host_bytes=-1)
    with pytest.raises(ValueError, match="min_bytes must be an int >= 0, got -5"):
        torch_offload.offload_activations(min_bytes=-5)
    with pytest.raises(ValueError, match="prefetch_bytes must be an int >= 0, got -1"):
        torch_offload.offload_activations(prefetch_bytes=-1)
    # Types too: a string or a bool is not a byte count, a bool flag is not a string.
    with pytest.raises(TypeError, match=r"offload_activations: min_bytes must be an int, got '1M' \(str\)"):
        torch_offload.offload_activations(min_bytes="1M")
    with pytest.raises(TypeError, match=r"max_host_bytes must be an int or None, got True \(bool\)"):
        torch_offload.offload_activations(max_host_bytes=True)
    with pytest.raises(TypeError, match="offload_cpu_tensors must be True, False or None, got 'no'"):
        torch_offload.offload_activations(offload_cpu_tensors="no")
    with pytest.raises(TypeError, match=r"spill_directory must be a str or os.PathLike path, got b./tmp. \(bytes\)"):
        torch_offload.offload_activations(tier="disk", spill_directory=b"/tmp")
    with pytest.raises(ValueError, match="use_reentrant"):
        torch_offload.checkpoint(torch.sin, torch.randn(2), use_reentrant=True)
    # A typo, or an option the tier would ignore, never changes what runs without a word.
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_host_byte'"):
        torch_offload.offload_activations(max_host_byte=1)
    for ignored in (dict(spill_directory="/tmp"), dict(allow_tmpfs=True)):
        with pytest.raises(ValueError, match="spill_directory and allow_tmpfs would be ignored with tier='cpu'"):
            torch_offload.offload_activations(tier="cpu", **ignored)


def test_checkpoint_offload_false_keeps_inputs_inside_an_offload_context():
    layer = torch.nn.Linear(32, 32)
    x = torch.randn(8, 32)
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as context:
        out = torch_offload.checkpoint(layer, x, offload=False)
    out.sum().backward()
    assert context.stats()["packed_bytes"] == 0
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as context:
        out = torch_offload.checkpoint(layer, x)
    out.sum().backward()
    assert context.stats()["packed_bytes"] == 8 * 32 * 4  # the input x


def test_checkpoint_offloads_tensors_passed_by_keyword_or_in_tuples():
    # A decoder layer's attention is called as attn(hidden_states=x, position_embeddings=(cos, sin)):
    # torch.utils.checkpoint would hold those by reference, out of any offload context's reach.
    def attention(hidden_states=None, position_embeddings=None, scale=1.0):
        cos, sin = position_embeddings
        return (hidden_states * cos + hidden_states.flip(-1) * sin).tanh() * scale

    x, cos, sin = (torch.randn(64, 32, requires_grad=True) for _ in range(3))
    want = torch.autograd.grad(
        attention(hidden_states=x, position_embeddings=(cos, sin), scale=2.0).sum(), (x, cos, sin)
    )
    freed = []
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as context:
        h = x * 1
        weakref.finalize(h.untyped_storage(), freed.append, "h")
        out = torch_offload.checkpoint(attention, hidden_states=h, position_embeddings=(cos, sin), scale=2.0)
    del h
    assert freed == ["h"]  # only the store's copy is left
    assert context.stats()["packed_bytes"] == 64 * 32 * 4  # h; cos and sin are leaves, saved as they are
    got = torch.autograd.grad(out.sum(), (x, cos, sin))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_disk_tier_training_is_bitwise_equal_and_lowers_peak_rss(tmp_path):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disk_tier_training.py")
    # glibc keeps freed blocks below its dynamic mmap threshold (up to 32 MiB) in
    # the heap, so RSS would not show memory the process gave back; a fixed
    # threshold returns every large tensor's memory on free, in both runs.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 << 10))
    runs = {}
    for mode in ("baseline", "disk"):
        out = tmp_path / f"{mode}.pt"
        subprocess.run([sys.executable, script, mode, str(tmp_path), str(out)], check=True, timeout=600, env=env)
        runs[mode] = torch.load(out)
    baseline, disk = runs["baseline"], runs["disk"]
    assert_bitwise_equal((baseline["losses"], baseline["grads"]), (disk["losses"], disk["grads"]))
    assert disk["stats"]["disk_bytes"] > 0 and disk["stats"]["prefetch_hits"] > 0
    # The baseline holds every activation (~540 MB a step) at the end of forward;
    # seen here: 926 MB without the disk tier, 623 MB with it.
    saved = baseline["peak_rss"] - disk["peak_rss"]
    assert saved > 200 << 20, f"peak RSS {disk['peak_rss']} with the disk tier vs {baseline['peak_rss']} without"


def test_disk_tier_in_process_matches_and_frees_its_files(tmp_path):
    batches = make_batches()
    baseline = train(fresh_model(), batches)
    run = train(
        fresh_model(),
        batches,
        offloaded(tier="disk", spill_directory=str(tmp_path)),
        layer_fn=lambda layer, x: torch_offload.checkpoint(layer, x),
    )
    assert_bitwise_equal(baseline, run)
    for context in run[2]:
        stats = context.stats()
        assert stats["disk_bytes"] > 0 and stats["peak_host_bytes"] == 0 and stats["live_entries"] == 0
    assert os.listdir(tmp_path) == []


TIERS = ("cpu", "disk")


def offload_context(tier, directory, **kwargs):
    """A context that offloads every CPU tensor, to host memory or to the spill file in `directory`."""
    kwargs.setdefault("min_bytes", 0)
    kwargs.setdefault("offload_cpu_tensors", True)
    if tier == "disk":
        kwargs.update(tier="disk", spill_directory=str(directory))
    return torch_offload.offload_activations(**kwargs)


def moved_bytes(context, tier):
    stats = context.stats()
    return stats["disk_bytes"] if tier == "disk" else stats["packed_bytes"] - stats["disk_bytes"]


@pytest.mark.parametrize("tier", TIERS)
def test_conjugate_and_negative_views_come_back_with_their_bit(tier, tmp_path):
    torch.manual_seed(0)
    a = torch.randn(64, dtype=torch.cfloat, requires_grad=True)
    b, c = torch.randn(64, dtype=torch.cfloat), torch.randn(64)

    def loss():  # mul saves b.conj() and the negative view of c for a's gradient
        return (a * b.conj()).real.sum() + (a.imag * torch._neg_view(c)).sum()

    want = torch.autograd.grad(loss(), a)[0]
    with offload_context(tier, tmp_path) as context:
        value = loss()
    assert torch.equal(torch.autograd.grad(value, a)[0], want)
    assert moved_bytes(context, tier) == 64 * 8 + 64 * 4  # both views were offloaded


class Tagged(torch.Tensor):
    pass


@pytest.mark.filterwarnings("ignore:.*(quantized|nested).*:UserWarning")
@pytest.mark.parametrize("tier", TIERS)
def test_what_bytes_cannot_rebuild_is_saved_as_it_is(tier, tmp_path):
    unpacked = []

    class SaveAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *others):
            ctx.save_for_backward(*others)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            unpacked.extend(ctx.saved_tensors)
            return (grad * 2,) + (None,) * len(ctx.saved_tensors)

    saved = [
        torch._efficientzerotensor(16),
        torch.quantize_per_tensor(torch.randn(16), 0.1, 3, torch.quint8),
        torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged),
        torch.randn(4, 4).to_sparse(),
        torch.randn(4, 4).to_mkldnn(),
        torch.randn(16).as_subclass(Tagged),
    ]
    x = torch.randn(16, requires_grad=True)
    with offload_context(tier, tmp_path) as context:
        out = SaveAll.apply(x, *saved)
    out.sum().backward()
    assert context.stats()["packed_bytes"] == 0
    for before, after in zip(saved, unpacked, strict=True):
        assert type(after) is type(before) and after.layout == before.layout
        assert after._is_zerotensor() == before._is_zerotensor() and after.is_nested == before.is_nested
        assert after.is_quantized == before.is_quantized
    assert unpacked[1].q_zero_point() == 3 and torch.equal(unpacked[1].int_repr(), saved[1].int_repr())
    assert torch.equal(unpacked[3].to_dense(), saved[3].to_dense())


@pytest.mark.parametrize("tier", TIERS)
def test_dedup_never_returns_bytes_changed_through_an_alias(tier, tmp_path):
    a = torch.randn(64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)

    def loss():
        x = a * 2
        y = x.sin()  # saves x
        x.data.add_(1)  # x.data has its own version counter: x's version stays 0
        b = x.data
        return y.sum() + (b * w).sum(), b  # saves b: same storage and version as x, other counter

    plain, b = loss()
    plain.backward()
    assert torch.equal(w.grad, b)
    w.grad = None
    # On the disk tier x goes to host memory: its spill would be written from x's
    # own memory after x.data.add_(1) changed it. b is spilled.
    with offload_context(tier, tmp_path, max_host_bytes=64 * 4) as context:
        value, b = loss()
    value.backward()
    assert torch.equal(w.grad, b)
    assert context.stats()["dedup_hits"] == 0 and moved_bytes(context, tier) == 64 * 4


@pytest.mark.parametrize("memory", ["allocator", "numpy"])
@pytest.mark.parametrize("tier", TIERS)
def test_a_storage_saved_again_through_data_refreshes_the_first_copy(tier, memory, tmp_path):
    # x is dropped before backward, so only the copies are left: the first, made before
    # x.data.mul_(2), must hold what eager's saved x holds at backward, the doubled bytes.
    # The CPU allocator's memory is copied when it is freed, so nothing is copied again;
    # memory whose deleter the store does not know (numpy's, pinned memory) at each save.
    a = torch.randn(1000, requires_grad=True)
    w = torch.randn(1000, requires_grad=True)

    def loss():
        x = a * 3
        if memory == "numpy":
            x.data = torch.from_numpy(x.detach().numpy().copy())
        y = x.cos()  # saves x
        x.data.mul_(2)  # through another version counter: x's version stays 0
        z = x.data * w  # saves x.data: the same storage, packed again
        return y.sum() + z.sum()

    want = torch.autograd.grad(loss(), (a, w))
    with offload_context(tier, tmp_path) as context:
        value = loss()
    got = torch.autograd.grad(value, (a, w))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert context.stats()["refreshed_bytes"] == (1000 * 4 if memory == "numpy" else 0)
    assert moved_bytes(context, tier) == 2 * 1000 * 4


@pytest.mark.parametrize("saved", ["tensor", "view"])
@pytest.mark.parametrize("tier", TIERS)
def test_a_storage_changed_through_data_after_its_last_save_is_read_as_eager_reads_it(tier, saved, tmp_path):
    # x.data.mul_(3) changes x's storage after its last save, and no version counter sees it.
    # Eager's saved x.data holds the storage, so its backward reads the tripled bytes; here
    # x is dropped before backward, and the store must have taken its bytes when it was freed.
    a = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)

    def loss():
        x = a * 1.5
        y = x.tanh()
        x.data.add_(0.25)
        if saved == "tensor":
            z = x.data * w
        else:  # a quarter of the storage: its bytes alone are packed
            z = x.data[8:24] * w[8:24]
        x.data.mul_(3)
        return y.sum() + z.sum()

    want = torch.autograd.grad(loss(), (a, w))
    with offload_context(tier, tmp_path) as context:
        value = loss()
    got = torch.autograd.grad(value, (a, w))
    for g, expected in zip(got, want, strict=True):
        torch.testing.assert_close(g, expected, rtol=0, atol=0)
    stats = context.stats()
    assert moved_bytes(context, tier) == 64 * 64 * 4 + (64 * 64 * 4 if saved == "tensor" else 16 * 64 * 4)
    assert stats["live_bytes"] == 0 and stats["live_entries"] == 0


def test_a_storage_freed_after_the_last_save_is_written_to_disk_without_waiting_for_another_save(tmp_path):
    # The freed memory of the step's last saves would otherwise stay in RAM through backward.
    a = torch.randn(1 << 20, requires_grad=True)
    with offload_context("disk", tmp_path) as context:
        x = a * 2
        y = x.sin()  # saves x: its bytes are taken when x is freed
    written = torch_offload.disk_spill_stats()["bytes_written"]
    del x
    deadline = time.monotonic() + 30
    while torch_offload.disk_spill_stats()["bytes_written"] < written + a.nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert torch_offload.disk_spill_stats()["bytes_written"] >= written + a.nbytes
    assert context.stats()["pack_calls"] == 1
    (got,) = torch.autograd.grad(y.sum(), a)
    torch.testing.assert_close(got, 2 * (a * 2).detach().cos(), rtol=0, atol=0)


@pytest.mark.parametrize("tier", TIERS)
def test_a_storage_freed_while_a_lazy_clone_shares_its_memory_is_read_from_that_memory(tier, tmp_path):
    # x's storage is freed, but its memory lives on in a copy-on-write clone: its deleter has not
    # told the store when backward needs x, which is read from that memory, unchanged since.
    a = torch.randn(1000, requires_grad=True)
    with offload_context(tier, tmp_path):
        x = a * 2
        y = x.sin()  # saves x
    x.data.add_(1)  # after the save: eager's backward reads it
    last = x.detach().clone()
    shared = torch._lazy_clone(x)
    del x
    (got,) = torch.autograd.grad(y.sum(), a)
    torch.testing.assert_close(got, 2 * last.cos(), rtol=0, atol=0)
    assert torch.equal(shared, last)


def test_views_of_one_unchanged_storage_are_not_copied_again():
    # A fused projection's output saved as several views (GQA's k, v, then q): k's and v's
    # packs take their own quarters, q's the whole storage, over them. Same counter and
    # version, so q's pack copies neither quarter again.
    a = torch.randn(256, 64, requires_grad=True)
    w = torch.randn(64, 128)
    with offload_context("cpu", None) as context:
        qkv = a @ w  # saves w
        q, k, v = qkv[:128], qkv[128:192], qkv[192:]
        loss = k.cos().sum() + v.sin().sum() + q.sin().sum()  # each saves its view
    loss.backward()
    stats = context.stats()
    assert stats["refreshed_bytes"] == 0
    quarter = 64 * 128 * 4
    assert stats["packed_bytes"] == quarter + 2 * quarter + 4 * quarter  # w, the quarters, the whole


@pytest.mark.parametrize("tier", TIERS)
def test_a_kept_tensor_changed_through_data_before_backward_is_read_as_eager_reads_it(tier, tmp_path):
    a = torch.randn(1 << 16, requires_grad=True)

    def loss():
        x = a * 2
        return x.sin().sum(), x  # sin saves x; the caller keeps x

    want_loss, x = loss()
    x.data.add_(1)  # no version counter sees this: eager's backward reads the changed bytes
    (want,) = torch.autograd.grad(want_loss, a)
    with offload_context(tier, tmp_path) as context:
        value, x = loss()
    x.data.add_(1)
    (got,) = torch.autograd.grad(value, a)
    assert moved_bytes(context, tier) == x.numel() * 4  # x was offloaded, yet its live storage is served
    assert torch.equal(got, want)


def test_checkpointed_function_gets_the_callers_lists_and_dicts():
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x, aux_losses, cache):
        aux_losses.append(x.pow(2).mean())  # e.g. a router's load-balancing loss
        cache["last"] = x.detach()
        return layer(x).relu()

    aux_losses, cache = [], {}
    out = torch_offload.checkpoint(block, x, aux_losses, cache)
    assert len(aux_losses) == 1 and cache["last"] is not None
    (out.sum() + aux_losses[0]).backward()  # the recomputation does not append again
    assert len(aux_losses) == 1
    want = torch.autograd.grad(block(x, [], {}).sum() + x.pow(2).mean(), x)[0]
    torch.testing.assert_close(x.grad, want)


def test_prefetch_looks_at_each_entry_about_once_per_backward():
    # Small tensors never fill prefetch_bytes: a scan that started over below each
    # restored entry would look at ~n^2/2 entries.
    n = 2000
    for prefetch_bytes in (256 << 20, 2 * 256 * 4):
        stats = sin_chain_stats(prefetch_bytes=prefetch_bytes, length=n)
        assert stats["prefetch_hits"] == n - 1
        assert stats["prefetch_scanned"] <= 2 * n


def test_tensors_left_in_place_never_reach_the_store():
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    for options in ({}, {"offload_cpu_tensors": True}, {"min_bytes": 0}):  # CPU tensors or small ones
        with torch_offload.offload_activations(**options) as context:
            linear(x).relu().sum().backward()
        assert context.stats()["pack_calls"] == 0
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as context:
        linear(x).relu().sum().backward()
    # x and the relu output; the weight (saved as a view of a parameter) stays in Python.
    assert context.stats()["pack_calls"] == 2


@pytest.mark.parametrize("tier", TIERS)
def test_a_small_view_of_a_large_storage_packs_only_its_bytes(tier, tmp_path):
    leaf = torch.randn(512, 512, requires_grad=True)

    def loss():
        h = leaf * 1  # 1 MiB, saved by nothing
        return h[100, 64:].sin().sum() + h[:, 7].cos().sum()  # one contiguous, one strided view

    want = torch.autograd.grad(loss(), leaf)[0]
    with offload_context(tier, tmp_path) as context:
        value = loss()
    assert torch.equal(torch.autograd.grad(value, leaf)[0], want)
    row_bytes = (512 - 64) * 4
    column_bytes = (511 * 512 + 1) * 4  # spans almost the whole storage: the whole storage goes
    assert moved_bytes(context, tier) == row_bytes + 512 * 512 * 4
    assert column_bytes > 512 * 512 * 4 // 4
    # Saved after the whole storage, the view shares it.
    with offload_context(tier, tmp_path) as context:
        h = leaf * 1
        value = h.sin().sum() + h[100, 64:].cos().sum()
    value.backward()
    assert moved_bytes(context, tier) == 512 * 512 * 4 and context.stats()["dedup_hits"] == 1


def test_disk_tier_offloads_cpu_tensors_by_default(tmp_path):
    x = torch.randn(1024, requires_grad=True)
    want = torch.autograd.grad((x * 2).sin().sum(), x)[0]
    with torch_offload.offload_activations(tier="disk", min_bytes=0, spill_directory=str(tmp_path)) as context:
        value = (x * 2).sin().sum()
    assert torch.equal(torch.autograd.grad(value, x)[0], want)
    assert context.stats()["disk_bytes"] == 1024 * 4


def test_a_tensor_given_new_data_is_not_deduplicated_with_its_old_bytes():
    a = torch.randn(64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    with torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0) as context:
        x = a * 2
        y = x.sin()  # saves x
        x.data = torch.randn(64)  # same version counter, same version, another storage
        z = x * w  # saves x again
    (y.sum() + z.sum()).backward()
    assert torch.equal(w.grad, x.detach())
    assert context.stats()["dedup_hits"] == 0
    del y, z
    assert context.stats()["live_entries"] == 0 and context.stats()["host_bytes"] == 0
