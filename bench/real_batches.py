"""Bytes per token of one training step on the batches users train on: one sequence, packed
documents (position_ids restarting at 0) and padded rows (attention_mask), plain training against
apply(offload="disk"), on transformers' LlamaForCausalLM (hidden 512, MLP 1408, 8 layers,
vocabulary 32K, float32).

    .venv/bin/python bench/real_batches.py [--tokens 4096,8192] [--plain-tokens 4096,8192] [--write]

Each point is one step in a fresh process, after a short warm-up step: the growth of the resident
set (VmHWM, reset just before). Bytes per token is the least-squares slope over the lengths. Two things
that do not grow with T are held still, or they outweigh what does at these lengths: glibc's mmap
threshold is fixed at 1 MiB (its default grows as big blocks are freed, and blocks up to 32 MiB then
stay in the resident set: one sequence measured 929, 1579 and 879 MiB at 4K, 8K and 16K tokens), and
the disk tier's unwritten bytes are capped at --in-flight-mib (default 32; 512 by default) with no
restore buffers kept (the default).

Batches: "one sequence" is one row of T tokens; "packed" one row of 4 documents of T/4 tokens each;
"padded" 2 rows of T/2 tokens, the second right-padded by a quarter (labels -100 on the padding), so
every batch holds T token slots.
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile

from measure import machine, reset_peak_rss, slope, status_bytes, worker_env, write_section

BATCHES = ("one sequence", "packed", "padded")


def batch(kind, tokens):
    import torch

    ids = torch.randint(3, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))
    if kind == "one sequence":
        return dict(input_ids=ids, labels=ids)
    if kind == "packed":
        return dict(input_ids=ids, labels=ids, position_ids=torch.arange(tokens).remainder(tokens // 4)[None])
    rows = ids.view(2, tokens // 2)
    mask = torch.ones_like(rows)
    mask[1, -tokens // 8 :] = 0
    return dict(input_ids=rows, labels=rows.masked_fill(mask == 0, -100), attention_mask=mask)


def worker(kind, method, tokens, in_flight_mib):
    import torch
    import transformers

    import torch_offload

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    spill = tempfile.TemporaryDirectory()
    handle = None
    if method == "apply(disk)":
        # Unwritten spills are bounded but timing-dependent: at their default (512 MiB) they outweigh
        # what grows with T at these lengths and make points wander.
        torch_offload.configure_disk_spill(max_in_flight_bytes=in_flight_mib << 20, restore_cache_bytes=0)
        handle = torch_offload.apply(model, offload="disk", spill_directory=spill.name, min_bytes=1 << 16)

    def step(inputs):
        model(**inputs, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step(batch(kind, 128))
    inputs = batch(kind, tokens)
    before = reset_peak_rss()
    step(inputs)
    peak = status_bytes("VmHWM") - before
    fallbacks = handle.mask_fallbacks if handle is not None else {}
    spill.cleanup()
    print(json.dumps({"peak": peak, "fallbacks": fallbacks}))


def measure(kind, method, tokens, in_flight_mib):
    out = subprocess.run(
        [sys.executable, __file__, "--worker", kind, method, str(tokens), str(in_flight_mib)],
        env=worker_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--plain-tokens", default="4096,8192", help="plain training's lengths (its masks grow as T^2)")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    parser.add_argument("--in-flight-mib", type=int, default=32, help="the disk tier's unwritten bytes at most")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, method, tokens, in_flight_mib = args.worker
        worker(kind, method, int(tokens), int(in_flight_mib))
        return
    lengths = {
        "plain": [int(t) for t in args.plain_tokens.split(",")],
        "apply(disk)": [int(t) for t in args.tokens.split(",")],
    }
    rows = []
    for kind in BATCHES:
        slopes = {}
        for method, tokens in lengths.items():
            points = {t: measure(kind, method, t, args.in_flight_mib) for t in tokens}
            for t, point in points.items():
                print(
                    f"{kind:13s} {method:12s} {t:6d} tokens: {point['peak'] / 2**20:8.1f} MiB "
                    f"{point['fallbacks'] or ''}",
                    flush=True,
                )
            slopes[method] = (slope(points), points)
        rows.append((kind, slopes))
    single = rows[0][1]["apply(disk)"][0]
    mib = lambda points: " / ".join(f"{p['peak'] / 2**20:.0f}" for p in points.values())  # noqa: E731
    table = [
        "| batch | plain KiB/token | apply(disk) KiB/token | apply(disk) / its one-sequence figure | "
        "plain peaks MiB | apply(disk) peaks MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, slopes in rows:
        table.append(
            f"| {kind} | {slopes['plain'][0]:.0f} | {slopes['apply(disk)'][0]:.1f} | "
            f"**{slopes['apply(disk)'][0] / single:.2f}** | {mib(slopes['plain'][1])} | "
            f"{mib(slopes['apply(disk)'][1])} |"
        )
    command = "`" + shlex.join([".venv/bin/python", "bench/real_batches.py", *sys.argv[1:]]) + "`"
    text = (
        f"## Packed and padded batches\n\n{command} ({machine()}). transformers' LlamaForCausalLM (hidden 512, "
        "MLP 1408, 8 layers, vocabulary 32K, float32); one step per fresh process; bytes per token is the "
        f"least-squares slope of the resident set's growth over {lengths['apply(disk)']} tokens (plain: "
        f"{lengths['plain']}; its dense masks make longer ones too slow here); `MALLOC_MMAP_THRESHOLD_` "
        f"1 MiB, the disk tier's unwritten bytes capped at {args.in_flight_mib} MiB and no restore buffers "
        "kept (`configure_disk_spill`): see the script's docstring. Packed: 4 documents in one row "
        "(position_ids restarting at 0); padded: 2 rows, the second right-padded by a quarter.\n\n"
        + "\n".join(table)
        + "\n"
    )
    print(text)
    if args.write:
        write_section("Packed and padded batches", text)


if __name__ == "__main__":
    main()
