"""Memory and time of a distillation step, as TRL 1.16's DistillationTrainer computes its loss, three ways.

    .venv/bin/python bench/distillation.py [--tokens 4096,8192,16384] [--beta 0.5] [--write]

A student and a teacher, each the demo's Llama (hidden 512, MLP 1408, 8 layers, vocabulary 32K, float32, random
weights, the teacher's of another seed), one row of T tokens, all of them counted: the student's backbone with
gradients, the teacher's without, both last hidden states through their LM heads into the generalized JSD (beta,
temperature 0.7) and backward. Three ways for the heads and the divergence: eager (both [T, V] logits, TRL's
``GKDTrainer.generalized_jsd_loss``), TRL's chunked path (``_chunked_divergence_loss`` with its
``ChunkedDivergenceFunction``, what DistillationTrainer runs), and the same path through ``token_divergence``
(TorchOffloadCallback's stand-in). One step per fresh process after a 128-token warm-up step: growth of the resident
set during the step (VmHWM, reset just before; MALLOC_MMAP_THRESHOLD_ fixed as the other benches do) and its time.
"""

import argparse
import json
import subprocess
import sys

from measure import demo_llama, machine, measured_long_step, slope, worker_env, write_section

TITLE = "Distillation: a step's divergence between two heads"
WAYS = ("eager", "TRL's chunked path", "token_divergence")


def worker(way, tokens, beta):
    import torch
    import trl.trainer.distillation_trainer as distillation_trainer
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    from torch_offload import trl_distillation

    torch.manual_seed(0)
    student = demo_llama(512, 1408, 8, tokens).train()
    torch.manual_seed(1)
    teacher = demo_llama(512, 1408, 8, tokens).eval().requires_grad_(False)
    head = trl_distillation.install(
        "bench", distillation_trainer.DistillationConfig("bench", report_to=[], use_cpu=True, bf16=False)
    )[0]
    if way != WAYS[2]:
        distillation_trainer.ChunkedDivergenceFunction = head.original

    def step(length):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 32000, (1, length), generator=generator)
        hidden = student.model(input_ids=ids).last_hidden_state
        with torch.no_grad():
            teacher_hidden = teacher.model(input_ids=ids).last_hidden_state
        if way == WAYS[0]:
            # [T, V] rows: "batchmean" divides by the tokens, as TRL's chunked path's mean over them.
            loss = GKDTrainer.generalized_jsd_loss(
                student.lm_head(hidden)[0], teacher.lm_head(teacher_hidden)[0], beta=beta, temperature=0.7
            )
        else:
            loss = distillation_trainer._chunked_divergence_loss(
                hidden,
                teacher_hidden,
                student.lm_head.weight,
                teacher.lm_head.weight,
                torch.ones_like(ids),
                beta,
                temperature=0.7,
            )[0]
        loss.backward()
        student.zero_grad(set_to_none=True)
        return loss.item()

    loss, seconds, peak = measured_long_step(step, tokens)
    return dict(peak=peak, seconds=seconds, loss=loss, calls=head.calls)


def run(way, tokens, beta):
    """The worker's result, or None where it failed (out of memory)."""
    command = [sys.executable, __file__, "--run", way, str(tokens), str(beta)]
    done = subprocess.run(command, capture_output=True, text=True, env=worker_env())
    if done.returncode != 0:
        print(f"{way} {tokens}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    result = json.loads(done.stdout)
    print(f"{way} {tokens}: {result['peak'] / 2**20:.0f} MiB, {result['seconds']:.1f} s", flush=True)
    return result


def table(results, lengths, beta):
    base = {t: results[WAYS[1]][t] for t in lengths}
    rows = [
        "| way | "
        + " | ".join(f"{t // 1024}K MiB (s)" for t in lengths)
        + " | KiB per token | peak vs TRL's chunked path | time vs TRL's chunked path |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " | ---: | ---: | ---: |",
    ]
    for way in WAYS:
        points = {t: p for t, p in results[way].items() if p is not None}
        cells = " | ".join(
            f"{points[t]['peak'] / 2**20:.0f} ({points[t]['seconds']:.1f})" if t in points else "not run"
            for t in lengths
        )
        peaks = " / ".join(f"{points[t]['peak'] / base[t]['peak']:.2f}x" for t in lengths if t in points)
        times = " / ".join(f"{points[t]['seconds'] / base[t]['seconds']:.2f}x" for t in lengths if t in points)
        per_token = f"{slope(points):.1f}" if len(points) > 1 else "—"
        rows.append(f"| {way} | {cells} | {per_token} | {peaks} | {times} |")
    losses = {way: results[way][lengths[-1]]["loss"] for way in WAYS if results[way][lengths[-1]] is not None}
    command = "`.venv/bin/python bench/distillation.py " + " ".join(sys.argv[1:]) + "`"
    return (
        f"## {TITLE}\n\n{command} ({machine()}). A student and a teacher, each the demo's Llama (float32, random "
        f"weights), one row of T tokens: the student's backbone with gradients, the teacher's without, both heads into "
        f"the generalized JSD (beta {beta}, temperature 0.7) and backward, one step per fresh process: resident set "
        "growth during the step and its time; the ratios per length, against TRL's chunked path "
        "(DistillationTrainer's).\n\n"
        + "\n".join(rows)
        + "\n\nLoss at the longest length: "
        + ", ".join(f"{way} {loss:.6f}" for way, loss in losses.items())
        + f". The op served {results[WAYS[2]][lengths[-1]]['calls']} call(s) of the last way's step.\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--eager-max", type=int, default=8192, help="the most tokens eager runs at")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        json.dump(worker(args.run[0], int(args.run[1]), float(args.run[2])), sys.stdout)
        return
    lengths = [int(t) for t in args.tokens.split(",")]
    # Eager past --eager-max holds tens of GiB of [T, V] temporaries (9 GiB at 4K): not run, its cells say so.
    results = {
        way: {t: run(way, t, args.beta) if way != WAYS[0] or t <= args.eager_max else None for t in lengths}
        for way in WAYS
    }
    text = table(results, lengths, args.beta)
    print(text)
    if args.write:
        write_section(TITLE, text)


if __name__ == "__main__":
    main()
