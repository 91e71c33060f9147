"""Memory and time of a distillation step against a remote teacher's candidates, as TRL 1.16's async distillation
trainer computes its loss, and through ``candidate_divergence``.

    .venv/bin/python bench/candidate_distillation.py [--tokens 4096,8192,16384] [--top-k 8] [--beta 0.0] [--write]

The student is the demo's Llama (hidden 512, MLP 1408, 8 layers, vocabulary 32K, float32, random weights), one row
of T tokens, all counted. The teacher is a server's answer: K candidate ids a token and their log-probabilities
(random here). The student's backbone runs with gradients, its last hidden states go through the LM head into the
divergence over the candidates (tail bucket, temperature 0.7), then backward. Two ways: TRL's
``_chunked_jsd_loss`` (256-token chunks of float32 logits, each checkpointed) and ``candidate_divergence`` (the
``token_logprobs`` op with K ids a token). One step per fresh process after a 128-token warm-up step: growth of the
resident set during the step (VmHWM, reset just before; MALLOC_MMAP_THRESHOLD_ fixed as the other benches do) and
its time.
"""

import argparse
import json
import subprocess
import sys

from measure import demo_llama, machine, measured_long_step, slope, worker_env, write_section

TITLE = "Distillation from a remote teacher's candidates: a step's divergence"
WAYS = ("TRL's async path", "candidate_divergence")
VOCAB = 32000


def worker(way, tokens, top_k, beta):
    import torch
    from trl.experimental.async_distillation.async_distillation_trainer import _chunked_jsd_loss

    import torch_offload

    torch.manual_seed(0)
    student = demo_llama(512, 1408, 8, tokens).train()

    def step(length):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, VOCAB, (length,), generator=generator)
        candidates = torch.rand(length, VOCAB, generator=generator).topk(top_k, -1).indices
        teacher = torch.log_softmax(torch.randn(length, top_k + 1, generator=generator), -1)[:, :top_k]
        hidden = student.model(input_ids=ids[None]).last_hidden_state[0]
        if way == WAYS[0]:
            mask = torch.ones_like(candidates, dtype=torch.bool)
            loss = _chunked_jsd_loss(
                hidden,
                student.lm_head.weight,
                None,
                1.0,
                None,
                candidates,
                teacher,
                mask,
                beta,
                0.7,
                True,
                None,
                1,
                256,
            )[0]
        else:
            divergence, _ = torch_offload.candidate_divergence(
                hidden, student.lm_head.weight, candidates, teacher, beta=beta, temperature=0.7
            )
            loss = divergence.sum()
        loss.backward()
        student.zero_grad(set_to_none=True)
        return loss.item()

    loss, seconds, peak = measured_long_step(step, tokens)
    return dict(peak=peak, seconds=seconds, loss=loss)


def run(way, tokens, top_k, beta):
    command = [sys.executable, __file__, "--run", way, str(tokens), str(top_k), str(beta)]
    done = subprocess.run(command, capture_output=True, text=True, env=worker_env())
    if done.returncode != 0:
        print(f"{way} {tokens}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    result = json.loads(done.stdout)
    print(f"{way} {tokens}: {result['peak'] / 2**20:.0f} MiB, {result['seconds']:.1f} s", flush=True)
    return result


def table(results, lengths, top_k, beta):
    base = results[WAYS[0]]
    rows = [
        "| way | "
        + " | ".join(f"{t // 1024}K MiB (s)" for t in lengths)
        + " | KiB per token | peak vs TRL's | time vs TRL's |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " | ---: | ---: | ---: |",
    ]
    for way in WAYS:
        points = {t: p for t, p in results[way].items() if p is not None}
        cells = " | ".join(
            f"{points[t]['peak'] / 2**20:.0f} ({points[t]['seconds']:.1f})" if t in points else "failed"
            for t in lengths
        )
        measured = [t for t in lengths if t in points and base.get(t)]
        peaks = " / ".join(f"{points[t]['peak'] / base[t]['peak']:.2f}x" for t in measured)
        times = " / ".join(f"{points[t]['seconds'] / base[t]['seconds']:.2f}x" for t in measured)
        per_token = f"{slope(points):.1f}" if len(points) > 1 else "—"
        rows.append(f"| {way} | {cells} | {per_token} | {peaks} | {times} |")
    losses = {way: results[way][lengths[-1]]["loss"] for way in WAYS if results[way][lengths[-1]] is not None}
    command = "`.venv/bin/python bench/candidate_distillation.py " + " ".join(sys.argv[1:]) + "`"
    return (
        f"## {TITLE}\n\n{command} ({machine()}). The demo's Llama as the student (float32, random weights), one row "
        f"of T tokens, a teacher's {top_k} candidates a token with their log-probabilities (random): the backbone "
        f"with gradients, the head into the divergence over the candidates (tail bucket, beta {beta}, temperature "
        "0.7) and backward, one step per fresh process: resident set growth during the step and its time; the ratios "
        "per length, against TRL's async distillation path.\n\n"
        + "\n".join(rows)
        + "\n\nLoss at the longest length: "
        + ", ".join(f"{way} {loss:.6f}" for way, loss in losses.items())
        + ".\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--top-k", type=int, default=8, help="the teacher's candidates a token (TRL's default)")
    parser.add_argument("--beta", type=float, default=0.0, help="0: forward KL, the top-k support TRL's async uses")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--run", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        way, tokens, top_k, beta = args.run
        json.dump(worker(way, int(tokens), int(top_k), float(beta)), sys.stdout)
        return
    lengths = [int(t) for t in args.tokens.split(",")]
    results = {way: {t: run(way, t, args.top_k, args.beta) for t in lengths} for way in WAYS}
    text = table(results, lengths, args.top_k, args.beta)
    print(text)
    if args.write:
        write_section(TITLE, text)


if __name__ == "__main__":
    main()
