"""What the backward tests of the tiled ops share: which gradients a backward op was asked for, and how many GEMMs ran."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RecordBackwardMask(TorchDispatchMode):
    """Records the output_mask (its last argument) of every call of `op`."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.masks.append(list(args[-1]))
        return func(*args, **(kwargs or {}))


def gemm_count(fn):
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::addmm_"))


class CountCalls(TorchDispatchMode):
    """Counts the calls of each op in `ops` (as dispatched below autograd: once per call)."""

    def __init__(self, *ops):
        super().__init__()
        self.counts = {op: 0 for op in ops}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.counts:
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))
