"""Memory and time of one chunk-recurrent training step (`torch_offload.chunk_recurrent_loss`) at long context, against
plain training in the same run, as users run it (no environment variable).

    .venv/bin/python bench/chunk_recurrent.py [--tokens 8192,16384,32768,65536] [--plain-tokens 4096,8192,16384]
                                              [--chunk-tokens 2048] [--write]

The demo's Llama (as bench/long_context.py: hidden 512, MLP 1408, 8 layers, vocabulary 32K, float32, random weights),
one row of T tokens, one step (forward and backward, no optimizer) per fresh process after a 128-token warm-up step:
the growth of the resident set during the step (VmHWM, reset just before) and its seconds. The chunk file lives in the
disk tier's default directory. Bytes per token is the least-squares slope over the lengths from 16K up; plain
training's step time beyond where it ran is the quadratic through its points.
"""

import argparse
import json
import sys

from long_context import plain_seconds, slopes
from measure import demo_llama, machine, measured_long_step, run_worker, user_env, write_section

TITLE = "Chunk-recurrent step"


def worker(method, tokens, chunk_tokens):
    import torch

    import torch_offload

    torch.manual_seed(0)
    model = demo_llama(512, 1408, 8, tokens).train()

    def step(length):
        ids = torch.randint(3, 32000, (1, length), generator=torch.Generator().manual_seed(0))
        if method == "plain":
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = torch_offload.chunk_recurrent_loss(model, ids, ids, chunk_tokens=chunk_tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    loss, seconds, peak = measured_long_step(step, tokens)
    return dict(peak=peak, seconds=seconds, loss=loss)


def table(stepped, plain, chunk_tokens):
    per_token, plain_per_token = slopes(stepped, plain)
    rows = [
        "| tokens | chunk-recurrent MiB | KiB per token so far | step (s) | plain step (s) | vs plain | "
        "loss - plain's |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for tokens, point in stepped.items():
        seconds, shown = plain_seconds(plain, tokens)
        difference = f"{point['loss'] - plain[tokens]['loss']:.1e}" if tokens in plain else "-"
        rows.append(
            f"| {tokens:,} | {point['peak'] / 2**20:.0f} | {point['peak'] / tokens / 1024:.2f} | "
            f"{point['seconds']:.1f} | {shown} | {point['seconds'] / seconds:.2f}x | {difference} |"
        )
    plain_points = ", ".join(f"{t // 1024}K {p['peak'] / 2**20:.0f} MiB {p['seconds']:.1f} s" for t, p in plain.items())
    command = "`.venv/bin/python bench/chunk_recurrent.py " + " ".join(sys.argv[1:]) + "`"
    return (
        f"## {TITLE}\n\n{command} ({machine()}). The demo's Llama (hidden 512, MLP 1408, 8 layers, vocabulary 32K, "
        f"float32), one row of T tokens, `chunk_recurrent_loss(model, ids, ids, chunk_tokens={chunk_tokens})` and "
        "its backward, one step per fresh process with glibc's default settings: resident set growth during the step "
        f"(VmHWM) and its time. Plain training in the same run: {plain_points}; {plain_per_token:.1f} KiB per token; "
        "its step time beyond the lengths it ran at is the quadratic through its points.\n\n"
        + "\n".join(rows)
        + f"\n\nResident growth per token from 16K up (least squares): **{per_token:.2f} KiB**"
        + (f", {plain_per_token / per_token:.0f}x less than plain training" if per_token > 0 else "")
        + ". What stays is the weights' gradients and one chunk's working set (docs/apply.md, "
        "[Chunk-recurrent step](docs/apply.md#chunk-recurrent-step)).\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,16384,32768,65536")
    parser.add_argument("--plain-tokens", default="4096,8192,16384")
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        json.dump(worker(args.run[0], int(args.run[1]), int(args.run[2])), sys.stdout)
        return
    tokens, plain_tokens = [int(t) for t in args.tokens.split(",")], [int(t) for t in args.plain_tokens.split(",")]
    if sum(t >= 16384 for t in tokens) < 2 or len(plain_tokens) < 2:
        parser.error("the slopes need at least two --tokens from 16384 up and two --plain-tokens")
    plain = {t: run_worker(__file__, ["plain", t, args.chunk_tokens], user_env()) for t in plain_tokens}
    stepped = {t: run_worker(__file__, ["chunk-recurrent", t, args.chunk_tokens], user_env()) for t in tokens}
    text = table(stepped, plain, args.chunk_tokens)
    print(text)
    if args.write:
        write_section(TITLE, text)


if __name__ == "__main__":
    main()
