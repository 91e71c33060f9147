"""Per-tensor cost of offload_activations' hooks against torch.autograd.graph.save_on_cpu's.

    python bench/activation_store.py [--counts 1000 10000] [--elements 16 4096] [--repeats 7]

N CPU float32 tensors of E elements go through a mode's pack hook, in order, then
back through its unpack hook, newest first, as backward does (so the store's
prefetch runs as in training). Reported: (pack + unpack time) / N. Modes:
  save_on_cpu    torch.autograd.graph.save_on_cpu(): the baseline of the ratios;
  offloaded      offload_activations(offload_cpu_tensors=True, min_bytes=0): every
                 tensor copied into the store's host memory and back;
  left in place  offload_activations(): CPU tensors stay where they are (tier "cpu").
The same per-tensor cost at 1K and 10K tensors means pack and unpack do not grow
with the number of saved tensors. Modes take turns; each cell is the median.
Prints a Markdown table.
"""

import argparse
import statistics
import time

import torch

import torch_offload
from torch_offload.activations import _unpack

MODES = {
    "save_on_cpu": lambda: (lambda hooks: (hooks.pack_hook, hooks.unpack_hook))(torch.autograd.graph.save_on_cpu()),
    "offloaded": lambda: (torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0)._pack, _unpack),
    "left in place": lambda: (torch_offload.offload_activations()._pack, _unpack),
}


def round_trip_seconds(make_hooks, tensors):
    pack, unpack = make_hooks()
    start = time.perf_counter()
    packed = [pack(t) for t in tensors]
    for saved in reversed(packed):
        unpack(saved)
    seconds = time.perf_counter() - start
    del packed
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--elements", type=int, nargs="+", default=[16, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread, median of {args.repeats} interleaved runs")
    print()
    print("| saved tensors | bytes each | mode | µs per tensor (pack + unpack) | ratio to save_on_cpu |")
    print("| ---: | ---: | --- | ---: | ---: |")
    for elements in args.elements:
        for count in args.counts:
            # Activations are outputs of earlier ops: not leaves (a leaf that requires grad stays put).
            source = torch.randn(elements, requires_grad=True)
            tensors = [source * 1 for _ in range(count)]
            times = {name: [] for name in MODES}
            for _ in range(args.repeats + 1):  # the first round warms up allocators and is dropped
                for name, make_hooks in MODES.items():
                    times[name].append(round_trip_seconds(make_hooks, tensors))
            cost = {name: statistics.median(seconds[1:]) / count * 1e6 for name, seconds in times.items()}
            for name in MODES:
                print(
                    f"| {count:,} | {elements * 4:,} | {name} | {cost[name]:.1f} | "
                    f"{cost[name] / cost['save_on_cpu']:.2f} |"
                )


if __name__ == "__main__":
    main()
