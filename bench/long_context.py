"""Memory and time of one training step at long context, as users run it: `apply(model)` with no option in a
process with no special environment.

    .venv/bin/python bench/long_context.py [--tokens 8192,16384,32768,65536] [--plain-tokens 4096,8192,16384]
                                           [--layers-path-tokens 32768] [--keep-last N] [--write]

The demo's Llama (hidden 512, MLP 1408, 8 layers, vocabulary 32K, float32, random weights), one row of T tokens,
one step (forward and backward, no optimizer) per fresh process after a 128-token warm-up step: the growth of the
resident set during the step (VmHWM, reset just before), the most its file on disk held (the disk tier's, or the
chunk-recurrent step's) and its seconds. Unlike the
other benches, glibc keeps its default settings (no MALLOC_MMAP_THRESHOLD_) and the disk tier its defaults: what a
user's process shows. Bytes per token is the least-squares slope over the applied lengths from 16K up. Plain training
runs where it fits; its step time is extrapolated to the applied lengths by the quadratic through its points
(attention's work grows with T squared), and the applied step's time is given against it. `--keep-last N` passes
apply() that one option (a section of its own): how much the last layers, kept and recomputed whole, hold.
`--layers-path-tokens` runs `apply(model, chunk_recurrent=False)` at those lengths too (the layers offloaded, the
default before the chunk-recurrent step), for a step time measured in the same run where plain training does not fit.
"""

import argparse
import json
import sys

from measure import demo_llama, machine, reset_peak_rss, run_worker, slope, status_bytes, user_env, write_section

TITLE = "Long context"


def worker(method, tokens, apply_options):
    import time

    import torch

    import torch_offload

    torch.manual_seed(0)
    model = demo_llama(512, 1408, 8, tokens).train()
    path = "plain training"
    if method == "apply(model)":
        handle = torch_offload.apply(model, **apply_options)
        path = f"route: {handle.route} (chunk-recurrent step {handle.chunk_recurrent})"

    def step(length):
        ids = torch.randint(3, 32000, (1, length), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    step(128)
    before = reset_peak_rss()
    start = time.perf_counter()
    loss = step(tokens)
    seconds = time.perf_counter() - start
    # What the disk held at most: the disk tier's spill file (the layers' path's, or the chunk-recurrent step's).
    on_disk = torch_offload.disk_spill_stats()["peak_file_bytes"]
    return dict(peak=status_bytes("VmHWM") - before, seconds=seconds, loss=loss, on_disk=on_disk, path=path)


def quadratic_time(points):
    """The quadratic through (or, past three points, nearest to) the (tokens, seconds) points, as a function."""
    import numpy

    tokens = list(points)
    coefficients = numpy.polyfit(tokens, [points[t]["seconds"] for t in tokens], min(2, len(tokens) - 1))
    return lambda t: float(numpy.polyval(coefficients, t))


def slopes(measured, plain):
    """KiB per token of the measured lengths from 16K up (shorter ones hold the fixed buffers' warm-up), and of plain
    training's."""
    return slope({t: p for t, p in measured.items() if t >= 16384}), slope(plain)


def plain_seconds(plain, tokens):
    """Plain training's step time at tokens, measured there or else the quadratic through its points, and as shown."""
    if tokens in plain:
        return plain[tokens]["seconds"], f"{plain[tokens]['seconds']:.1f}"
    seconds = quadratic_time(plain)(tokens)
    return seconds, f"{seconds:.1f} (extrapolated)"


def run(method, tokens, apply_options):
    return run_worker(__file__, [method, tokens, json.dumps(apply_options)], user_env())


def table(applied, plain, layers_path, apply_options):
    per_token, plain_per_token = slopes(applied, plain)
    rows = [
        "| tokens | apply(model) MiB | KiB per token so far | on disk at most (KiB per token) | step (s) | "
        "plain step (s) | vs plain | the layers' path: MiB, step (s) | vs the layers' path |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for tokens, point in applied.items():
        seconds, shown = plain_seconds(plain, tokens)
        layers = layers_path.get(tokens)
        rows.append(
            f"| {tokens:,} | {point['peak'] / 2**20:.0f} | {point['peak'] / tokens / 1024:.1f} | "
            f"{point['on_disk'] / tokens / 1024:.1f} | {point['seconds']:.1f} | {shown} | "
            f"{point['seconds'] / seconds:.2f}x | "
            + (
                f"{layers['peak'] / 2**20:.0f}, {layers['seconds']:.1f} | {point['seconds'] / layers['seconds']:.2f}x |"
                if layers
                else "- | - |"
            )
        )
    plain_points = ", ".join(f"{t // 1024}K {p['peak'] / 2**20:.0f} MiB {p['seconds']:.1f} s" for t, p in plain.items())
    command = "`.venv/bin/python bench/long_context.py " + " ".join(sys.argv[1:]) + "`"
    options = ", ".join(f"{k}={v}" for k, v in apply_options.items())
    return (
        f"## {section_title(apply_options)}\n\n{command} ({machine()}). The demo's Llama (hidden 512, MLP 1408, 8 "
        f"layers, vocabulary 32K, float32), one row of T tokens, `apply(model{', ' + options if options else ''})` "
        f"{'and no other option' if options else 'with no option'}, one step per fresh process with glibc's and "
        "the disk tier's default settings (no environment variable): resident set growth during the step (VmHWM) and "
        f"its time. Plain training in the same run: {plain_points}; {plain_per_token:.1f} KiB per token; its step "
        "time beyond the lengths it ran at is the quadratic through its points. The layers' path is "
        "`apply(model, chunk_recurrent=False)`, the default before the chunk-recurrent step, in the same run.\n\n"
        + "\n".join(rows)
        + f"\n\nResident growth per token from 16K up (least squares): **{per_token:.2f} KiB**"
        + (f", {plain_per_token / per_token:.0f}x less than plain training" if per_token > 0 else "")
        + ". The handle's path: "
        + ", ".join(sorted({point["path"] for point in applied.values()}))
        + ".\n"
    )


def section_title(apply_options):
    return TITLE + "".join(f", {k}={v}" for k, v in apply_options.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,16384,32768,65536")
    parser.add_argument("--plain-tokens", default="4096,8192,16384")
    parser.add_argument(
        "--layers-path-tokens", default="32768", help="lengths of the layers' path too (chunk_recurrent=False)"
    )
    parser.add_argument("--keep-last", type=int, help="apply()'s keep_last (default: apply()'s own)")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        json.dump(worker(args.run[0], int(args.run[1]), json.loads(args.run[2])), sys.stdout)
        return
    tokens, plain_tokens = [int(t) for t in args.tokens.split(",")], [int(t) for t in args.plain_tokens.split(",")]
    if sum(t >= 16384 for t in tokens) < 2 or len(plain_tokens) < 2:  # checked before an hour of steps
        parser.error("the slopes need at least two --tokens from 16384 up and two --plain-tokens")
    apply_options = {} if args.keep_last is None else {"keep_last": args.keep_last}
    plain = {t: run("plain", t, {}) for t in plain_tokens}
    layers_tokens = [int(t) for t in args.layers_path_tokens.split(",") if t]
    layers_path = {t: run("apply(model)", t, dict(apply_options, chunk_recurrent=False)) for t in layers_tokens}
    applied = {t: run("apply(model)", t, apply_options) for t in tokens}
    text = table(applied, plain, layers_path, apply_options)
    print(text)
    if args.write:
        write_section(section_title(apply_options), text)


if __name__ == "__main__":
    main()
