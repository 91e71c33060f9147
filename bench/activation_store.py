"""Per-tensor cost of offload_activations' hooks against torch.autograd.graph.save_on_cpu.

    python bench/activation_store.py [--counts 1000 10000] [--elements 16 4096] [--repeats 5]

A chain of N `h = h.sin()` on the CPU saves N tensors of E float32 elements; each
mode runs forward and backward of the chain, and its cost per saved tensor is
(its time - the time with no hooks) / N, i.e. the pack and unpack hooks' cost
(copies included). Modes:
  save_on_cpu    torch.autograd.graph.save_on_cpu(): the baseline of the ratios;
  offloaded      offload_activations(offload_cpu_tensors=True, min_bytes=0): every
                 tensor copied into the store's host memory and back;
  left in place  offload_activations(): CPU tensors stay where they are (tier "cpu").
The same per-tensor cost at 1K and 10K tensors means pack and unpack do not grow
with the number of saved tensors. Runs are interleaved and the median is kept.
Prints a Markdown table.
"""
import argparse
import contextlib
import statistics
import time

import torch

import torch_offload

MODES = {
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
    "offloaded": lambda: torch_offload.offload_activations(offload_cpu_tensors=True, min_bytes=0),
    "left in place": torch_offload.offload_activations,
}


def chain_seconds(context_factory, count, elements):
    h = torch.randn(elements, requires_grad=True) * 1  # not a leaf: a leaf that requires grad stays put
    start = time.perf_counter()
    with context_factory():
        for _ in range(count):
            h = h.sin()
    h.sum().backward()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--elements", type=int, nargs="+", default=[16, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = {"none": contextlib.nullcontext, **MODES}
    print(f"torch {torch.__version__}, CPU, 1 thread, median of {args.repeats} interleaved runs")
    print()
    print("| saved tensors | bytes each | mode | µs per tensor | ratio to save_on_cpu |")
    print("| ---: | ---: | --- | ---: | ---: |")
    for elements in args.elements:
        for count in args.counts:
            chain_seconds(MODES["offloaded"], count, elements)  # warm up allocators
            times = {name: [] for name in modes}
            for _ in range(args.repeats):
                for name, factory in modes.items():
                    times[name].append(chain_seconds(factory, count, elements))
            bare = statistics.median(times["none"])
            cost = {name: (statistics.median(times[name]) - bare) / count * 1e6 for name in MODES}
            for name in MODES:
                print(f"| {count:,} | {elements * 4:,} | {name} | {cost[name]:.1f} | "
                      f"{cost[name] / cost['save_on_cpu']:.2f} |")


if __name__ == "__main__":
    main()
