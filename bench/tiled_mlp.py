"""tiled_mlp on the CPU: peak memory and fwd+bwd time against the eager untiled MLP and the
published algorithm in plain Python (bench/tiled_mlp_baseline.py), float32, h=1024, I=2816.

    .venv/bin/python bench/tiled_mlp.py   # all sizes; rewrites BENCHMARKS.md's tiled_mlp section

(with the package installed, e.g. by `make test`; or PYTHONPATH and TORCH_OFFLOAD_LIBRARY pointing at a build).

Each measurement runs in a fresh process: its first fwd+bwd gives the peak memory, the
growth of the process's resident set over that run (VmHWM after it, with the high-water
mark reset to VmRSS just before it; x, the weights and grad_out already allocated); a
second fwd+bwd gives the time. The methods take turns,
round after round, so that drifting load on a shared machine hits them alike; each
cell is the median over the rounds. The Python baseline uses the op's automatic shard
count, so both tile alike; `--shards N` gives both N shards (`--tokens 32768 --shards 16 --no-write`: issue 72's point).
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

from measure import ROOT, reset_peak_rss, status_bytes, write_section

HIDDEN, INTERMEDIATE = 1024, 2816
TOKENS = (4096, 16384, 32768)
METHODS = ("eager", "tiled_mlp", "python")


def worker(method, tokens, num_shards):
    import torch
    import torch.nn.functional as F
    from tiled_mlp_baseline import python_tiled_mlp
    from torch import nn

    import torch_offload

    torch.manual_seed(0)
    mlp = nn.ModuleDict(
        {
            "gate_proj": nn.Linear(HIDDEN, INTERMEDIATE, bias=False),
            "up_proj": nn.Linear(HIDDEN, INTERMEDIATE, bias=False),
            "down_proj": nn.Linear(INTERMEDIATE, HIDDEN, bias=False),
        }
    )

    def eager(x):
        return mlp["down_proj"](F.silu(mlp["gate_proj"](x)) * mlp["up_proj"](x))

    step = {
        "eager": eager,
        "tiled_mlp": lambda x: torch_offload.tiled_mlp(
            x, mlp["gate_proj"].weight, mlp["up_proj"].weight, mlp["down_proj"].weight, num_shards=num_shards
        ),
        "python": lambda x: python_tiled_mlp(eager, x, num_shards),
    }[method]
    x = torch.randn(tokens, HIDDEN, requires_grad=True)
    grad_out = torch.randn(tokens, HIDDEN)

    def fwd_bwd():
        for p in [x, *mlp.parameters()]:
            p.grad = None
        step(x).backward(grad_out)

    before = reset_peak_rss()
    fwd_bwd()
    peak = status_bytes("VmHWM") - before
    start = time.perf_counter()
    fwd_bwd()
    print(f"{peak} {time.perf_counter() - start}")


def run(method, tokens, num_shards):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, __file__, "--worker", method, str(tokens), str(num_shards)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return int(out[0]), float(out[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "TOKENS", "SHARDS"))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=0, help="both tilings' shard count (default: the op's own)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.worker:
        method, tokens, shards = args.worker
        worker(method, int(tokens), int(shards))
        return

    import torch

    import torch_offload

    rows = []
    for tokens in args.tokens:
        shards = args.shards or torch_offload.tiled_mlp_num_shards(tokens, INTERMEDIATE)
        runs = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for m in METHODS:
                runs[m].append(run(m, tokens, shards))
        (em, et), (tm, tt), (pm, pt) = (
            (statistics.median(r[0] for r in runs[m]), statistics.median(r[1] for r in runs[m])) for m in METHODS
        )
        mib = 1 << 20
        rows.append(
            f"| {tokens} | {shards} | {em / mib:.0f} | {tm / mib:.0f} | {pm / mib:.0f} | **{tm / em:.2f}** "
            f"| {et:.2f} | {tt:.2f} | {pt:.2f} | **{tt / et:.2f}** | **{tt / pt:.2f}** |"
        )
        print(rows[-1], flush=True)
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    text = "\n".join(
        [
            "## tiled_mlp",
            "",
            f"`{' '.join(['.venv/bin/python', 'bench/tiled_mlp.py', *sys.argv[1:]])}` — CPU float32, h={HIDDEN}, "
            f"I={INTERMEDIATE}, SwiGLU, no biases, fwd+bwd (x and all weights need gradients). "
            f"torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {cpu}, load average {os.getloadavg()[0]:.1f} at the end.",
            "",
            "(a) eager untiled MLP, (b) `torch_offload.tiled_mlp`, (c) the published TiledMLP algorithm in plain "
            "Python (bench/tiled_mlp_baseline.py), both at the shard count of the table (the op's automatic one unless "
            "`--shards` gives one). Peak: growth of the resident "
            "set (VmHWM over VmRSS) during one fwd+bwd in a fresh process, inputs and grad_out allocated before; "
            "time: the next fwd+bwd in that process. "
            f"Methods take turns for {args.rounds} rounds; each cell is the median.",
            "",
            "| tokens | shards | peak (a) MiB | peak (b) MiB | peak (c) MiB | peak (b)/(a) | time (a) s | time (b) s "
            "| time (c) s | time (b)/(a) | time (b)/(c) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            "Goals at 32K tokens: peak (b)/(a) <= 0.25, time (b)/(a) <= 1.30, time (b)/(c) <= 0.85.",
            "",
        ]
    )
    if not args.no_write:
        write_section("tiled_mlp", text)
    print(text)


if __name__ == "__main__":
    main()
