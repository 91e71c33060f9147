"""Where in one applied training step the resident set peaks: the highest growth of the resident set within each
phase of the step, by layer, at several lengths, and how each phase grows per token.

    .venv/bin/python bench/peak_phases.py [--tokens 16384,32768,65536] [--norms]

The step is the layers' path of bench/long_context.py's (the demo's Llama, `apply(model,
chunk_recurrent=False)`: the layers offloaded to the disk tier, the path the chunk-recurrent step, apply's default
here, replaces; one row of T tokens, one step per fresh process after a 128-token warm-up, glibc's and the disk
tier's defaults). A thread samples VmRSS every 2 ms and keeps the highest value of each phase (a list of samples
would grow the resident set by itself); hooks on the final norm and each layer's attention and MLP (with --norms, its
two norms too) time the phases: a module's forward ends when its forward hook runs and its backward starts when the
gradient of its output arrives. A phase runs from its event to the next one.
"""

import argparse
import json
import subprocess
import sys
import threading
import time

from measure import demo_llama, machine, reset_peak_rss, status_bytes, user_env


def worker(tokens, norms):
    import torch

    import torch_offload

    torch.manual_seed(0)
    model = demo_llama(512, 1408, 8, tokens).train()
    torch_offload.apply(model, chunk_recurrent=False)  # its hooks would send the step to the layers' path anyway
    phases_begun = []  # the names of the phases in the order they begin

    def timed(name):
        def forward_hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            phases_begun.append(f"forward, after {name}")
            if out.requires_grad:
                out.register_hook(lambda grad: phases_begun.append(f"backward {name}"))

        return forward_hook

    for i, layer in enumerate(model.model.layers):
        if norms:
            layer.input_layernorm.register_forward_hook(timed(f"layer {i} input norm"))
            layer.post_attention_layernorm.register_forward_hook(timed(f"layer {i} post-attention norm"))
        layer.self_attn.register_forward_hook(timed(f"layer {i} attention"))
        layer.mlp.register_forward_hook(timed(f"layer {i} MLP"))
    model.model.norm.register_forward_hook(timed("final norm"))

    def step(length):
        phases_begun.append("forward, to layer 0's attention")
        ids = torch.randint(3, 32000, (1, length), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        phases_begun.append("the loss, then backward to the final norm")
        loss.backward()
        phases_begun.append("after backward")
        model.zero_grad(set_to_none=True)

    step(128)
    phases_begun.clear()
    highest = {}  # index in phases_begun -> the highest VmRSS sampled in that phase
    sampling = True

    def sample():
        while sampling:
            phase, rss = len(phases_begun) - 1, status_bytes("VmRSS")
            highest[phase] = max(highest.get(phase, 0), rss)
            time.sleep(0.002)

    before = reset_peak_rss()
    sampler = threading.Thread(target=sample)
    sampler.start()
    step(tokens)
    sampling = False
    sampler.join()
    phases = {}
    for index, name in enumerate(phases_begun):
        if index in highest:  # a phase shorter than a sample has none
            growth = highest[index] - before
            phases[name] = max(phases.get(name, growth), growth)
    return dict(peak=status_bytes("VmHWM") - before, phases=phases)


def run(tokens, norms):
    command = [sys.executable, __file__, "--run", str(tokens)] + (["--norms"] if norms else [])
    result = json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=user_env()).stdout)
    print(f"{tokens}: {result['peak'] / 2**20:.0f} MiB", flush=True)
    return result


def table(results):
    lengths = list(results)
    rows = {"step (VmHWM)": [results[t]["peak"] for t in lengths]}
    forward = [max((v, k) for k, v in results[t]["phases"].items() if k.startswith("forward")) for t in lengths]
    highest = ", ".join(f"{t // 1024}K: {k.removeprefix('forward, ')}" for t, (_, k) in zip(lengths, forward))
    rows[f"forward, the highest phase ({highest})"] = [v for v, _ in forward]
    names = dict.fromkeys(name for t in lengths for name in results[t]["phases"] if not name.startswith("forward"))
    for name in names:
        rows[name] = [results[t]["phases"].get(name) for t in lengths]
    spans = list(zip(lengths, lengths[1:]))
    header = [f"{t // 1024}K MiB" for t in lengths] + [f"KiB/token {a // 1024}K-{b // 1024}K" for a, b in spans]
    lines = [f"| phase | {' | '.join(header)} |", "| --- |" + " ---: |" * len(header)]
    for name, peaks in rows.items():
        cells = ["-" if p is None else f"{p / 2**20:.0f}" for p in peaks]
        for i, (a, b) in enumerate(spans):
            known = peaks[i] is not None and peaks[i + 1] is not None
            cells.append(f"{(peaks[i + 1] - peaks[i]) / (b - a) / 1024:.1f}" if known else "-")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    command = "`.venv/bin/python bench/peak_phases.py " + " ".join(sys.argv[1:]) + "`"
    return f"{command} ({machine()}):\n\n" + "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16384,32768,65536")
    parser.add_argument("--norms", action="store_true", help="time each layer's two norms' phases too")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        json.dump(worker(int(args.run), args.norms), sys.stdout)
        return
    print(table({t: run(t, args.norms) for t in map(int, args.tokens.split(","))}))


if __name__ == "__main__":
    main()
