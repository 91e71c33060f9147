"""torch.compile of an applied model: one training step's time and peak memory, eager apply()
against torch.compile(model, fullgraph=True) after apply(), on the demo's Llama (examples/demo.py:
hidden 256, MLP 704, 4 layers, vocabulary 32K on the CPU; hidden 1024, MLP 2816, 8 layers on a GPU),
on one sequence and on 4 packed documents (position_ids restarting; bench/real_batches.py's batches).

    .venv/bin/python bench/compile.py [--tokens 2048,4096] [--rounds 3] [--offload none,disk] [--device cpu|cuda]
                                      [--batches "one sequence,packed"]
                                      [--write]   # --write: rewrites BENCHMARKS.md's section

(with the package installed, e.g. by `make test`; or PYTHONPATH and TORCH_OFFLOAD_LIBRARY pointing at a build).

Each measurement runs in a fresh process: a first step at the measured length (compiling,
for the compiled model) is left out; the second step gives the time and the peak memory
(growth of the resident set, VmHWM with the high-water mark reset just before it, glibc's mmap
threshold fixed at 1 MiB; on a GPU max_memory_allocated over memory_allocated before it). The disk
tier's unwritten bytes are capped at 32 MiB and it keeps no restore buffers, as in real_batches.py.
Eager and compiled take turns, round after round; each cell is the median over the rounds.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from measure import demo_llama, measured_step, worker_env, write_section
from real_batches import batch

METHODS = ("eager", "compiled")


def worker(method, tokens, offload, device, kind):
    import torch

    import torch_offload

    gpu = device.startswith("cuda")
    hidden, intermediate, layers = (1024, 2816, 8) if gpu else (256, 704, 4)
    torch.manual_seed(0)
    model = demo_llama(hidden, intermediate, layers, tokens).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    spill = tempfile.TemporaryDirectory()
    tier = None if offload == "none" else offload
    options = {} if tier is None else dict(min_bytes=1 << 16)  # apply refuses options a configuration ignores
    if tier == "disk":
        options["spill_directory"] = spill.name
        torch_offload.configure_disk_spill(max_in_flight_bytes=32 << 20, restore_cache_bytes=0)
    torch_offload.apply(model, offload=tier, **options)
    run = torch.compile(model, fullgraph=True) if method == "compiled" else model
    inputs = {name: t.to(device) for name, t in batch(kind, tokens).items()}

    def step():
        loss = run(**inputs, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    loss, seconds, peak_bytes = measured_step(step, gpu)
    spill.cleanup()
    return {"loss": loss, "seconds": seconds, "peak_bytes": peak_bytes}


def measure(method, tokens, offload, device, kind):
    command = [
        sys.executable,
        __file__,
        "--worker",
        method,
        "--tokens",
        str(tokens),
        "--offload",
        offload,
        "--device",
        device,
        "--batches",
        kind,
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=worker_env()).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--offload", default="none,disk", help="apply()'s offload tiers to compare under: none, cpu, disk"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="one sequence,packed", help="of real_batches.py: one sequence, packed")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, int(args.tokens), args.offload, args.device, args.batches)))
        return
    rows = []
    for kind in args.batches.split(","):
        for offload in args.offload.split(","):
            for tokens in map(int, args.tokens.split(",")):
                runs = {method: [] for method in METHODS}
                for _ in range(args.rounds):
                    for method in METHODS:
                        runs[method].append(measure(method, tokens, offload, args.device, kind))
                seconds, peak = (
                    {m: statistics.median(r[key] for r in runs[m]) for m in METHODS}
                    for key in ("seconds", "peak_bytes")
                )
                rows.append(
                    f"| {kind} | {offload} | {tokens} | {seconds['eager']:.3f} | {seconds['compiled']:.3f} | "
                    f"**{seconds['compiled'] / seconds['eager']:.2f}** | {peak['eager'] / 2**20:.0f} | "
                    f"{peak['compiled'] / 2**20:.0f} | **{peak['compiled'] / peak['eager']:.2f}** | "
                    f"{runs['eager'][0]['loss']:.4f} / {runs['compiled'][0]['loss']:.4f} |"
                )
                print(rows[-1], flush=True)
    text = (
        "## torch.compile of an applied model\n\n"
        f"`python bench/compile.py --tokens {args.tokens} --rounds {args.rounds} --offload {args.offload} "
        f'--device {args.device} --batches "{args.batches}" --write` on '
        f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores: one training step (SGD) of the demo's Llama after `apply()`, eager against "
        "`torch.compile(model, fullgraph=True)` (inductor), median of the rounds, each in a fresh process; peaks "
        "are the resident set's growth with glibc's mmap threshold at 1 MiB.\n\n"
        "| batch | offload | tokens | eager s | compiled s | compiled / eager time | eager peak MiB | "
        "compiled peak MiB | compiled / eager peak | loss eager / compiled |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n" + "\n".join(rows) + "\n"
    )
    if args.write:
        write_section("torch.compile of an applied model", text)
    else:
        print(text)


if __name__ == "__main__":
    main()
