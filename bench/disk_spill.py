"""Disk tier bandwidth, side by side in one run on one directory.

    python bench/disk_spill.py [--dir DIR] [--tensors 8] [--mib 256] [--repeats 5] [--gap SECONDS]

Measures, on DIR's file system:
  raw     dd with oflag=direct / iflag=direct: the disk's own sequential bandwidth, in
          each round right after the spills (write) and right before the restores (read),
          so that both sides meet the disk in the same minute and read data written
          seconds earlier; the ratios are the median of the rounds' own ratios;
  spill   torch_offload.disk_spill of N tensors until all are on disk, then
          disk_restore of each as backward does it: newest first, two tensors
          prefetched ahead, each let go once used; with the default settings every
          restore lands in fresh memory, which the kernel (and a VM's hypervisor)
          must fault in and zero;
  cache   the same with restore_cache_bytes of two tensors: a freed restore buffer
          serves a later restore of that size;
  all at once  disk_prefetch of all, then disk_restore of all, all kept;
  save    torch.save / torch.load of one file per tensor from a 4-thread pool, the
          method in use today; fsync'd, and evicted from the page cache before loading,
          so both sides are measured against the disk, not RAM.
And CPU-seconds per GB moved by the spill engine with and without checksums.
A virtual disk's bandwidth varies from run to run: every measurement is taken
--repeats times, interleaved, and the median is reported. Prints a Markdown table
of GB/s and ratios.
"""

import argparse
import concurrent.futures
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch

import torch_offload


def dd_bandwidth(args):
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    value, unit = re.search(r"([\d.]+) ([kMG]?B)/s", out).groups()
    return float(value) * {"kB": 1e-6, "MB": 1e-3, "GB": 1.0, "B": 1e-9}[unit]


def dd_write(path, total_mib):
    return dd_bandwidth(
        ["if=/dev/zero", f"of={path}", "bs=8M", f"count={total_mib // 8}", "oflag=direct", "conv=fsync"]
    )


def dd_read(path):
    return dd_bandwidth([f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"])


def spill_all(directory, tensors):
    tickets = [torch_offload.disk_spill(t, directory=directory) for t in tensors]
    for ticket in tickets:
        torch_offload.disk_wait(ticket)
    return tickets


def spill_round(directory, tensors, gap=0.0, window=2, verify=False, beside=None):
    """Spill all, wait `gap` seconds (the rest of forward, untimed), then restore as backward
    does: newest first, `window` tensors prefetched ahead, each let go once used (its buffer
    serves a later restore). `beside(phase)`, where given, runs right after the spills and
    right after the gap, so `dd` is measured in the same minute as the tier each way."""
    start = time.perf_counter()
    tickets = spill_all(directory, tensors)
    spill_seconds = time.perf_counter() - start
    if beside:
        beside("write")
    time.sleep(gap)
    if beside:
        beside("read")
    spilled = time.perf_counter()
    order = list(reversed(range(len(tensors))))
    for i in order[:window]:
        torch_offload.disk_prefetch(tickets[i])
    for position, i in enumerate(order):
        restored = torch_offload.disk_restore(tickets[i], tensors[i].shape, tensors[i].dtype, "cpu")
        assert not verify or torch.equal(restored, tensors[i])
        del restored
        if position + window < len(order):
            torch_offload.disk_prefetch(tickets[order[position + window]])
    end = time.perf_counter()
    return spill_seconds, end - spilled


def paired_round(directory, tensors, gap):
    """One round of the tier against `dd` on the same bytes: `dd` writes its probe right after
    the spills and reads it back right after the gap, just before the restores, so both reads
    find data written seconds earlier, after other writes. Returns GB/s: dd write, spill,
    dd read, restore."""
    probe = os.path.join(directory, "dd_probe")
    total_mib = sum(t.numel() * t.element_size() for t in tensors) >> 20
    raw = {}

    def beside(phase):
        raw[phase] = dd_write(probe, total_mib) if phase == "write" else dd_read(probe)

    try:
        spill_seconds, restore_seconds = spill_round(directory, tensors, gap, beside=beside)
    finally:
        os.unlink(probe)
    gb = total_mib * 2**20 / 1e9
    return raw["write"], gb / spill_seconds, raw["read"], gb / restore_seconds


def spill_round_with_cache(directory, tensors, gap):
    torch_offload.configure_disk_spill(restore_cache_bytes=2 * tensors[0].numel() * tensors[0].element_size())
    try:
        return spill_round(directory, tensors, gap)
    finally:
        torch_offload.configure_disk_spill()


def restore_all_at_once(directory, tensors, gap):
    """Prefetch everything, then restore and keep everything: every restore needs fresh memory."""
    tickets = spill_all(directory, tensors)
    time.sleep(gap)
    start = time.perf_counter()
    for ticket in tickets:
        torch_offload.disk_prefetch(ticket)
    restored = [torch_offload.disk_restore(k, t.shape, t.dtype, "cpu") for k, t in zip(tickets, tensors)]
    end = time.perf_counter()
    assert all(torch.equal(a, b) for a, b in zip(restored, tensors))
    return end - start


def save_one(path, tensor):
    with open(path, "wb") as f:
        torch.save(tensor, f)
        f.flush()
        os.fsync(f.fileno())


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def save_round(directory, tensors):
    paths = [os.path.join(directory, f"t{i}.pt") for i in range(len(tensors))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        start = time.perf_counter()
        list(pool.map(save_one, paths, tensors))
        saved = time.perf_counter()
        for path in paths:
            evict(path)
        loaded_start = time.perf_counter()
        loaded = list(pool.map(lambda p: torch.load(p), paths))
        end = time.perf_counter()
    assert all(torch.equal(a, b) for a, b in zip(loaded, tensors))
    for path in paths:
        os.unlink(path)
    return saved - start, end - loaded_start


def cpu_seconds_per_gb(directory, tensors, checksums):
    torch_offload.configure_disk_spill(checksums=checksums)
    start = time.process_time()
    spill_round(directory, tensors)
    used = time.process_time() - start
    torch_offload.configure_disk_spill()
    return used / (2 * sum(t.numel() * t.element_size() for t in tensors) / 1e9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: temp dir)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="seconds between the spills and the restores, as the rest of forward takes in training: "
        "long enough for a VM to hand freed memory back to its hypervisor",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        tensors = [torch.randn(args.mib << 18) for _ in range(args.tensors)]  # float32: mib MiB each
        gb = sum(t.numel() * 4 for t in tensors) / 1e9
        spill_round(directory, tensors, verify=True)  # warm up (file, threads) and check every byte
        runs = {"paired": [], "cache": [], "save": [], "all_at_once": []}
        for _ in range(args.repeats):
            runs["paired"].append(paired_round(directory, tensors, args.gap))
            runs["cache"].append(spill_round_with_cache(directory, tensors, args.gap))
            runs["all_at_once"].append((restore_all_at_once(directory, tensors, args.gap),))
            runs["save"].append(save_round(directory, tensors))
        median = {k: [statistics.median(column) for column in zip(*v)] for k, v in runs.items()}
        raw_write, spill_write, raw_read, spill_read = median["paired"]
        write_ratio = statistics.median(spill / raw for raw, spill, _, _ in runs["paired"])
        read_ratio = statistics.median(restore / raw for _, _, raw, restore in runs["paired"])
        both_ratio = statistics.median((1 / rw + 1 / rr) / (1 / sw + 1 / sr) for rw, sw, rr, sr in runs["paired"])
        _, cache_read = median["cache"]
        save_write, save_read = median["save"]
        (all_at_once_read,) = median["all_at_once"]
        cpu_with = cpu_seconds_per_gb(directory, tensors, True)
        cpu_without = cpu_seconds_per_gb(directory, tensors, False)
    rows = [
        ("raw disk (dd, O_DIRECT), beside each spill and restore", raw_write, raw_read),
        (
            f"disk_spill / disk_restore ({args.tensors} x {args.mib} MiB, backward order)",
            spill_write,
            spill_read,
        ),
        ("the same with restore_cache_bytes of two tensors (freed buffers reused)", None, gb / cache_read),
        ("disk_restore of all at once into fresh memory", None, gb / all_at_once_read),
        ("torch.save / torch.load, 4 threads, 1 file per tensor", gb / save_write, gb / save_read),
    ]
    print(
        f"directory: {args.dir or tempfile.gettempdir()}, {gb:.2f} GB per direction, "
        f"median of {args.repeats} interleaved runs, {args.gap:g} s between spills and restores\n"
    )
    print("| method | write GB/s | read GB/s |")
    print("| --- | --- | --- |")
    for name, write, read in rows:
        print(f"| {name} | {'' if write is None else f'{write:.2f}'} | {read:.2f} |")
    print()
    print(
        "spill vs raw disk, median of the rounds' ratios: "
        f"write {write_ratio:.2f}x, read {read_ratio:.2f}x, spill + restore {both_ratio:.2f}x"
    )
    rounds = "; ".join(", ".join(f"{x:.2f}" for x in r) for r in runs["paired"])
    print(f"each round (dd write, spill, dd read, restore, GB/s): {rounds}")
    print(
        "spill vs torch.save baseline: "
        f"write {spill_write * save_write / gb:.2f}x, read {spill_read * save_read / gb:.2f}x"
    )
    print(f"restore cache on: read {gb / cache_read / raw_read:.2f}x raw disk, {gb / cache_read / spill_read:.2f}x off")
    print(
        f"all at once into fresh memory: read {gb / all_at_once_read / raw_read:.2f}x raw disk, "
        f"{save_read / all_at_once_read:.2f}x torch.load"
    )
    print(f"CPU-seconds per GB moved: {cpu_with:.3f} with checksums, {cpu_without:.3f} without")
    print(f"restores that reused a kept buffer: {torch_offload.disk_spill_stats()['restore_cache_hits']}")


if __name__ == "__main__":
    main()
