"""Memory and time of a GRPO policy step's scoring, as TRL 1.16's GRPOTrainer runs it, with and without
TorchOffloadCallback's pieces.

    .venv/bin/python bench/rl_head.py [--tokens 4096,8192,16384] [--write]

The demo's Llama (hidden 512, MLP 1408, 8 layers, vocabulary 32K, float32, random weights) patched with TRL's fused
LM head as GRPOTrainer patches it (`add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))`),
one row of a 64-token prompt and T completion tokens, and the step GRPO's loss takes: `model(input_ids,
attention_mask, labels, fused_lm_head=True)` (labels -100 on the prompt), an advantage-weighted sum of the
log-probabilities plus an entropy bonus, backward. Generation, rewards and the optimizer are left out: they are the
same with and without the callback. Three ways, one step per fresh process after a 128-token warm-up step: TRL's head
alone; `apply(model)` with TRL's head (the callback before it routed the head); and `apply(model)` with TRL's calls
through `token_logprobs` (TorchOffloadCallback now). Growth of the resident set during the step (VmHWM, reset just
before; MALLOC_MMAP_THRESHOLD_ fixed as the other benches do) and its time; bytes per token is the least-squares
slope over the lengths.
"""

import argparse
import json
import subprocess
import sys

from measure import demo_llama, machine, measured_long_step, slope, worker_env, write_section

TITLE = "RL: a GRPO step's scoring"
WAYS = ("TRL's head", "apply() + TRL's head", "apply() + token_logprobs")
PROMPT = 64


def worker(way, tokens):
    import torch
    import trl.trainer.utils as trl_utils

    import torch_offload
    from torch_offload import trl_fused_head

    torch.manual_seed(0)
    model = demo_llama(512, 1408, 8, PROMPT + tokens).train()
    trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    # As the callback: TRL's head recognized on the model before apply() wraps its forward.
    head = trl_fused_head.install(model, "bench")[0] if way == WAYS[2] else None
    if way != WAYS[0]:
        torch_offload.apply(model)

    def step(length):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 32000, (1, PROMPT + length), generator=generator)
        labels = ids.clone()
        labels[:, :PROMPT] = -100
        mask = torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        advantages = torch.randn(out.log_probs.shape, generator=generator)  # log_probs score the shifted labels
        loss = -(advantages * out.log_probs).sum() / length - 0.01 * out.entropy.sum() / length
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    loss, seconds, peak = measured_long_step(step, tokens)
    return dict(peak=peak, seconds=seconds, loss=loss, calls=head.calls if head else 0)


def run(way, tokens):
    command = [sys.executable, __file__, "--run", way, str(tokens)]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, env=worker_env()).stdout)
    print(f"{way} {tokens}: {result['peak'] / 2**20:.0f} MiB, {result['seconds']:.1f} s", flush=True)
    return result


def table(results, lengths):
    last = lengths[-1]
    rows = [
        "| way | "
        + " | ".join(f"{t // 1024}K MiB (s)" for t in lengths)
        + f" | KiB per token | {last // 1024}K peak vs TRL's head | {last // 1024}K time vs TRL's head |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " | ---: | ---: | ---: |",
    ]
    base = results[WAYS[0]][last]
    for way in WAYS:
        points = results[way]
        cells = " | ".join(f"{points[t]['peak'] / 2**20:.0f} ({points[t]['seconds']:.1f})" for t in lengths)
        rows.append(
            f"| {way} | {cells} | {slope(points):.1f} | {points[last]['peak'] / base['peak']:.3f}x | "
            f"{points[last]['seconds'] / base['seconds']:.2f}x |"
        )
    losses = {way: results[way][lengths[-1]]["loss"] for way in WAYS}
    command = "`.venv/bin/python bench/rl_head.py " + " ".join(sys.argv[1:]) + "`"
    return (
        f"## {TITLE}\n\n{command} ({machine()}). The demo's Llama with TRL 1.16's fused LM head as GRPOTrainer "
        "patches it (temperature 0.7, log-probabilities and entropies), a 64-token prompt and T completion tokens, the "
        "policy step of GRPO's loss (forward with `fused_lm_head=True`, advantage-weighted log-probabilities and an "
        "entropy bonus, backward; no generation, no optimizer), one step per fresh process: resident set growth "
        "during the step and its time.\n\n"
        + "\n".join(rows)
        + "\n\nLoss at the longest length: "
        + ", ".join(f"{way} {loss:.6f}" for way, loss in losses.items())
        + f". The op served {results[WAYS[2]][lengths[-1]]['calls']} call(s) of the last way's step.\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--run", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        json.dump(worker(args.run[0], int(args.run[1])), sys.stdout)
        return
    lengths = [int(t) for t in args.tokens.split(",")]
    results = {way: {t: run(way, t) for t in lengths} for way in WAYS}
    text = table(results, lengths)
    print(text)
    if args.write:
        write_section(TITLE, text)


if __name__ == "__main__":
    main()
