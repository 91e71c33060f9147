"""Where the bytes per token of an applied training step live at its peak: a trace of live tensor storages.

    .venv/bin/python bench/live_tensors.py [--tokens 16384,32768] [--hidden 512 --intermediate 1408 --layers 8]
                                           [--write]

The demo's Llama (vocabulary 32K, float32, random weights) with `torch_offload.apply(model, chunk_recurrent=False)`
(the layers offloaded to the disk tier: the path the chunk-recurrent step, apply's default here, replaces) takes
one training step of one row of T tokens in a fresh process per T, after a 128-token warm-up step, in no
special environment (glibc's defaults, as users run it), under `torch.profiler` with memory and Python stacks: every
CPU allocation through PyTorch's allocator (C++ kernels' temporaries included), with its owner: the phase (forward,
backward), the innermost module whose code runs (a checkpoint's recompute included), the outermost op of this
library (else the outermost op) and the op that allocated. At the step's largest total of live allocations it sums
them by owner; two lengths give each owner's bytes per token, its growth over the growth of T. Not traced: what the
disk tier's I/O threads free (see live_at_peak) and memory from outside PyTorch's allocator (the tier's restore
buffers): the last row is the resident set's growth (VmHWM) beside the traced total.
"""

import argparse
import collections
import json
import subprocess
import sys

from measure import demo_llama, machine, reset_peak_rss, status_bytes, write_section

TOP = 12  # owners listed, by bytes per token
HANDED = "handed to the store"
TITLE = "Live tensors at the peak of an applied step"


def trace(tokens, hidden, intermediate, layers):
    import torch
    from torch._C._profiler import _EventType

    import torch_offload

    torch.manual_seed(0)
    model = demo_llama(hidden, intermediate, layers, tokens).train()
    handle = torch_offload.apply(model, chunk_recurrent=False)  # the store's tensors are marked below

    def step(length):
        ids = torch.randint(3, 32000, (1, length), generator=torch.Generator().manual_seed(1))
        with torch.profiler.record_function("forward"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with torch.profiler.record_function("backward"):
            loss.backward()
        model.zero_grad(set_to_none=True)

    step(128)
    # Each tensor handed to the store is marked in the trace (see live_at_peak).
    store_pack = handle.context._store_pack

    def marked_pack(tensor):
        with torch.profiler.record_function(f"{HANDED} {tensor.untyped_storage().data_ptr()}"):
            return store_pack(tensor)

    handle.context._store_pack = marked_pack
    before = reset_peak_rss()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True, with_stack=True) as profile:
        step(tokens)
    rss = status_bytes("VmHWM") - before
    handle.remove()
    events = []  # (time, "alloc", "free" or "handed", address, bytes, (module, ops outermost first))
    names = {id(m): n or "model" for n, m in model.named_modules()}
    phases = []  # (start, end, "forward" or "backward"): with Python stacks, ops nest in Python calls, not in these

    def walk(event, ops, module):
        kind, fields = event.typed
        try:
            name = event.name
        except UnicodeDecodeError:  # a few Python calls' names
            name = "?"
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            what = "alloc" if fields.alloc_size > 0 else "free"
            events.append((event.start_time_ns, what, fields.ptr, abs(fields.alloc_size), (module, *ops)))
        elif name.startswith(HANDED):
            events.append((event.start_time_ns, "handed", int(name.split()[-1]), 0, None))
        elif kind == _EventType.TorchOp and name in ("forward", "backward"):
            phases.append((event.start_time_ns, event.end_time_ns, name))
        elif kind == _EventType.PyCall and fields.module is not None:
            module = names.get(fields.module.self_ptr, module)
        for child in event.children:
            walk(child, ops + (name,) if kind == _EventType.TorchOp else ops, module)

    for root in profile.profiler.kineto_results.experimental_event_tree():
        walk(root, (), "no module")
    phase = lambda when: next((p for start, end, p in phases if start <= when <= end), "outside")  # noqa: E731
    peak, at_peak = live_at_peak([(*e[:4], e[4] and (phase(e[0]), *e[4])) for e in events])
    owners = collections.Counter()
    for nbytes, context in at_peak:
        owners[owner(context)] += nbytes
    return dict(peak=peak, rss=rss, owners=owners)


def live_at_peak(events):
    """The largest total of live allocations in the trace and what was live then (bytes, context). An allocation whose
    free the trace lacks was freed where the profiler does not look: by the disk tier's I/O threads once it was handed
    to the store (the tier holds at most max_in_flight_bytes of them unwritten), and in any case before its address was
    allocated again."""
    events.sort(key=lambda e: e[0])
    unseen_free, open_at = set(), {}  # events' indices; address: its live allocation's index
    for index, (_, what, address, _, _) in enumerate(events):
        if what == "alloc":
            if address in open_at:
                unseen_free.add(open_at[address])
            open_at[address] = index
        elif what == "free":
            open_at.pop(address, None)
    unseen_free.update(open_at.values())
    live, total, peak, at_peak = {}, 0, 0, []
    for index, (_, what, address, nbytes, context) in enumerate(events):
        if address in live and (what != "handed" or live[address][0] in unseen_free):
            total -= live.pop(address)[1]  # freed, handed to the tier, or its address allocated again
        if what == "alloc":
            live[address] = (index, nbytes, context)
            total += nbytes
        if total > peak:
            peak, at_peak = total, [(n, c) for _, n, c in live.values()]
    return peak, at_peak


def owner(context):
    """The phase, the innermost module running, the outermost op of this library (else the outermost op) and the op
    that allocated."""
    phase, module, *ops = context
    outer = next((op for op in ops if op.startswith("offload::")), ops[0] if ops else "no op")
    return f"{phase}, {module}: {outer}" + (f" > {ops[-1]}" if ops and ops[-1] != outer else "")


def per_token(results):
    """Each owner's live bytes at the peak: growth per token between the shortest and longest length."""
    (short, a), (long, b) = results[0], results[-1]
    owners = set(a["owners"]) | set(b["owners"])
    growth = {o: (b["owners"].get(o, 0) - a["owners"].get(o, 0)) / (long - short) for o in owners}
    return sorted(growth.items(), key=lambda item: -item[1])


def table(results, args):
    lengths = [t for t, _ in results]
    head = " | ".join(f"{t // 1024}K MiB" for t in lengths)
    rows = [
        f"| phase, module: outermost op > allocating op | {head} | bytes per token |",
        "| --- |" + " ---: |" * (len(lengths) + 1),
    ]
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    for owner, slope in per_token(results)[:TOP]:
        rows.append(
            f"| {owner} | " + " | ".join(mib(r["owners"].get(owner, 0)) for _, r in results) + f" | {slope:.0f} |"
        )
    (short, a), (long, b) = results[0], results[-1]
    for label, key in (("every traced storage at the peak", "peak"), ("resident set growth (VmHWM)", "rss")):
        rows.append(
            f"| **{label}** | "
            + " | ".join(mib(r[key]) for _, r in results)
            + f" | {(b[key] - a[key]) / (long - short):.0f} |"
        )
    command = "`.venv/bin/python bench/live_tensors.py " + " ".join(sys.argv[1:]) + "`"
    return (
        f"## {TITLE}\n\n{command} ({machine()}). The demo's Llama (hidden {args.hidden}, MLP {args.intermediate}, "
        f"{args.layers} layers, vocabulary 32K, float32) with `apply(model, chunk_recurrent=False)`, one training "
        "step per fresh process in no special environment, under `torch.profiler` (memory, Python stacks). The "
        "allocations live at the step's largest total, summed by owner (phase, innermost module, outermost op, "
        f"allocating op), the {TOP} that grow most with T; bytes per token is an owner's growth over the growth of T. "
        "Not traced: what the disk tier's I/O threads free (counted as freed when handed to the store) and memory "
        "from outside PyTorch's allocator (the restore buffers): the resident set's growth is the last row.\n\n"
        + "\n".join(rows)
        + "\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16384,32768")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        json.dump(trace(args.run, args.hidden, args.intermediate, args.layers), sys.stdout)
        return
    results = []
    for tokens in map(int, args.tokens.split(",")):
        command = [sys.executable, __file__, "--run", str(tokens)]
        for option in ("hidden", "intermediate", "layers"):
            command += [f"--{option}", str(getattr(args, option))]
        results.append((tokens, json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)))
        print(
            tokens, results[-1][1]["peak"] >> 20, "MiB traced", results[-1][1]["rss"] >> 20, "MiB resident", flush=True
        )
    text = table(results, args)
    print(text)
    if args.write:
        write_section(TITLE, text)


if __name__ == "__main__":
    main()
