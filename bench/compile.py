"""torch.compile of an applied model: one training step's time and peak memory, eager apply()
against torch.compile(model, fullgraph=True) after apply(), on the demo's Llama (examples/demo.py:
hidden 256, MLP 704, 4 layers, vocabulary 32K on the CPU; hidden 1024, MLP 2816, 8 layers on a GPU).

    .venv/bin/python bench/compile.py [--tokens 2048,4096] [--rounds 3] [--offload none,disk] [--device cpu|cuda]
                                      [--write]   # --write: rewrites BENCHMARKS.md's section

(with the package installed, e.g. by `make test`; or PYTHONPATH and TORCH_OFFLOAD_LIBRARY pointing at a build).

Each measurement runs in a fresh process: a first step at the measured length (compiling,
for the compiled model) is left out; the second step gives the time and the peak memory
(growth of the resident set, VmHWM with the high-water mark reset just before it; on a GPU
max_memory_allocated over memory_allocated before it). Eager and compiled take turns, round
after round; each cell is the median over the rounds.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from measure import ROOT, reset_peak_rss, status_bytes, write_section

sys.path.insert(0, str(ROOT / "examples"))
METHODS = ("eager", "compiled")


def worker(method, tokens, offload, device):
    import torch
    import transformers

    import torch_offload
    from demo import token_batch

    gpu = device.startswith("cuda")
    hidden, intermediate, layers = (1024, 2816, 8) if gpu else (256, 704, 4)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=tokens,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    spill = tempfile.TemporaryDirectory()
    tier = None if offload == "none" else offload
    options = {} if tier is None else dict(min_bytes=1 << 16)  # apply refuses options a configuration ignores
    if tier == "disk":
        options["spill_directory"] = spill.name
    torch_offload.apply(model, offload=tier, **options)
    run = torch.compile(model, fullgraph=True) if method == "compiled" else model
    ids = token_batch(tokens).to(device)

    def step():
        loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = reset_peak_rss()
    start = time.perf_counter()
    loss = step()
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if gpu else status_bytes("VmHWM")
    spill.cleanup()
    return {"loss": loss, "seconds": seconds, "peak_bytes": peak - before}


def measure(method, tokens, offload, device):
    command = [sys.executable, __file__, "--worker", method, "--tokens", str(tokens), "--offload", offload,
               "--device", device]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--offload", default="none,disk", help="apply()'s offload tiers to compare under: none, cpu, disk")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, int(args.tokens), args.offload, args.device)))
        return
    rows = []
    for offload in args.offload.split(","):
        for tokens in map(int, args.tokens.split(",")):
            runs = {method: [] for method in METHODS}
            for _ in range(args.rounds):
                for method in METHODS:
                    runs[method].append(measure(method, tokens, offload, args.device))
            cell = {m: (statistics.median(r["seconds"] for r in runs[m]),
                        statistics.median(r["peak_bytes"] for r in runs[m]) / 2**20,
                        runs[m][0]["loss"]) for m in METHODS}
            rows.append(f"| {offload} | {tokens} | {cell['eager'][0]:.3f} | {cell['compiled'][0]:.3f} | "
                        f"{cell['eager'][1]:.0f} | {cell['compiled'][1]:.0f} | "
                        f"{cell['eager'][2]:.4f} / {cell['compiled'][2]:.4f} |")
            print(rows[-1], flush=True)
    text = (
        "## torch.compile of an applied model\n\n"
        f"`python bench/compile.py --tokens {args.tokens} --rounds {args.rounds} --offload {args.offload} "
        f"--device {args.device} --write` on {platform.processor() or platform.machine()}, {os.cpu_count()} cores: "
        "one training step (SGD) of the demo's Llama after `apply()`, eager against "
        "`torch.compile(model, fullgraph=True)` (inductor), median of the rounds, each in a fresh process.\n\n"
        "| offload | tokens | eager s | compiled s | eager peak MiB | compiled peak MiB | loss eager / compiled |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    if args.write:
        write_section("torch.compile of an applied model", text)
    else:
        print(text)


if __name__ == "__main__":
    main()
