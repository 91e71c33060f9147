"""One training step of a Llama-8B-shaped model in bf16 on a GPU: peak device memory per token and step time for
plain training, transformers' activation checkpointing with offload, apply() with every default (one sequence, and
packed documents) and the chunk-recurrent step (``chunk_recurrent_loss``: its store in pinned host memory up to the
pinned arena's budget, past it on disk); ratios against plain training of the same run, the step's against apply()'s
too; the longest context each fits, by running it.

    python bench/gpu_llama.py [--tokens 8192,16384,32768] [--layers 2] [--longest-seconds 60] [--write]
    python bench/gpu_llama.py --configs plain,apply,apply_rms_norm_off,apply_no_checkpoint --profile  # the review's

`--configs` may also name apply() with one setting changed (APPLY_OPTIONS), and the step on packed documents
(`step_packed`) or, on the CPU, with its store in host memory (`step_host`: the GPU step's test mode). `--profile`
adds, per point, a third step run under torch.profiler and its time split (bench/time_split.py: forward, recompute,
attention backward, copies), and the plan apply() chose (`print(handle)`: its route line in the table, the whole of it
above).

Each point is one step (SGD: no optimizer state) in a fresh process after a warm-up step; the peak is
`torch.cuda.max_memory_allocated()` over what the model held before the step; the step's host bytes are the pinned
arena's reserved bytes, its disk bytes the spill file's largest size. `--shape tiny` runs the same on the CPU
(resident set, the host store's included) to check the script where no GPU is. Under the table, the step's projection
to 32 layers: its device peak, its host and disk bytes and its time grown by the layers (the optimizer's state on the
host is not counted).
"""

import argparse
import json
import subprocess
import sys
import time

from measure import measured_step, worker_env, write_section
from real_batches import batch
from time_split import PARTS, profiled_split

CONFIGS = ("plain", "checkpoint_offload", "apply", "apply_packed", "step")
STEP_CONFIGS = ("step", "step_packed", "step_host")  # the chunk-recurrent step; its chunk: the library's default
# apply()'s options per configuration; "apply_packed" is apply() with every default on packed documents.
APPLY_OPTIONS = {
    "apply": {},
    "apply_packed": {},
    "apply_rms_norm_off": {"rms_norm": False},
    "apply_no_checkpoint": {"checkpoint": False, "keep_last": 0},
    # The GPU default's plan wherever the model is (on a CPU, offload="cpu" runs it), and whole layers checkpointed in
    # place without a tier, which recompute each attention forward twice more: on a CPU the two differ only by that.
    "apply_host": {"offload": "cpu"},
    "apply_in_place": {"offload": None, "checkpoint": "layer"},
}
SHAPES = {
    # Llama 3 8B's layer, a few of them: hidden, heads, kv heads, MLP, vocabulary.
    "llama8b": dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256
    ),
    "tiny": dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704, vocab_size=32000
    ),
}


def worker(config, tokens, shape, layers, profile=False):
    import torch
    import transformers

    import torch_offload

    device = "cuda" if shape != "tiny" else "cpu"
    gpu = device == "cuda"
    torch.manual_seed(0)
    settings = transformers.LlamaConfig(
        **SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=tokens, attn_implementation="sdpa"
    )
    with torch.device(device):
        # The step on the CPU takes float32 (and float64) only: there it checks the script, not bf16's speed.
        dtype = torch.float32 if config in STEP_CONFIGS and not gpu else torch.bfloat16
        model = transformers.LlamaForCausalLM(settings).to(dtype).train()
    if config == "checkpoint_offload":
        model.activation_checkpointing_enable(offload=gpu)  # its pinned host copies need a GPU
    plan = None
    if config in APPLY_OPTIONS:
        plan = str(torch_offload.apply(model, **APPLY_OPTIONS[config]))
    kind = "packed" if config.endswith("packed") else "one sequence"
    inputs = {name: t.to(device) for name, t in batch(kind, tokens).items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def forward():
        if config in STEP_CONFIGS:  # on the CPU: the disk tier, or host memory (step_host)
            host_budget = 1 << 50 if config == "step_host" else None
            return torch_offload.chunk_recurrent_loss(model, **inputs, host_budget=host_budget)
        return model(**inputs, use_cache=False).loss

    def rest():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step():
        loss = forward()
        loss.backward()
        rest()
        return loss.item()

    try:
        loss, seconds, peak_bytes = measured_step(step, gpu)
        split = profiled_split(forward, lambda loss: loss.backward(), rest, gpu) if profile else None
    except torch.OutOfMemoryError:
        return {"oom": True}
    result = {"oom": False, "loss": loss, "seconds": seconds, "peak_bytes": peak_bytes, "plan": plan}
    if config in STEP_CONFIGS:
        host = torch_offload.pinned_arena_stats()["reserved_bytes"] if gpu else 0
        result.update(host_bytes=host, disk_bytes=torch_offload.disk_spill_stats()["peak_file_bytes"])
    return result if split is None else dict(result, split=split)


def measure(config, tokens, shape, layers, profile=False):
    command = [sys.executable, __file__, "--worker", config, "--tokens", str(tokens), "--shape", shape]
    command += ["--layers", str(layers)] + (["--profile"] if profile else [])
    done = subprocess.run(command, capture_output=True, text=True, env=worker_env())
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return {"oom": False, "failed": f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def longest(config, start, shape, layers, seconds):
    """The longest context (doubling from `start`) whose step ran, within `seconds` of trying."""
    fits, tokens, deadline = None, start, time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = measure(config, tokens, shape, layers)
        if result.get("oom") or "failed" in result:
            break
        fits, tokens = tokens, tokens * 2
    return fits


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,16384,32768")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shape", choices=SHAPES, default="llama8b")
    known = tuple(dict.fromkeys(CONFIGS + STEP_CONFIGS + tuple(APPLY_OPTIONS)))
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(known)}")
    parser.add_argument("--profile", action="store_true", help="each point's time split and apply()'s plan")
    parser.add_argument("--longest-seconds", type=float, default=0, help="per configuration; 0: not searched")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    parser.add_argument("--worker", choices=known, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, int(args.tokens), args.shape, args.layers, args.profile)))
        return
    import torch

    device = torch.cuda.get_device_name() if args.shape != "tiny" else "the CPU"
    points = list(map(int, args.tokens.split(",")))
    configs = args.configs.split(",")
    unknown = set(configs) - set(known)
    if unknown:
        parser.error(f"--configs: {', '.join(sorted(unknown))} unknown; expected names of {', '.join(known)}")
    results = {c: {t: measure(c, t, args.shape, args.layers, args.profile) for t in points} for c in configs}
    rows = []
    for config in configs:
        runs = results[config]
        ok = [t for t in points if "peak_bytes" in runs[t]]
        slope = (runs[ok[-1]]["peak_bytes"] - runs[ok[0]]["peak_bytes"]) / (ok[-1] - ok[0]) if len(ok) > 1 else None
        cells = []
        for t in points:
            run, plain = runs[t], results.get("plain", {}).get(t, {})
            if "peak_bytes" not in run:
                cells.append("OOM" if run.get("oom") else run.get("failed", "?"))
                continue
            ratio = f" ({run['seconds'] / plain['seconds']:.2f}x)" if "seconds" in plain else ""
            layers_path = results.get("apply", {}).get(t, {})
            if "host_bytes" in run and "seconds" in layers_path:
                ratio += f" ({run['seconds'] / layers_path['seconds']:.2f}x apply)"
            if "host_bytes" in run:
                ratio += f"; host {run['host_bytes'] / 2**20:.0f} MiB, disk {run['disk_bytes'] / 2**20:.0f} MiB"
            cells.append(f"{run['peak_bytes'] / 2**20:.0f} MiB, {run['seconds']:.2f} s{ratio}")
        fits = (
            longest(config, points[-1], args.shape, args.layers, args.longest_seconds) if args.longest_seconds else None
        )
        per_token = f"{slope / 1024:.1f}" if slope is not None else "-"
        rows.append(f"| {config} | {per_token} | " + " | ".join(cells) + f" | {fits or '-'} |")
        print(rows[-1], flush=True)
    text = (
        f"## Llama-8B-shaped step on a GPU\n\n`python bench/gpu_llama.py --tokens {args.tokens} --layers "
        f"{args.layers} --shape {args.shape} --longest-seconds {args.longest_seconds:g} --write` on {device}, torch "
        f"{torch.__version__}: bf16, {args.layers} layers, one step (SGD) per point in a fresh process; peak device "
        "memory over the model's, step time (against plain training's at the same length); KiB per token is the "
        "slope from the shortest to the longest point that ran; longest: doubling from the last point until a step "
        "runs out of memory.\n\n"
        "| configuration | KiB per token | " + " | ".join(f"{t} tokens" for t in points) + " | longest |\n"
        "| --- | ---: | " + " | ".join("---:" for _ in points) + " | ---: |\n" + "\n".join(rows) + "\n"
    )
    text += projection(results, points, args.layers)
    if args.profile:
        text += "\n" + split_table(results, points)
    if args.write:
        write_section("Llama-8B-shaped step on a GPU", text)
    else:
        print(text)


def projection(results, points, layers):
    """The step's longest point that ran, grown from ``layers`` to 32 layers: device peak (a layer's working set at a
    time: unchanged), host and disk bytes and step time (per layer)."""
    lines = []
    for config in (c for c in STEP_CONFIGS if c in results):
        ran = [t for t in points if "peak_bytes" in results[config][t]]
        if not ran:
            continue
        run, grow = results[config][ran[-1]], 32 / layers
        lines.append(
            f"- {config} at {ran[-1]} tokens, 32 layers: device {run['peak_bytes'] / 2**30:.1f} GiB over the weights, "
            f"host {run['host_bytes'] * grow / 2**30:.1f} GiB, disk {run['disk_bytes'] * grow / 2**30:.1f} GiB, "
            f"{run['seconds'] * grow:.0f} s a step"
        )
    return "\nThe step grown to 32 layers:\n\n" + "\n".join(lines) + "\n" if lines else ""


def split_table(results, points):
    """Each profiled point's time split (ms of device time on a GPU, of CPU time on the CPU) and apply()'s plan."""
    lines = [
        "Time split of a third step under torch.profiler (bench/time_split.py), ms; route: `print(handle)`'s.",
        "",
        "| configuration | tokens | " + " | ".join(PARTS) + " | route |",
        "| --- | ---: | " + " | ".join("---:" for _ in PARTS) + " | --- |",
    ]
    for config, runs in results.items():
        for t in points:
            split = runs[t].get("split")
            if split:
                cells = " | ".join(f"{split[part]:.0f}" for part in PARTS)
                route = next((line for line in (runs[t]["plan"] or "").splitlines() if line.startswith("route:")), "-")
                lines.append(f"| {config} | {t} | {cells} | {route.removeprefix('route: ')} |")
    plans = {c: next((r["plan"] for r in runs.values() if r.get("plan")), None) for c, runs in results.items()}
    lines += ["", *(f"{config}:\n```\n{plan}\n```" for config, plan in plans.items() if plan)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
