"""attention_block on the CPU: peak memory and fwd+bwd time of a Llama attention sub-layer against the
same arithmetic in eager torch, plain and checkpointed, float32, h=512, 8 heads of 64.

    .venv/bin/python bench/attention_block.py   # rewrites BENCHMARKS.md's attention_block section

(with the package installed, e.g. by `make test`; or PYTHONPATH and TORCH_OFFLOAD_LIBRARY pointing at a build).

Each measurement runs in a fresh process: its first fwd+bwd gives the peak memory, the growth
of the resident set over that run (VmHWM after it, with the high-water mark reset to VmRSS just
before it; x, the rotary tables and grad_out already allocated); a second fwd+bwd gives the
time. The methods take turns, round after round; each cell is the median over the rounds.
"""

import argparse
import statistics
import subprocess
import sys
import time

from measure import machine, reset_peak_rss, status_bytes, write_section

HIDDEN, HEADS, HEAD_DIM = 512, 8, 64
TOKENS = (4096, 16384)
METHODS = ("eager", "checkpointed", "attention_block")


def worker(method, tokens):
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    import torch_offload

    torch.manual_seed(0)
    w_q, w_k, w_v, w_o = (torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5) for _ in range(4))

    def eager(x, cos, sin):  # what transformers' LlamaAttention computes, with SDPA
        q, k, v = (F.linear(x, w).view(1, tokens, HEADS, HEAD_DIM).transpose(1, 2) for w in (w_q, w_k, w_v))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(out.transpose(1, 2).reshape(1, tokens, HIDDEN), w_o)

    step = {
        "eager": eager,
        "checkpointed": lambda *a: checkpoint(eager, *a, use_reentrant=False),
        "attention_block": lambda x, cos, sin: torch_offload.attention_block(x, w_q, w_k, w_v, w_o, cos, sin),
    }[method]
    x = torch.randn(1, tokens, HIDDEN, requires_grad=True)
    angles = (torch.arange(tokens)[:, None] / 10000 ** (torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))).repeat(1, 2)
    cos, sin = angles.cos()[None], angles.sin()[None]
    grad_out = torch.randn(1, tokens, HIDDEN)

    def fwd_bwd():
        for p in (x, w_q, w_k, w_v, w_o):
            p.grad = None
        step(x, cos, sin).backward(grad_out)

    before = reset_peak_rss()
    fwd_bwd()
    peak = status_bytes("VmHWM") - before
    start = time.perf_counter()
    fwd_bwd()
    print(f"{peak} {time.perf_counter() - start}")


def run(method, tokens):
    out = subprocess.run(
        [sys.executable, __file__, "--worker", method, str(tokens)], check=True, capture_output=True, text=True
    ).stdout.split()
    return int(out[0]), float(out[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "TOKENS"))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    rows = []
    for tokens in args.tokens:
        runs = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for m in METHODS:
                runs[m].append(run(m, tokens))
        (em, et), (cm, ct), (am, at) = (
            (statistics.median(r[0] for r in runs[m]), statistics.median(r[1] for r in runs[m])) for m in METHODS
        )
        mib = 1 << 20
        rows.append(
            f"| {tokens} | {em / mib:.0f} | {cm / mib:.0f} | {am / mib:.0f} | **{am / em:.2f}** "
            f"| **{am / cm:.2f}** | {et:.2f} | {ct:.2f} | {at:.2f} | **{at / et:.2f}** | **{at / ct:.2f}** |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "## attention_block",
            "",
            f"`{' '.join(['.venv/bin/python', 'bench/attention_block.py', *sys.argv[1:]])}` — CPU float32, batch 1, "
            f"h={HIDDEN}, {HEADS} heads of {HEAD_DIM} (no grouped-query), no biases, fwd+bwd (x and the four weights "
            f"need gradients). {machine()}.",
            "",
            "(a) eager: the projections, transformers' apply_rotary_pos_emb and F.scaled_dot_product_attention "
            "(its CPU flash kernels), as LlamaAttention computes them; (c) (a) under non-reentrant "
            "torch.utils.checkpoint, what apply() did before the op; (b) `torch_offload.attention_block` (automatic "
            "head groups). Peak: growth of the resident set (VmHWM over VmRSS) during one fwd+bwd in a fresh process, "
            "inputs and grad_out allocated before; time: the next fwd+bwd in that process. Methods take turns for "
            f"{args.rounds} rounds; each cell is the median.",
            "",
            "| tokens | peak (a) MiB | peak (c) MiB | peak (b) MiB | peak (b)/(a) | peak (b)/(c) | time (a) s "
            "| time (c) s | time (b) s | time (b)/(a) | time (b)/(c) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
        ]
    )
    if not args.no_write:
        write_section("attention_block", text)
    print(text)


if __name__ == "__main__":
    main()
