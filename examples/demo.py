"""The main job: how much longer a context fits when a causal LM trains with torch_offload.

    python examples/demo.py [--seq-lens 1024,2048,4096,8192] [--budget-gib 8] [--device cpu|cuda]
                            [--configs baseline,checkpointing,torch_offload,torch_offload_packed]
                            [--hidden H --intermediate I --layers L]

A Llama-style LM with a 32,000-token vocabulary (random weights, nothing downloaded; it
reads examples/data/corpus.txt one byte per token) takes one training step at each
sequence length in these configurations, each point in a fresh process so that each
peak is its own:
  baseline              plain training;
  checkpointing         non-reentrant activation checkpointing of every layer;
  torch_offload         torch_offload.apply: tiled MLP, fused LM head + loss (no logits),
                        offloaded checkpointing (disk tier on the CPU, pinned host memory on a GPU);
  torch_offload_packed  the same on the same tokens as 4 packed documents (position_ids restarting
                        at 0, as TRL's padding-free packing gives them): attention per document, no
                        [T, T] mask (its loss is its own: the documents do not see each other);
  apply_*               on request: apply() with its defaults and with each alternative (APPLY_CHOICES).
Peak training memory is the peak above what the process held before the step (VmHWM on
the CPU, allocated memory on a GPU). The demo fits bytes per token for each configuration,
prints their ratio to the baseline's (the context multiplier) and the longest context
each fits in --budget-gib, and draws demo_out/memory.png.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("baseline", "checkpointing", "torch_offload", "torch_offload_packed")
# apply()'s choices side by side, for BENCHMARKS.md's table of defaults (--configs baseline,apply_default,...):
# the options of each. All tile the MLPs and fuse the loss; the disk tier writes to $TORCH_OFFLOAD_SPILL_DIR,
# a temporary directory.
APPLY_CHOICES = {
    "apply_default": {},
    "apply_layer": dict(offload=None, checkpoint="layer"),
    "apply_no_checkpoint": dict(offload=None, checkpoint=False),
    "apply_disk_attention": dict(offload="disk", checkpoint="attention"),
    "apply_disk_layer": dict(offload="disk", checkpoint="layer"),
}
PACKED_DOCUMENTS = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seq-lens", default=None, help="comma-separated tokens per step (default 1K..8K CPU, 2K..16K GPU)"
    )
    parser.add_argument("--budget-gib", type=float, default=8.0, help="training memory budget for the longest context")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which configurations to run")
    parser.add_argument("--hidden", type=int, help="hidden size (default 256 CPU, 1024 GPU; 64 per head)")
    parser.add_argument("--intermediate", type=int, help="MLP size (default 704 CPU, 2816 GPU)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 4 CPU, 8 GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="demo_out")
    parser.add_argument(
        "--run", choices=CONFIGS + tuple(APPLY_CHOICES), help=argparse.SUPPRESS
    )  # one point, in a child
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    default = "2048,4096,8192,16384" if gpu else "1024,2048,4096,8192"
    args.seq_lens = [int(t) for t in (args.seq_lens or default).split(",")]
    if not args.run and len(set(args.seq_lens)) < 2:
        parser.error("--seq-lens: at least two different lengths (the table fits a line through them)")
    args.configs = args.configs.split(",")
    if "baseline" not in args.configs or not set(args.configs) <= set(CONFIGS) | set(APPLY_CHOICES):
        parser.error(f"--configs: baseline and any of {CONFIGS + tuple(APPLY_CHOICES)}")
    args.hidden = args.hidden or (1024 if gpu else 256)
    args.intermediate = args.intermediate or (2816 if gpu else 704)
    args.layers = args.layers or (8 if gpu else 4)
    return args


def model_config(args, seq_len):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=seq_len,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )


def token_batch(seq_len):
    with open(os.path.join(HERE, "data", "corpus.txt"), "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    repeated = data.repeat(seq_len // data.numel() + 2)  # the corpus is short: wrap around
    start = torch.randint(0, repeated.numel() - seq_len, (1,), generator=torch.Generator().manual_seed(0)).item()
    return repeated[start : start + seq_len].unsqueeze(0)


def _vm(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) << 10
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss():
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def run_one(args):
    """One training step of one configuration at one length; write loss, time and peak to args.result."""
    import transformers

    import torch_offload

    gpu = args.device.startswith("cuda")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(model_config(args, args.seq_len)).to(args.device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # no optimizer state: the step's own memory
    spill = tempfile.TemporaryDirectory(dir=args.out)
    os.environ["TORCH_OFFLOAD_SPILL_DIR"] = spill.name
    if args.run in APPLY_CHOICES:
        torch_offload.apply(model, **APPLY_CHOICES[args.run])
    elif args.run == "checkpointing":
        torch_offload.apply(model, tiled_mlp=False, checkpoint=True, offload=None, loss=False)
    elif args.run in ("torch_offload", "torch_offload_packed"):
        torch_offload.apply(model, min_bytes=1 << 16, offload="cpu" if gpu else "disk")

    def step(ids, update):
        # Packed: documents of equal length, each restarting its positions at 0.
        packing = (
            dict(
                position_ids=torch.arange(ids.shape[1], device=ids.device).remainder(ids.shape[1] // PACKED_DOCUMENTS)[
                    None
                ]
            )
            if args.run == "torch_offload_packed"
            else {}
        )
        loss = model(input_ids=ids, labels=ids, use_cache=False, **packing).loss
        loss.backward()
        if update:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step(token_batch(128).to(args.device), update=False)  # first-call costs (thread pools, lazy inits) stay out
    ids = token_batch(args.seq_len).to(args.device)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        before = _vm("VmRSS:")
    start = time.perf_counter()
    loss = step(ids, update=True)
    if gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _vm("VmHWM:")
    seconds = time.perf_counter() - start
    spill.cleanup()
    with open(args.result, "w") as f:
        json.dump({"loss": loss, "seconds": seconds, "training_bytes": peak - before}, f)


def fit(points):
    """Least-squares line through (tokens, bytes): (bytes per token, intercept)."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    slope = sum((t - mean_t) * (b - mean_b) for t, b in points) / sum((t - mean_t) ** 2 for t, _ in points)
    return slope, mean_b - slope * mean_t


def plot(results, fits, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name in args.configs:
        tokens = args.seq_lens
        line = ax.plot(
            [t / 1024 for t in tokens],
            [results[name][t]["training_bytes"] / 2**30 for t in tokens],
            marker="o",
            label=f"{name}: {fits[name][0] / 1024:.0f} KiB/token",
            ls="--" if name == "torch_offload_packed" else "-",
        )  # on torch_offload's: both visible
        slope, intercept = fits[name]
        ax.plot(
            [0, tokens[-1] / 1024],
            [intercept / 2**30, (intercept + slope * tokens[-1]) / 2**30],
            ls=":",
            color=line[0].get_color(),
        )
    what = "peak GPU memory allocated" if args.device.startswith("cuda") else "peak RSS (VmHWM)"
    ax.set_xlabel("tokens per step (K)")
    ax.set_ylabel(f"training memory, {what} (GiB)")
    ax.set_title(
        f"Llama-style LM (hidden {args.hidden}, {args.layers} layers, vocabulary 32K), one step per point, "
        f"{args.device}"
    )
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.run:
        return run_one(args)
    # Large freed blocks go back to the OS at once, so RSS shows what each step holds.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 << 10))
    results = {name: {} for name in args.configs}
    for seq_len in args.seq_lens:
        for name in args.configs:
            result = os.path.join(args.out, f"{name}-{seq_len}.json")
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--run",
                name,
                "--seq-len",
                str(seq_len),
                "--result",
                result,
                "--device",
                args.device,
                "--out",
                args.out,
                "--hidden",
                str(args.hidden),
                "--intermediate",
                str(args.intermediate),
                "--layers",
                str(args.layers),
            ]
            subprocess.run(command, check=True, env=env)
            with open(result) as f:
                results[name][seq_len] = json.load(f)
            r = results[name][seq_len]
            print(
                f"{name:>14} {seq_len:>6} tokens: {r['training_bytes'] / 2**20:8.0f} MiB, {r['seconds']:6.1f} s, "
                f"loss {r['loss']:.5f}",
                flush=True,
            )
    fits = {name: fit([(t, results[name][t]["training_bytes"]) for t in args.seq_lens]) for name in args.configs}
    budget = args.budget_gib * 2**30
    longest = args.seq_lens[-1]
    print(
        f"\nOne training step per point on {args.device}, {args.seq_lens[0]} to {longest} tokens; "
        f"longest context in a {args.budget_gib:g} GiB training-memory budget extrapolated from the fit\n"
    )
    print(
        "| configuration | KiB per token | context multiplier | longest context in budget (tokens) "
        f"| training MiB at {longest} | step (s) at {longest} | vs baseline |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base_slope = fits["baseline"][0]
    base_seconds = results["baseline"][longest]["seconds"]
    for name in args.configs:
        slope, intercept = fits[name]
        r = results[name][longest]
        grows = slope > 0  # the points can be flat within measurement noise at tiny lengths
        multiplier = f"{base_slope / slope:.1f}x" if grows else "n/a (flat)"
        fits_in = f"{int((budget - intercept) / slope):,}" if grows else "n/a (flat)"
        print(
            f"| {name} | {slope / 1024:.1f} | {multiplier} | {fits_in} | "
            f"{r['training_bytes'] / 2**20:.0f} | {r['seconds']:.1f} | {r['seconds'] / base_seconds:.2f}x |"
        )
    path = os.path.join(args.out, "memory.png")
    plot(results, fits, args, path)
    print(f"\npeak training memory against sequence length: {path}")
    one_sequence = [name for name in args.configs if name != "torch_offload_packed"]
    for seq_len in args.seq_lens:
        losses = [results[name][seq_len]["loss"] for name in one_sequence]
        if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
            raise SystemExit(f"losses at {seq_len} tokens differ: {losses}")
    print(f"losses agree across the {len(one_sequence)} configurations on one sequence at every length")


if __name__ == "__main__":
    main()
