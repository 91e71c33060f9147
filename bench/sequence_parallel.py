"""Per-rank memory of sequence parallelism: one training step of transformers' LlamaForCausalLM (hidden
512, MLP 1408, 8 layers, 8 heads, vocabulary 32K, float32) with apply(offload="disk"), the sequence split
over N Gloo CPU ranks (apply(..., sequence_parallel=group), shard_batch), against the same on one rank.

    .venv/bin/python bench/sequence_parallel.py [--ranks 1,2,4] [--tokens 4096,8192] [--budget-gib 8] [--write]

Each point is one step in fresh processes (one per rank), after a warm-up step: the growth of each rank's
resident set (VmHWM, reset just before); a point's peak is the largest rank's. Bytes per token is the
least-squares slope over the lengths (whole-sequence tokens). As in bench/real_batches.py, glibc's mmap
threshold is fixed at 1 MiB and the disk tier's unwritten bytes capped at 32 MiB with no restore buffers
kept, so that what does not grow with T holds still. The warm-up step also counts the bytes each rank
hands to all-to-all (the inputs of _c10d_functional::all_to_all_single, forward and backward, as the
profiler records them; (N - 1) / N of them leave the rank).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from measure import ROOT, machine, reset_peak_rss, status_bytes, worker_env, write_section

LAYERS, HIDDEN = 8, 512


def worker(tokens, warmup_tokens):
    import torch
    import torch.distributed as dist
    import transformers

    import torch_offload

    ranks = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    group = dist.group.WORLD if ranks > 1 else None
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=HIDDEN,
        intermediate_size=1408,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    spill = tempfile.TemporaryDirectory()
    torch_offload.configure_disk_spill(max_in_flight_bytes=32 << 20, restore_cache_bytes=0)
    torch_offload.apply(model, offload="disk", spill_directory=spill.name, min_bytes=1 << 16, sequence_parallel=group)

    def step(length):
        ids = torch.randint(3, 32000, (1, length), generator=torch.Generator().manual_seed(0))
        batch = dict(input_ids=ids, labels=ids)
        model(**(torch_offload.shard_batch(batch, group) if group else batch), use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    # The exchanges run inside the ops' kernels: the profiler sees them (every dispatcher call is recorded).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        step(warmup_tokens)
    sent = sum(
        math.prod(event.input_shapes[0]) * 4
        for event in profile.events()  # float32
        if event.name == "_c10d_functional::all_to_all_single"
    )
    before = reset_peak_rss()
    step(tokens)
    peak = status_bytes("VmHWM") - before
    print(json.dumps({"peak": peak, "all_to_all_bytes": sent, "warmup_tokens": warmup_tokens}))
    dist.barrier()
    dist.destroy_process_group()
    spill.cleanup()


def measure(ranks, tokens, port):
    """Each rank's result of one step at `tokens` over `ranks` ranks."""
    warmup = 128 * ranks
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(tokens), str(warmup)],
            env=dict(
                worker_env(),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(ranks),
                OMP_NUM_THREADS=str(max(1, os.cpu_count() // ranks)),
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed at {ranks} ranks, {tokens} tokens")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def slope(points):
    """(bytes per token, intercept bytes): the least-squares line through (tokens, peak bytes)."""
    tokens = list(points)
    mean_t = sum(tokens) / len(tokens)
    mean_b = sum(points.values()) / len(tokens)
    per_token = sum((t - mean_t) * (points[t] - mean_b) for t in tokens) / sum((t - mean_t) ** 2 for t in tokens)
    return per_token, mean_b - per_token * mean_t


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="per-rank memory for the longest context")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    lengths = [int(t) for t in args.tokens.split(",")]
    rows, port = [], 29600
    for ranks in (int(n) for n in args.ranks.split(",")):
        points, traffic = {}, 0.0
        for tokens in lengths:
            port += 1
            results = measure(ranks, tokens, port)
            points[tokens] = max(r["peak"] for r in results)
            traffic = max(r["all_to_all_bytes"] / r["warmup_tokens"] / LAYERS for r in results)
            peaks = " / ".join(f"{r['peak'] / 2**20:.0f}" for r in results)
            print(f"{ranks} ranks {tokens:6d} tokens: per-rank peaks {peaks} MiB", flush=True)
        rows.append((ranks, slope(points), points, traffic))
    one_rank = rows[0][1][0]
    budget = args.budget_gib * 2**30
    table = [
        "| ranks | per-rank KiB/token | / one rank | longest context in "
        f"{args.budget_gib:g} GiB per rank | all-to-all sent per rank, bytes per token per layer | peaks MiB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ranks, (per_token, intercept), points, traffic in rows:
        longest = (budget - intercept) / per_token
        peaks = " / ".join(f"{p / 2**20:.0f}" for p in points.values())
        table.append(
            f"| {ranks} | {per_token / 1024:.2f} | **{per_token / one_rank:.2f}** | "
            f"{longest / 1e3:,.0f}K tokens | {traffic:,.0f} | {peaks} |"
        )
    command = f"`.venv/bin/python bench/sequence_parallel.py --ranks {args.ranks} --tokens {args.tokens}" + (
        " --write`" if args.write else "`"
    )
    text = (
        f"## Sequence parallelism\n\n{command} ({machine()}). transformers' LlamaForCausalLM (hidden "
        f'{HIDDEN}, MLP 1408, {LAYERS} layers, 8 heads, vocabulary 32K, float32), `apply(offload="disk")` on '
        "one rank and with `sequence_parallel=` the Gloo group of N CPU ranks (each rank a process on this "
        "machine, `shard_batch` giving it T/N tokens); one step per fresh set of processes; a point's peak is "
        f"the largest rank's VmHWM growth; KiB/token is the slope over {lengths} whole-sequence tokens, the "
        "longest context extrapolates that line. All-to-all traffic is counted on the warm-up step (128 x N "
        "tokens) and divided by its tokens and layers.\n\n" + "\n".join(table) + "\n"
    )
    print(text)
    if args.write:
        write_section("Sequence parallelism", text)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    main()
