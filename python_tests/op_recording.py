"""What the tests of the tiled ops share: which gradients a backward op was asked for, how many GEMMs ran and how
much work they did, and the most bytes held at once."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RecordBackwardMask(TorchDispatchMode):
    """Records the output_mask argument of every call of `op`."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.masks.append(list(args[[a.name for a in func._schema.arguments].index("output_mask")]))
        return func(*args, **(kwargs or {}))


def gemm_count(fn):
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::addmm_"))


def gemm_flops(fn):
    """Multiply-adds of every GEMM fn runs (aten::mm, addmm, addmm_: [m, k] @ [k, n] is m * k * n)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    total = 0
    for event in prof.events():
        if event.name in ("aten::mm", "aten::addmm", "aten::addmm_"):
            first = 0 if event.name == "aten::mm" else 1  # addmm's operands follow the added tensor
            (m, k), (_, n) = event.input_shapes[first : first + 2]
            total += m * k * n
    return total


def peak_allocated_bytes(fn):
    """The most bytes fn holds allocated at once (CPU allocator, as the profiler records it)."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    ):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


class CountCalls(TorchDispatchMode):
    """Counts the calls of each op in `ops` (as dispatched below autograd: once per call)."""

    def __init__(self, *ops):
        super().__init__()
        self.counts = {op: 0 for op in ops}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.counts:
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))
