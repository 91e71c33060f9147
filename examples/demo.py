"""The main job: train a Llama-style causal LM three ways and show what torch_offload saves.

    python examples/demo.py [--steps N] [--seq-len T] [--batch B] [--device cpu|cuda] [--compile]

Runs (each in a fresh process, so each peak is its own):
  baseline         plain training;
  checkpointing    non-reentrant activation checkpointing of every layer;
  torch_offload    torch_offload.apply: tiled MLP, offloaded checkpointing (disk tier
                   on the CPU, pinned host memory on a GPU).
The model is built from a transformers config with random weights (nothing is
downloaded) and reads examples/data/corpus.txt one byte per token. Prints a table of
peak memory, median step time and final loss, and writes demo_out/memory.png.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("baseline", "checkpointing", "torch_offload")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024 CPU, 4096 GPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 2 CPU, 8 GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in every configuration")
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)  # one configuration, in a child process
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    args.seq_len = args.seq_len or (4096 if gpu else 1024)
    args.batch = args.batch or (8 if gpu else 2)
    return args


def model_config(args):
    import transformers

    gpu = args.device.startswith("cuda")
    hidden, layers = (1024, 8) if gpu else (256, 6)
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=args.seq_len,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )


def batches(args):
    with open(os.path.join(HERE, "data", "corpus.txt"), "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    span = args.seq_len
    repeated = data.repeat(span * args.batch // data.numel() + 2)  # the corpus is short: wrap around
    for _ in range(args.steps):
        starts = torch.randint(0, repeated.numel() - span, (args.batch,), generator=generator)
        yield torch.stack([repeated[s:s + span] for s in starts])


class MemoryMeter:
    """Peak memory of each step: allocated GPU memory, or the process's RSS sampled on the CPU."""

    def __init__(self, device):
        self.gpu = device.startswith("cuda")
        self.peak = 0
        self._stop = threading.Event()
        if not self.gpu:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    @staticmethod
    def _rss():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def start_step(self):
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak = self._rss()

    def end_step(self):
        if self.gpu:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return max(self.peak, self._rss())


def run_one(args):
    """Train one configuration; write its losses, step times and memory to args.result."""
    import transformers  # noqa: F401  (imported before the meter starts)
    from tqdm import tqdm

    import torch_offload

    torch.manual_seed(0)
    model = __import__("transformers").LlamaForCausalLM(model_config(args)).to(args.device).train()
    handle = None
    spill = tempfile.TemporaryDirectory(dir=args.out)
    if args.run == "checkpointing":
        handle = torch_offload.apply(model, tiled_mlp=False, checkpoint=True, offload=None)
    elif args.run == "torch_offload":
        gpu = args.device.startswith("cuda")
        handle = torch_offload.apply(model, tiled_mlp=True, checkpoint=True, offload="cpu" if gpu else "disk",
                                     spill_directory=spill.name, min_bytes=1 << 16)
    forward = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    meter = MemoryMeter(args.device)
    meter.start_step()
    start_memory = meter.end_step()  # the model, before any step
    losses, times, memory = [], [], []
    for ids in tqdm(list(batches(args)), desc=f"{args.run:>14}", unit="step", file=sys.stderr):
        ids = ids.to(args.device)
        meter.start_step()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        memory.append(meter.end_step())
    if handle is not None:
        handle.remove()
    spill.cleanup()
    with open(args.result, "w") as f:
        json.dump({"losses": losses, "times": times, "memory": memory, "start_memory": start_memory}, f)


def plot(results, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name in CONFIGS:
        steps = range(1, len(results[name]["memory"]) + 1)
        ax.plot(steps, [m / 2**20 for m in results[name]["memory"]], marker="o", label=name)
    what = "peak GPU memory allocated" if args.device.startswith("cuda") else "peak process RSS"
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{what} (MiB)")
    ax.set_title(f"Llama-style LM, {args.batch} x {args.seq_len} tokens per step on {args.device}")
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
    # Large freed blocks go back to the OS at once, so RSS shows what each run holds.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 << 10))
    results = {}
    for name in CONFIGS:
        result = os.path.join(args.out, f"{name}.json")
        command = [sys.executable, os.path.abspath(__file__), "--run", name, "--result", result,
                   "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                   "--device", args.device, "--out", args.out] + (["--compile"] if args.compile else [])
        subprocess.run(command, check=True, env=env)
        with open(result) as f:
            results[name] = json.load(f)
    baseline = results["baseline"]
    print(f"\n{args.steps} steps of {args.batch} x {args.seq_len} tokens on {args.device}"
          f"{' (compiled)' if args.compile else ''}\n")
    print("| configuration | peak memory (MiB) | of which training (MiB) | vs baseline | median step (s) "
          "| vs baseline | final loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    baseline_training = max(baseline["memory"]) - baseline["start_memory"]
    for name in CONFIGS:
        r = results[name]
        peak, step = max(r["memory"]), statistics.median(r["times"])
        training = peak - r["start_memory"]  # above what the process held before the first step
        print(f"| {name} | {peak / 2**20:.0f} | {training / 2**20:.0f} | {training / baseline_training:.2f}x | "
              f"{step:.2f} | {step / statistics.median(baseline['times']):.2f}x | {r['losses'][-1]:.5f} |")
    path = os.path.join(args.out, "memory.png")
    plot(results, args, path)
    print(f"\nmemory over the steps: {path}")
    final = [results[name]["losses"][-1] for name in CONFIGS]
    if max(final) - min(final) > 1e-4 * abs(final[0]):
        raise SystemExit(f"final losses differ: {final}")
    print("final losses agree across the three configurations")


if __name__ == "__main__":
    main()
