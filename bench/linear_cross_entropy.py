"""linear_cross_entropy on the CPU: peak memory and fwd+bwd time of both its paths (gradients in forward,
the default here, and the recompute) against eager F.cross_entropy(F.linear(h, W), t), a plain-PyTorch
token-chunked loss (torchtune style: chunks of 1024 tokens, each chunk's logits and loss through autograd)
and Cut Cross-Entropy's CPU-capable implementation (cut_cross_entropy.linear_cross_entropy(...,
impl="torch_compile"), a bench-only dependency: `make bench-deps` puts it in build/bench-deps), float32,
h=1024.

    make bench-deps && .venv/bin/python bench/linear_cross_entropy.py   # both sizes; rewrites BENCHMARKS.md's section
    .venv/bin/python bench/linear_cross_entropy.py --filtering   # gradient filtering's effect, its own section

(with the package installed, e.g. by `make test`; or PYTHONPATH and TORCH_OFFLOAD_LIBRARY pointing at a build).

Each measurement runs in a fresh process: after a small warm-up step (libraries, thread
pool), one fwd+bwd (hidden and the weight need gradients) gives both the peak memory, the
growth of the resident set over that step (VmHWM after it, with the high-water mark reset
to VmRSS just before it; inputs already allocated), and the time. Large temporaries go
back to the system when freed, so a second step would pay the same page faults. The
methods take turns, round after round, so that drifting load on a shared machine hits
them alike; each cell is the median over the rounds.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

from measure import ROOT, machine, reset_peak_rss, status_bytes, write_section

HIDDEN = 1024
SIZES = ((16384, 32000), (4096, 128256))  # (tokens, vocabulary)
CHUNK = 1024
METHODS = ("eager", "chunked", "cce", "in_forward", "recompute")
# Where `make bench-deps` installs Cut Cross-Entropy (and the triton it imports), apart from .venv.
BENCH_DEPS = os.path.join(ROOT, "build", "bench-deps")
# Gradient filtering: the fused op without and with filter_eps="auto", on logits where the last
# fraction of the vocabulary is improbable for every token (bias -60, softmax < 1e-26).
FILTER_METHODS = ("fused", "filtered")
IMPROBABLE_FRACTIONS = (0.0, 0.5, 0.9)


def worker(method, tokens, vocab, improbable=None):
    import torch
    import torch.nn.functional as F

    import torch_offload

    def eager(hidden, weight, target):
        return F.cross_entropy(F.linear(hidden, weight), target)

    def chunked(hidden, weight, target):
        # torchtune's CEWithChunkedOutputLoss, with the head applied per chunk.
        total = sum(
            F.cross_entropy(F.linear(h, weight), t, reduction="sum")
            for h, t in zip(hidden.split(CHUNK), target.split(CHUNK))
        )
        return total / (target != -100).sum()

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, HIDDEN, generator=generator) * HIDDEN**-0.5).requires_grad_()
    if improbable is None:
        target = torch.randint(0, vocab, (tokens,), generator=generator)
        if method == "cce":
            loss = cut_cross_entropy_loss()
        elif method in ("in_forward", "recompute"):

            def loss(hidden, weight, target):
                return torch_offload.linear_cross_entropy(
                    hidden, weight, target, gradients_in_forward=method == "in_forward"
                )
        else:
            loss = {"eager": eager, "chunked": chunked}[method]
    else:
        probable = vocab - int(improbable * vocab)
        target = torch.randint(0, probable, (tokens,), generator=generator)
        bias = torch.zeros(vocab)
        bias[probable:] = -60.0
        filter_eps = "auto" if method == "filtered" else None

        def loss(hidden, weight, target):  # both on the recompute path, the one filtering runs on
            return torch_offload.linear_cross_entropy(
                hidden, weight, target, bias=bias, filter_eps=filter_eps, gradients_in_forward=False
            )

    # Warm-up on leaf tensors of two token counts, so that a compiled loss (CCE's) has its dynamic-shape
    # graph before the timed step and compiles nothing in it.
    for count in (64, 96):
        loss(hidden[:count].detach().requires_grad_(), weight, target[:count]).backward()
    hidden.grad = weight.grad = None

    before = reset_peak_rss()
    start = time.perf_counter()
    loss(hidden, weight, target).backward()
    elapsed = time.perf_counter() - start
    # The vocabulary rows no tile's gradient reached: skipped by filtering for every token tile.
    skipped = (weight.grad == 0).all(1).float().mean().item()
    print(f"{status_bytes('VmHWM') - before} {elapsed} {skipped}")


def cut_cross_entropy_loss():
    """Cut Cross-Entropy's loss in its CPU-capable implementation (torch.compile of its algorithm)."""
    sys.path.insert(0, BENCH_DEPS)
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError as error:
        raise SystemExit(f"Cut Cross-Entropy is not in {BENCH_DEPS} ({error}); run `make bench-deps`") from error
    return lambda hidden, weight, target: linear_cross_entropy(hidden, weight, target, impl="torch_compile")


def run(method, tokens, vocab, improbable=None):
    command = [sys.executable, __file__, "--worker", method, str(tokens), str(vocab)]
    if improbable is not None:
        command += ["--improbable", str(improbable)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()
    return int(out[0]), float(out[1]), float(out[2])


def filtering(args):
    """Time of the fused op's fwd+bwd without and with gradient filtering, per improbable fraction."""
    tokens, vocab = (int(n) for n in args.sizes[0].split("x"))
    rows = []
    for fraction in IMPROBABLE_FRACTIONS:
        runs = {m: [] for m in FILTER_METHODS}
        for _ in range(args.rounds):
            for m in FILTER_METHODS:
                runs[m].append(run(m, tokens, vocab, fraction))
        (ut, _), (ft, skipped) = (
            (statistics.median(r[1] for r in runs[m]), statistics.median(r[2] for r in runs[m])) for m in FILTER_METHODS
        )
        rows.append(f"| {fraction:.0%} | {skipped:.1%} | {ut:.1f} | {ft:.1f} | **{ft / ut:.2f}** |")
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "## linear_cross_entropy: gradient filtering",
            "",
            f"`{' '.join(['.venv/bin/python', 'bench/linear_cross_entropy.py', *sys.argv[1:]])}` — CPU float32, "
            f"{tokens} tokens, V={vocab}, h={HIDDEN}, automatic tile, fwd+bwd (hidden and the weight need gradients), "
            f"a fresh process per measurement, methods taking turns for {args.rounds} rounds, medians. {machine()}.",
            "",
            '`torch_offload.linear_cross_entropy` without and with `filter_eps="auto"` (float32: 2^-28). '
            "The logits are random (O(1)) except that the last fraction of the vocabulary is improbable for every "
            'token (bias -60: softmax < 1e-26); targets are in the rest. "Skipped" is the share of the weight '
            "gradient's rows that no tile reached (measured: exactly zero).",
            "",
            "| improbable vocabulary | skipped | time, unfiltered s | time, filtered s | filtered / unfiltered |",
            "| ---: | ---: | ---: | ---: | ---: |",
            *rows,
            *([""] + [args.note] if args.note else []),
            "",
        ]
    )
    if not args.no_write:
        write_section("linear_cross_entropy: gradient filtering", text)
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "TOKENS", "VOCAB"))
    parser.add_argument("--sizes", nargs="+", default=[f"{t}x{v}" for t, v in SIZES], metavar="TOKENSxVOCAB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--note", default="", help="a sentence appended to the section (e.g. machine sharing)")
    parser.add_argument(
        "--filtering",
        action="store_true",
        help="measure gradient filtering at the first size instead (its own section)",
    )
    parser.add_argument("--improbable", type=float, help=argparse.SUPPRESS)  # a worker's improbable fraction
    args = parser.parse_args()
    if args.worker:
        method, tokens, vocab = args.worker
        worker(method, int(tokens), int(vocab), args.improbable)
        return
    if args.filtering:
        filtering(args)
        return

    rows = []
    mib = 1 << 20
    for size in args.sizes:
        tokens, vocab = (int(n) for n in size.split("x"))
        runs = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for m in METHODS:
                runs[m].append(run(m, tokens, vocab))
        peak, seconds = ({m: statistics.median(r[i] for r in runs[m]) for m in METHODS} for i in (0, 1))
        ours = "in_forward"
        rows.append(
            " | ".join(
                [
                    f"| {tokens} | {vocab}",
                    *(f"{peak[m] / mib:.0f}" for m in METHODS),
                    f"**{peak[ours] / peak['eager']:.3f}**",
                    *(f"{seconds[m]:.1f}" for m in METHODS),
                    *(f"**{seconds[ours] / seconds[m]:.2f}**" for m in ("eager", "chunked", "cce", "recompute")),
                ]
            )
            + " |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "## linear_cross_entropy",
            "",
            f"`{' '.join(['make bench-deps && .venv/bin/python', 'bench/linear_cross_entropy.py', *sys.argv[1:]])}` — "
            f"CPU float32, h={HIDDEN}, no bias, reduction mean, fwd+bwd (hidden and the weight need gradients). "
            f"{machine()}.",
            "",
            "(a) eager `F.cross_entropy(F.linear(h, W), t)`, (c) plain-PyTorch token chunks of "
            f"{CHUNK} (torchtune style: per-chunk logits and loss through autograd), (x) Cut Cross-Entropy "
            '`linear_cross_entropy(h, W, t, impl="torch_compile")` (cut-cross-entropy 25.1.1), (f) '
            "`torch_offload.linear_cross_entropy` with its gradients in forward (3 GEMMs; the default for this call), "
            "(r) the same with `gradients_in_forward=False` (4 GEMMs). Peak: growth of the resident set (VmHWM over "
            "VmRSS) during one fwd+bwd in a fresh process, inputs allocated before; time: that fwd+bwd, after a "
            "warm-up on leaf tensors of 64 and 96 tokens (so that (x) compiles its dynamic-shape graph before it). "
            f"Methods take turns for {args.rounds} rounds; each cell is the median.",
            "",
            "| tokens | V | peak (a) MiB | peak (c) MiB | peak (x) MiB | peak (f) MiB | peak (r) MiB | peak (f)/(a) "
            "| time (a) s | time (c) s | time (x) s | time (f) s | time (r) s | time (f)/(a) | time (f)/(c) "
            "| time (f)/(x) | time (f)/(r) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: | ---: |",
            *rows,
            "",
            "Goals: at 16384 x 32000, time (f)/(a) <= 0.92, (f)/(c) <= 0.92, (f)/(x) <= 1.0 and peak (f)/(a) <= 0.05; "
            "at 4096 x 128256, time (f)/(a) <= 0.95 and (f)/(x) <= 1.0.",
            *([""] + [args.note] if args.note else []),
            "",
        ]
    )
    if not args.no_write:
        write_section("linear_cross_entropy", text)
    print(text)


if __name__ == "__main__":
    main()
