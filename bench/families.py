"""Peak training memory per token across model families: plain training against `torch_offload.apply(model)`
with every default (on a CPU: the disk tier in the temp directory), on small random models of 20 transformers
families (hidden 256, 4 layers, 4 attention heads, 2 key/value heads, MLP 512, vocabulary 32K, float32;
mixture-of-experts blocks with 4 experts, top-2, experts of 256).

    .venv/bin/python bench/families.py [--families llama,phi3,...] [--tokens 2048,4096] [--write]

Each point is one training step (forward with labels, backward) of one row of T random tokens in a fresh
process, after a 128-token warm-up step: the growth of the resident set (VmHWM, reset just before the
step), with glibc's mmap threshold fixed at 1 MiB (see measure.worker_env). KiB per token is the
least-squares slope over the lengths. Attention is "sdpa" where the family takes it, else what transformers
picks (Gemma 2 and GPT-OSS refuse sdpa: eager). The disk tier keeps its defaults (512 MiB of unwritten
bytes, no restore buffers kept), which do not grow with T but may move single points.

The last column of the table is what apply() left as the model had it, from `handle.report()`: the MLPs and
attentions it left "own", and why, the loss when it is not the fused one, and the masks.
"""

import argparse
import json
import subprocess
import sys
import time

from measure import machine, reset_peak_rss, slope, status_bytes, user_env, worker_env, write_section

SMALL = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
HEAD = dict(head_dim=64)  # hidden 256 over 4 heads, where a family's config sets its own head size
MOE = dict(num_experts_per_tok=2)

# key: (name, model class, config class, the family's own fields); field names from transformers 5.24's configs.
FAMILIES = {
    "llama": ("Llama", "LlamaForCausalLM", "LlamaConfig", {}),
    "mistral": ("Mistral", "MistralForCausalLM", "MistralConfig", {}),
    "qwen2": ("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", HEAD),
    "gemma": ("Gemma", "GemmaForCausalLM", "GemmaConfig", HEAD),
    "gemma2": ("Gemma 2", "Gemma2ForCausalLM", "Gemma2Config", HEAD),
    "gemma3": ("Gemma 3 (text)", "Gemma3ForCausalLM", "Gemma3TextConfig", HEAD),
    "phi3": ("Phi-3", "Phi3ForCausalLM", "Phi3Config", {}),
    "mixtral": (
        "Mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(**MOE, num_local_experts=4, intermediate_size=256),
    ),
    "qwen2_moe": (
        "Qwen2-MoE",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(**MOE, num_experts=4, moe_intermediate_size=256, shared_expert_intermediate_size=512),
    ),
    "qwen3_moe": (
        "Qwen3-MoE",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(**MOE, **HEAD, num_experts=4, moe_intermediate_size=256),
    ),
    "deepseek_v3": (
        "DeepSeek-V3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            **MOE,
            # MLA expands its latent into a key and a value per head: transformers' SDPA call would repeat
            # them again by num_attention_heads / num_key_value_heads (DeepSeek-V3's own config has the two equal).
            num_key_value_heads=4,
            n_routed_experts=4,
            moe_intermediate_size=256,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
    "gpt_oss": (
        "GPT-OSS",
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(**MOE, **HEAD, num_local_experts=4, intermediate_size=256),
    ),
    "olmo2": ("OLMo 2", "Olmo2ForCausalLM", "Olmo2Config", {}),
    "cohere": ("Cohere", "CohereForCausalLM", "CohereConfig", {}),
    "granite": ("Granite", "GraniteForCausalLM", "GraniteConfig", {}),
    "smollm3": ("SmolLM3", "SmolLM3ForCausalLM", "SmolLM3Config", {}),
    "glm4": ("GLM-4", "Glm4ForCausalLM", "Glm4Config", HEAD),
    # Gemma 3n as released: layers past a point attend with an earlier layer's keys and values.
    "gemma3n": (
        "Gemma 3n (text)",
        "Gemma3nForCausalLM",
        "Gemma3nTextConfig",
        dict(
            **HEAD,
            vocab_size_per_layer_input=32000,
            hidden_size_per_layer_input=64,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
        ),
    ),
    "llama4": (
        "Llama 4 (text)",
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        dict(**MOE, **HEAD, num_local_experts=4, intermediate_size=256, intermediate_size_mlp=512),
    ),
}
METHODS = ("plain", "apply()")


def build(family, longest):
    """The family's small model, random weights; attention "sdpa" unless the model refuses it (then True)."""
    import torch
    import transformers

    _, model_class, config_class, own = FAMILIES[family]
    model_class, config_class = getattr(transformers, model_class), getattr(transformers, config_class)

    def config(**attention):
        config = config_class(**{**SMALL, "max_position_embeddings": longest, **own}, **attention)
        if config.pad_token_id is not None and config.pad_token_id >= config.vocab_size:
            config.pad_token_id = None  # Phi-3's, SmolLM3's and GLM-4's are past a 32K vocabulary
        return config

    torch.manual_seed(0)
    try:
        return model_class(config(attn_implementation="sdpa")), False
    except ValueError as error:
        if "scaled_dot_product_attention" not in str(error):
            raise
        torch.manual_seed(0)
        return model_class(config()), True


def worker(family, method, tokens, longest):
    import torch

    import torch_offload

    model, refused = build(family, longest)
    model.train()
    attention = model.config._attn_implementation + ("; sdpa refused" if refused else "")
    handle = torch_offload.apply(model) if method == "apply()" else None

    def step(length):
        ids = torch.randint(3, 32000, (1, length), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step(128)
    before = reset_peak_rss()
    start = time.perf_counter()
    step(tokens)
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM") - before
    report = handle.report() if handle is not None else None
    calls = handle.chunk_recurrent_calls if handle is not None else 0
    print(json.dumps({"peak": peak, "seconds": seconds, "attention": attention, "report": report, "steps": calls}))


def measure(family, method, tokens, longest, env=None):
    """The worker's point, or {"error": its last line of stderr}."""
    done = subprocess.run(
        [sys.executable, __file__, "--worker", family, method, str(tokens), str(longest)],
        env=env or worker_env(),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        error = lines[-1]
        return {"error": error if len(error) <= 120 else error[:120] + "…"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def left_own(report):
    """In a few words, what apply() left as the model had it: MLPs and attentions "own" and why, the loss when it
    is not the fused one, the masks."""
    layers = sum(len(row["layers"]) for row in report["layers"])
    parts = []
    for column, label in (("mlp", "MLP"), ("attention", "attention")):
        reasons = {}
        for row in report["layers"]:
            if row[column] == "own":
                # The reason without its parenthesis of details (the module names, the probe's input scale).
                why = row["why"].get(column, "?").split(" (")[0]
                reasons.setdefault(why, []).extend(row["layers"])
        parts += [f"{label} own in {len(own)} of {layers} layers: {why}" for why, own in reasons.items()]
    if report["loss"] != "linear_cross_entropy":
        parts.append(f"loss: {report['loss']}")
    masks = report["masks"]
    parts.append("masks: " + ("segment ids" if masks.startswith("segment ids") else masks))
    return "; ".join(parts)


def step_section(families, lengths, plain_tokens):
    """`--step`: apply(model) with no option at ``lengths`` (the chunk-recurrent step on a CPU), glibc's own
    settings, and plain training at ``plain_tokens`` for its step time: BENCHMARKS.md's "Model families through the
    chunk-recurrent step"."""
    start = time.perf_counter()
    rows = [
        f"| family | {' | '.join(f'apply() MiB at {t // 1024}K' for t in lengths)} | growth KiB/token | "
        f"step s at {plain_tokens // 1024}K | plain s | vs plain | route |",
        "| --- |" + " ---: |" * (len(lengths) + 4) + " --- |",
    ]
    for family in families:
        applied = {t: measure(family, "apply()", t, max(lengths), user_env()) for t in lengths}
        plain = measure(family, "plain", plain_tokens, max(lengths), user_env())
        errors = {f"apply() {t}": p["error"] for t, p in applied.items() if "error" in p}
        if "error" in plain:
            errors["plain"] = plain["error"]
        print(family, {t: p.get("peak", 0) // 2**20 for t, p in applied.items()}, errors, flush=True)
        if errors:
            rows.append(f"| {FAMILIES[family][0]} |" + " — |" * (len(lengths) + 4) + f" {errors} |")
            continue
        growth = (applied[lengths[-1]]["peak"] - applied[lengths[0]]["peak"]) / (lengths[-1] - lengths[0]) / 1024
        own = applied[plain_tokens]["seconds"]
        route = "chunk-recurrent step" if applied[lengths[-1]]["steps"] else applied[lengths[-1]]["report"]["route"]
        if not applied[lengths[-1]]["steps"]:
            route += f": {applied[lengths[-1]]['report']['chunk_recurrent']}"
        cells = " | ".join(f"{applied[t]['peak'] / 2**20:.0f}" for t in lengths)
        rows.append(
            f"| {FAMILIES[family][0]} | {cells} | {growth:.2f} | {own:.1f} | {plain['seconds']:.1f} | "
            f"{own / plain['seconds']:.2f}x | {route} |"
        )
    minutes = (time.perf_counter() - start) / 60
    command = "`.venv/bin/python bench/families.py" + "".join(f" {arg}" for arg in sys.argv[1:]) + "`"
    return (
        f"## Model families through the chunk-recurrent step\n\n{command} ({machine()}; {minutes:.0f} minutes). "
        'The families\' small models of "Model families" below, `torch_offload.apply(model)` with no option (on a '
        "CPU the chunk-recurrent step, where the family takes it), one training step of one row of T random tokens "
        "per fresh process after a 128-token warm-up step, glibc's own settings (no `MALLOC_*` variable): the "
        "resident set's growth during the step, its growth per token between the two lengths, and the step's "
        f"seconds at {plain_tokens} tokens against plain training's in the same run.\n\n" + "\n".join(rows) + "\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of: " + ", ".join(FAMILIES))
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--step", action="store_true", help="the chunk-recurrent step's section (tokens 8192,32768)")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        family, method, tokens, longest = args.worker
        worker(family, method, int(tokens), int(longest))
        return
    families = args.families.split(",")
    unknown = [family for family in families if family not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.step:
        lengths = [int(t) for t in args.tokens.split(",")] if args.tokens != "2048,4096" else [8192, 32768]
        text = step_section(families, lengths, lengths[0])
        print(text)
        if args.write:
            write_section("Model families through the chunk-recurrent step", text)
        return
    lengths = [int(t) for t in args.tokens.split(",")]
    start = time.perf_counter()
    results = {}
    for family in families:
        results[family] = {}
        for method in METHODS:
            points = {}
            for t in lengths:
                point = measure(family, method, t, max(lengths))
                shown = point.get("error") or f"{point['peak'] / 2**20:8.1f} MiB ({point['attention']})"
                print(f"{family:12s} {method:8s} {t:6d} tokens: {shown}", flush=True)
                if "error" in point:
                    results[family][method] = point
                    break
                points[t] = point
            else:
                results[family][method] = {"slope": slope(points), **points[lengths[-1]]}
    minutes = (time.perf_counter() - start) / 60
    llama = results.get("llama", {}).get("apply()", {}).get("slope")
    table = [
        "| family | plain KiB/token | apply() KiB/token | multiplier (plain / apply) | "
        "apply() / Llama's apply() KiB/token | what apply() left as the model had it |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for family, methods in results.items():
        plain, applied = methods["plain"], methods["apply()"]
        name = FAMILIES[family][0]
        attention = (plain if "attention" in plain else applied).get("attention", "sdpa")
        if attention != "sdpa":
            name += f" ({attention})"
        if "error" in plain or "error" in applied:
            errors = [f"{method}: {methods[method]['error']}" for method in METHODS if "error" in methods[method]]
            cells = [
                f"{m['slope']:.{digits}f}" if "slope" in m else "failed" for m, digits in ((plain, 0), (applied, 1))
            ]
            table.append(f"| {name} | {cells[0]} | {cells[1]} | — | — | {'; '.join(errors)} |")
            continue
        ratio = f"{applied['slope'] / llama:.2f}" if llama else "—"
        table.append(
            f"| {name} | {plain['slope']:.0f} | {applied['slope']:.1f} | **{plain['slope'] / applied['slope']:.1f}x** "
            f"| {ratio} | {left_own(applied['report'])} |"
        )
    command = "`.venv/bin/python bench/families.py" + "".join(f" {arg}" for arg in sys.argv[1:]) + "`"
    text = (
        f"## Model families\n\n{command} ({machine()}; {minutes:.0f} minutes). One small model per "
        "transformers family (hidden 256, 4 layers, 4 attention heads, 2 key/value heads, MLP 512, vocabulary "
        "32K, float32, random weights; mixture-of-experts blocks with 4 experts, top-2, experts of 256; DeepSeek-V3 "
        "with small MLA ranks, its first layer dense and 4 key/value heads, as its attention expands its latent "
        "to every head; a default pad_token_id past the 32K vocabulary, as Phi-3's, SmolLM3's and GLM-4's, set "
        "to None), attention `sdpa` where the family takes it (Gemma 2 and GPT-OSS refuse it: eager). One "
        "training step (forward with labels, backward) of one row of T random tokens per fresh process, after a "
        "128-token warm-up step; KiB per token is the least-squares slope of the resident set's growth during "
        f"the step over {lengths} tokens (`MALLOC_MMAP_THRESHOLD_` 1 MiB). Plain is the model as built; apply() "
        "is `torch_offload.apply(model)` with every default (the disk tier in the temp directory, its default "
        "buffers). The last column is from `handle.report()`: the MLPs and attentions apply() left as the model "
        "had them, and why, the loss when it is not the fused `linear_cross_entropy`, and the masks.\n\n"
        + "\n".join(table)
        + "\n"
    )
    print(text)
    if args.write:
        write_section("Model families", text)


if __name__ == "__main__":
    main()
