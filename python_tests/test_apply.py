"""torch_offload.apply() on tiny random-init Hugging Face causal LMs (nothing downloaded)."""

import copy
import functools
import io
import subprocess
import sys
import warnings

import accelerate.hooks
import peft
import pytest
import torch
import transformers
from op_recording import CountCalls
from torch import nn

import torch_offload

pytestmark = pytest.mark.torch_range

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(num_key_value_heads=2)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=8)),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(num_key_value_heads=1, head_dim=8)),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(num_key_value_heads=2, head_dim=8, final_logit_softcapping=3.0),
    ),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(num_key_value_heads=4)),
    "gpt2": (
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        dict(n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
}
# How each family's MLP is tiled: by the tiled_mlp op, or by the generic tiled_apply.
EXPECTED_PATH = {"gpt2": "tiled_applies"}


def tier_options(offload, directory, **options):
    """apply()'s options for the tier `offload`: it refuses those the tier would ignore."""
    if offload is None:
        return {}
    return dict(options, spill_directory=str(directory)) if offload == "disk" else options


def make_model(name, **overrides):
    config_cls, model_cls, extra = MODELS[name]
    kwargs = {**COMMON, **extra, **overrides}
    if name == "gpt2":
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k
            not in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "max_position_embeddings",
            )
        }
        kwargs["n_positions"] = overrides.get("max_position_embeddings", kwargs["n_positions"])
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs)).float().train()


def batch():
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (2, 24), generator=generator)
    return ids


def loss_and_grads(model, ids, run=None):
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def applied_work(handle):
    """What grows with each applied training step with labels: the chunk-recurrent step's calls where it is on
    (test_chunk_recurrent_route.py), else the bytes the disk tier wrote."""
    return handle.chunk_recurrent_calls if handle.chunk_recurrent == "on" else handle.stats()["disk_bytes"]


def assert_close_runs(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_apply_matches_unpatched_and_remove_restores(name, tmp_path):
    model, ids = make_model(name), batch()
    keys = list(model.state_dict())
    mlp_types = [type(m) for m in model.modules()]
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, num_shards=3)
    assert getattr(handle, EXPECTED_PATH.get(name, "tiled_mlps")) == 3
    # With the disk tier, backward recomputes attention alone, in the last layer too (keep_last's default is 0 there).
    assert list(handle.checkpointing.values()) == ["attention", "attention", "attention"]
    assert list(model.state_dict()) == keys  # same parameters under the same names
    assert handle.loss == "linear_cross_entropy"
    got = loss_and_grads(model, ids)
    assert_close_runs(want, got)
    assert applied_work(handle) > 0 and handle.stats()["live_entries"] == 0
    handle.remove()
    assert [type(m) for m in model.modules()] == mlp_types
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in model.modules())
    assert_close_runs(want, loss_and_grads(model, ids))


@pytest.mark.parametrize(
    "options",
    [
        dict(offload=None),
        dict(offload=None, checkpoint=False),
        dict(tiled_mlp=False, offload="disk", min_bytes=0, keep_last=0),
        dict(offload="disk", min_bytes=0, keep_last=1),
        dict(offload="disk", min_bytes=0, keep_last=3),
        dict(offload="disk", min_bytes=0, checkpoint="layer"),
    ],
    ids=["checkpoint_only", "tiled_only", "offload_only", "keep_one", "keep_all", "disk_layer_checkpoint"],
)
def test_apply_options_keep_results(options, tmp_path):
    if options.get("offload") == "disk":
        options = dict(options, spill_directory=str(tmp_path))
    model, ids = make_model("llama"), batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, **options)
    assert_close_runs(want, loss_and_grads(model, ids))
    handle.remove()


def test_disk_tier_reads_ahead_16_mib_for_a_model_in_host_memory_unless_told(monkeypatch, tmp_path):
    """On the CPU the restores share the cores with the compute: apply() gives the disk tier a 16 MiB read-ahead
    there (BENCHMARKS.md, "Long context"), not the store's 64 MiB, and a tensor over it is read on demand, not
    ahead; prefetch_bytes and prefetch_over_budget given to apply() are kept."""
    budgets = []
    init = torch_offload.offload_activations.__init__

    @functools.wraps(init)
    def recording_init(self, **options):
        budgets.append((options.get("prefetch_bytes"), options.get("prefetch_over_budget")))
        init(self, **options)

    monkeypatch.setattr(torch_offload.offload_activations, "__init__", recording_init)
    for options in (dict(), dict(prefetch_bytes=1 << 30, prefetch_over_budget=True)):
        handle = torch_offload.apply(make_model("llama"), offload="disk", spill_directory=str(tmp_path), **options)
        handle.remove()
    assert budgets == [(16 << 20, False), (1 << 30, True)]


def test_peft_lora_llama_trains_with_apply(tmp_path):
    model = make_model("llama")
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = peft.get_peft_model(model, lora)
    ids = batch()
    want = loss_and_grads(model, ids)
    assert len(want[1]) > 0 and all("lora_" in name for name in want[1])
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, num_shards=2)
    assert handle.tiled_applies == 3  # LoRA-wrapped Linears: the generic path
    assert_close_runs(want, loss_and_grads(model, ids))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for _ in range(3):
        loss, _ = loss_and_grads(model, ids)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    handle.remove()


@pytest.mark.parametrize("offload,use_cache", [(None, False), ("disk", False), ("disk", True)])
def test_compiled_patched_model_matches_eager(offload, use_cache, tmp_path):
    model, ids = make_model("llama"), batch()
    handle = torch_offload.apply(model, offload=offload, num_shards=2, **tier_options(offload, tmp_path, min_bytes=0))
    want = loss_and_grads(model, ids)
    torch._dynamo.reset()
    # Inductor for the model without a tier; with the disk tier AOTAutograd's graph (where the offload hooks go) is
    # the subject, and test_compile.py runs inductor over it: aot_eager, a cold inductor cache's 20 s less in CI.
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if offload is None else "aot_eager")
    got = loss_and_grads(model, ids, run=lambda **kw: compiled(**{**kw, "use_cache": use_cache}))
    assert_close_runs(want, got)
    handle.remove()


def test_bad_inputs_are_explained(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="found no decoder layers in Sequential: looked for an nn.ModuleList"):
        torch_offload.apply(nn.Sequential(nn.Linear(4, 4)))
    model = make_model("llama")
    with pytest.raises(ValueError, match="offload must be one of"):
        torch_offload.apply(model, offload="gpu")
    with pytest.raises(ValueError, match="keep_last must be an int >= 0"):
        torch_offload.apply(model, keep_last=-1)
    with pytest.raises(
        ValueError, match=r"checkpoint must be True, False or one of \('layer', 'attention'\), got 'mlp'"
    ):
        torch_offload.apply(model, checkpoint="mlp")
    with pytest.raises(ValueError, match="checkpoint='attention' needs offload='cpu' or 'disk'"):
        torch_offload.apply(model, checkpoint="attention", offload=None)
    with pytest.raises(RuntimeError, match="disk_spill: directory .* cannot be used"):
        torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path / "missing"))
    # A typo or an option the configuration would ignore never changes what runs without a word.
    with pytest.raises(TypeError, match=r"unknown option 'bogus_option'; apply's own options"):
        torch_offload.apply(model, offload="disk", bogus_option=1)
    with pytest.raises(TypeError, match=r"unknown options 'max_host_byte' \(did you mean 'max_host_bytes'\?\), 'x'"):
        torch_offload.apply(model, offload="disk", max_host_byte=1, x=2)
    with pytest.raises(TypeError, match="unknown option 'max_host_byte'"):  # checked before the tier's options
        torch_offload.apply(model, max_host_byte=1)
    with (
        monkeypatch.context() as env,
        pytest.raises(
            ValueError, match=r"'min_bytes' would be ignored with offload='auto', which is None for a model in host"
        ),
    ):
        env.setenv("TORCH_OFFLOAD_SPILL_DIR", "/dev/shm")  # a RAM file system: no disk tier
        torch_offload.apply(model, min_bytes=0)
    with pytest.raises(ValueError, match=r"'prefetch_bytes' would be ignored with offload=None"):
        torch_offload.apply(model, offload=None, prefetch_bytes=0)
    with (
        pytest.raises(ValueError, match=r"'spill_directory' would be ignored with offload='cpu'"),
        pytest.warns(UserWarning, match="offload='cpu' moves nothing"),
    ):
        torch_offload.apply(model, offload="cpu", spill_directory=str(tmp_path))
    with pytest.raises(ValueError, match="spill_directory and allow_tmpfs would be ignored with tier='cpu'"):
        torch_offload.offload_activations(tier="cpu", spill_directory=str(tmp_path))
    # Nothing was left patched by the failed calls.
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in model.modules())
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.model.layers)


TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(TINY, intermediate_size=48, num_experts_per_tok=2, output_router_logits=True)
# Models whose decoder layers are not all plain MLPs, and what apply() does with each layer's MLP.
FAMILIES = {
    # Gemma3n's first layers sparsify the gate activations (_gaussian_topk): not the op's function, but token-wise.
    "gemma3n": (
        lambda: transformers.Gemma3nForCausalLM(
            transformers.Gemma3nTextConfig(
                **TINY,
                vocab_size_per_layer_input=128,
                hidden_size_per_layer_input=8,
                intermediate_size=64,
                head_dim=8,
                activation_sparsity_pattern=[0.95, 0.95, 0.0],
                num_kv_shared_layers=0,
                laurel_rank=4,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            )
        ),
        "model.layers",
        ["tiled_apply", "tiled_apply", "tiled_mlp"],
    ),
    # Mixture-of-experts blocks (router logits recorded for the aux loss) stay whole: streamed from the tier where
    # offloaded and not recomputed, else their experts in shards (the last layer, kept and checkpointed whole).
    "qwen2_moe": (
        lambda: transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(
                **MOE,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=4,
                decoder_sparse_step=2,
            )
        ),
        "model.layers",
        ["tiled_mlp", "streamed", "tiled_mlp"],
    ),
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(**MOE, moe_intermediate_size=16, num_experts=4, head_dim=8, mlp_only_layers=[0])
        ),
        "model.layers",
        ["tiled_mlp", "streamed", "tiled_experts"],
    ),
    "mixtral": (
        lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**MOE, num_local_experts=4)),
        "model.layers",
        ["streamed", "streamed", "tiled_experts"],
    ),
    # Mixtures whose router returns dense scores (GPT-OSS, its experts with biases) or whose experts sit beside a
    # shared expert, after a dense first layer (DeepSeek-V3, with multi-head latent attention).
    "gpt_oss": (
        lambda: transformers.GptOssForCausalLM(
            transformers.GptOssConfig(
                **MOE,
                num_local_experts=4,
                head_dim=8,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            )
        ),
        "model.layers",
        ["streamed", "streamed", "tiled_experts"],
    ),
    "deepseek_v3": (
        lambda: transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(
                **dict(MOE, num_key_value_heads=4),  # multi-head latent attention: a key and value per query head
                moe_intermediate_size=16,
                n_routed_experts=4,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                q_lora_rank=16,
                kv_lora_rank=8,
                qk_rope_head_dim=4,
                qk_nope_head_dim=8,
                v_head_dim=6,  # not the query's 12: segment_attention pads it for its kernels
            )
        ),
        "model.layers",
        ["tiled_mlp", "streamed", "tiled_experts"],
    ),
    # Llama 4's layers call their MLP feed_forward; its mixtures' experts take expert-major rows, so the whole block
    # runs in shards of tokens. A layer without rotary embedding, whose queries' temperature grows every 4 places.
    "llama4": (
        lambda: transformers.Llama4ForCausalLM(
            transformers.Llama4TextConfig(
                **dict(TINY, intermediate_size=32, head_dim=8),
                intermediate_size_mlp=64,
                num_local_experts=4,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,
                no_rope_layers=[1, 0, 1],
                floor_scale=4,
                attn_implementation="sdpa",
            )
        ),
        "model.layers",
        ["tiled_mlp", "tiled_block", "tiled_mlp"],
    ),
    # Dense families whose layers differ from Llama's elsewhere: q/k norms on whole projections (OLMo 2), scaled
    # embeddings, residuals, attention and logits (Granite), layers without rotary (SmolLM3), a parallel block with
    # LayerNorm and scaled logits (Cohere), partial rotary and a fused gate_up_proj (GLM-4), q/k norms and sliding
    # windows beside full layers (Gemma 3).
    "olmo2": (
        lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**TINY, intermediate_size=64)),
        "model.layers",
        ["tiled_mlp"] * 3,
    ),
    "granite": (
        lambda: transformers.GraniteForCausalLM(
            transformers.GraniteConfig(
                **TINY,
                intermediate_size=64,
                embedding_multiplier=2.0,
                residual_multiplier=0.5,
                attention_multiplier=0.3,
                logits_scaling=4.0,
            )
        ),
        "model.layers",
        ["tiled_mlp"] * 3,
    ),
    "smollm3": (
        lambda: transformers.SmolLM3ForCausalLM(
            transformers.SmolLM3Config(**TINY, intermediate_size=64, no_rope_layers=[1, 0, 1])
        ),
        "model.layers",
        ["tiled_mlp"] * 3,
    ),
    "cohere": (
        lambda: transformers.CohereForCausalLM(
            transformers.CohereConfig(**TINY, intermediate_size=64, logit_scale=0.5)
        ),
        "model.layers",
        ["tiled_mlp"] * 3,
    ),
    "glm4": (
        lambda: transformers.Glm4ForCausalLM(transformers.Glm4Config(**TINY, intermediate_size=64, head_dim=8)),
        "model.layers",
        ["tiled_mlp"] * 3,
    ),
    "gemma3_text": (
        lambda: transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(
                **TINY,
                intermediate_size=64,
                head_dim=8,
                sliding_window=32,  # longer than the batches: their masks are segment ids (Mistral tests windows)
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            )
        ),
        "model.layers",
        ["tiled_mlp"] * 3,
    ),
    # A VLM: the language model's layers, not the vision tower's blocks (which also have an `mlp`).
    "qwen2_vl": (
        lambda: transformers.Qwen2VLForConditionalGeneration(
            transformers.Qwen2VLConfig(
                text_config=dict(
                    TINY, intermediate_size=64, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}
                ),
                vision_config=dict(
                    depth=2,
                    embed_dim=16,
                    hidden_size=32,
                    num_heads=2,
                    mlp_ratio=2,
                    patch_size=2,
                    spatial_merge_size=1,
                    temporal_patch_size=1,
                ),
            )
        ),
        "model.language_model.layers",
        ["tiled_mlp", "tiled_mlp", "tiled_mlp"],
    ),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_apply_on_moe_vlm_and_custom_mlps_matches_unpatched(name, tmp_path):
    build, layer_path, tiling = FAMILIES[name]
    torch.manual_seed(0)
    model, ids = build().float().train(), batch()
    want = loss_and_grads(model, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # keep_last=1: the last layer checkpointed whole, where a mixture of experts goes in shards.
        handle = torch_offload.apply(
            model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, num_shards=3, keep_last=1
        )
    assert_close_runs(want, loss_and_grads(model, ids))
    assert handle.stats()["disk_bytes"] > 0
    assert handle.layer_path == layer_path and handle.layers is model.get_submodule(layer_path)
    mlp = "feed_forward" if name == "llama4" else "mlp"
    assert list(handle.mlp_tiling) == [f"{layer_path}.{i}.{mlp}" for i in range(3)]
    assert [how.split(":")[0] for how in handle.mlp_tiling.values()] == tiling
    assert any("stay untiled" in str(w.message) for w in caught) == ("untiled" in tiling)
    handle.remove()
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in model.modules())
    assert_close_runs(want, loss_and_grads(model, ids))


def llama4_with_a_mixture_in_every_layer(**options):
    """Llama 4 as Scout: a mixture of experts in every layer, whose experts take every expert's rows one after the
    other ([experts x tokens, h]), so they take no shards of tokens."""
    config = transformers.Llama4TextConfig(
        **dict(TINY, intermediate_size=32, head_dim=8),
        intermediate_size_mlp=64,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attn_implementation="sdpa",
        **options,
    )
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).train()


@pytest.mark.parametrize("offload", ["disk", None])
def test_mixtures_whose_experts_take_no_shards_run_whole_blocks_in_shards_with_their_router_logits_whole(
    offload, tmp_path
):
    model, ids = llama4_with_a_mixture_in_every_layer(output_router_logits=True), batch()
    want = loss_and_grads(model, ids)
    want_logits = model(input_ids=ids, use_cache=False, output_router_logits=True).router_logits
    handle = torch_offload.apply(model, **tier_options(offload, tmp_path, min_bytes=0), offload=offload, num_shards=3)
    assert set(handle.mlp_tiling.values()) == {"tiled_block"}
    assert_close_runs(want, loss_and_grads(model, ids))
    got_logits = model(input_ids=ids, use_cache=False, output_router_logits=True).router_logits
    assert len(got_logits) == len(want_logits) == 3
    for got, expected in zip(got_logits, want_logits):  # whole, [tokens, experts], with their gradient
        assert got.requires_grad and got.shape == expected.shape == (ids.numel(), 4)
        torch.testing.assert_close(got, expected)
    # The router logits' gradient reaches the router: a loss of them alone, as an auxiliary loss is.
    model.zero_grad(set_to_none=True)
    sum(logits.square().mean() for logits in got_logits).backward()
    got_router = model.model.layers[0].feed_forward.router.weight.grad.clone()
    handle.remove()
    model.zero_grad(set_to_none=True)
    sum(logits.square().mean() for logits in want_logits).backward()
    torch.testing.assert_close(got_router, model.model.layers[0].feed_forward.router.weight.grad)
    assert_close_runs(want, loss_and_grads(model, ids))


class CumulativeMLP(nn.Module):
    """An MLP whose output for a token depends on the tokens before it: in no shards."""

    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        return self.inner(x) + 0.1 * x.cumsum(dim=1)


@pytest.mark.parametrize("offload", ["disk", None])
def test_a_kept_layer_whose_mlp_stays_untiled_is_offloaded_too(offload, tmp_path):
    # The last layer, kept and recomputed whole, would rebuild all of an untiled MLP's activations at once in
    # backward: with a tier, it is streamed as the others.
    model, ids = make_model("llama"), batch()
    for layer in model.model.layers:
        layer.mlp = CumulativeMLP(layer.mlp)
    want = loss_and_grads(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untiled MLPs' warning, tested elsewhere
        handle = torch_offload.apply(model, **tier_options(offload, tmp_path, min_bytes=0), offload=offload)
    assert_close_runs(want, loss_and_grads(model, ids))
    assert all(how.startswith("untiled") for how in handle.mlp_tiling.values())
    rows = [(row["layers"], row["recompute"], row["saved"]) for row in handle.report()["layers"]]
    if offload is None:  # no tier: every layer checkpointed whole, its saved tensors in place
        assert [saved for _, _, saved in rows] == ["in place"]
    else:
        assert rows == [([0, 1, 2], "attention", "disk")]
    handle.remove()
    assert_close_runs(want, loss_and_grads(model, ids))


def test_probe_is_not_fooled_by_zero_weights():
    # With a zero down_proj the sparse Gemma3n MLP and the op both give zeros; the probe uses random weights.
    model = FAMILIES["gemma3n"][0]()
    for layer in model.model.layers:
        nn.init.zeros_(layer.mlp.down_proj.weight)
    handle = torch_offload.apply(model, offload=None, checkpoint=False)
    assert list(handle.mlp_tiling.values()) == ["tiled_apply", "tiled_apply", "tiled_mlp"]
    handle.remove()


def test_remove_restores_accelerate_forwards_exactly(tmp_path):
    model, ids = make_model("llama"), batch()
    hooked = [m for layer in model.model.layers for m in (layer, layer.mlp)]
    for module in hooked:
        accelerate.hooks.add_hook_to_module(module, accelerate.hooks.ModelHook())
    forwards = [vars(m)["forward"] for m in hooked]
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, num_shards=2)
    assert handle.tiled_applies == 3  # the op would bypass accelerate's forward: its own forward in shards
    assert_close_runs(want, loss_and_grads(model, ids))
    # A wrapper added after apply() must go first: remove() refuses and changes nothing.
    layer = model.model.layers[1]
    patched = layer.forward
    layer.forward = lambda *args, **kwargs: patched(*args, **kwargs)
    with pytest.raises(RuntimeError, match=r"model.layers.1.forward changed after apply\(\)"):
        handle.remove()
    assert_close_runs(want, loss_and_grads(model, ids))
    layer.forward = patched
    handle.remove()
    assert all(vars(m)["forward"] is f for m, f in zip(hooked, forwards))
    assert_close_runs(want, loss_and_grads(model, ids))


def module_layout(model):
    return [(name, type(m), sorted(vars(m))) for name, m in model.named_modules()]


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # MLPs replaced by TiledMLP, and their forwards patched
def test_copies_and_pickles_of_an_applied_model_are_the_model_before_apply(name, tmp_path):
    # A DPO reference model or an EMA copy made with copy.deepcopy, a torch.save of the whole model:
    # patched forwards are closures over the original's modules, so the copy must not carry them.
    model, ids = make_model(name), batch()
    before = module_layout(model)
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, num_shards=2)
    applied = module_layout(model)
    copied, shallow = copy.deepcopy(model), copy.copy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert module_layout(model) == applied  # the model itself stays applied
    assert "forward" not in vars(shallow) and shallow.base_model is model.base_model  # shares the applied layers
    for other in (copied, loaded):
        assert module_layout(other) == before
        model.zero_grad(set_to_none=True)
        assert_close_runs(want, loss_and_grads(other, ids))
        assert all(p.grad is None for p in model.parameters())  # the copy trains its own parameters
    work = applied_work(handle)
    assert_close_runs(want, loss_and_grads(model, ids))
    assert applied_work(handle) > work
    copy_handle = torch_offload.apply(copied, offload=None)  # a copy is applied on its own
    assert_close_runs(want, loss_and_grads(copied, ids))
    copy_handle.remove()
    handle.remove()
    assert module_layout(model) == before == module_layout(copied)


def test_a_saved_applied_model_loads_where_torch_offload_is_not_imported(tmp_path):
    # apply gives the config its own attention implementation: a pickle must carry the model's own name.
    model, ids = make_model("llama"), batch()
    want = loss_and_grads(model, ids)[0]
    torch_offload.apply(model, num_shards=2)
    assert model.config._attn_implementation == torch_offload.masking.IMPLEMENTATION
    torch.save(model, tmp_path / "model.pt")
    assert copy.deepcopy(model).config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == torch_offload.masking.IMPLEMENTATION  # the model stays applied
    script = (
        "import sys, torch\n"
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "assert 'torch_offload' not in sys.modules, 'loading imported torch_offload'\n"
        f"ids = torch.tensor({ids.tolist()})\n"
        "print(model.config._attn_implementation, repr(model(input_ids=ids, labels=ids, use_cache=False).loss.item()))"
    )
    # Run from tmp_path, where the checkout's torch_offload is not on the path.
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    implementation, loss = out.stdout.split()
    assert implementation == "sdpa" and float(loss) == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(tiled_mlp="no"), TypeError, "tiled_mlp must be True or False, got 'no'"),
        (dict(loss="False"), TypeError, "loss must be True or False, got 'False'"),
        (dict(attention_block="false"), TypeError, "attention_block must be True or False, got 'false'"),
        (dict(num_shards=True), TypeError, r"num_shards must be an int, got True \(bool\)"),
        (dict(keep_last=1.0), TypeError, r"keep_last must be an int, got 1.0 \(float\)"),
        (dict(checkpoint=None), TypeError, "checkpoint must be True, False or one of"),
        (dict(offload="disk", min_bytes="1M"), TypeError, r"min_bytes must be an int, got '1M' \(str\)"),
        (dict(offload="disk", max_host_bytes="1G"), TypeError, r"max_host_bytes must be an int or None, got '1G'"),
        (dict(offload="disk", prefetch_bytes=-1), ValueError, "prefetch_bytes must be an int >= 0, got -1"),
        (dict(offload="disk", allow_tmpfs="yes"), TypeError, "allow_tmpfs must be True or False, got 'yes'"),
        (dict(offload="disk", spill_directory=3), TypeError, "spill_directory must be a str or os.PathLike path"),
        (
            dict(offload="disk", offload_cpu_tensors=False),
            ValueError,
            "offload='disk' with offload_cpu_tensors=False would move nothing",
        ),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else "",
)
def test_each_option_checks_its_type_and_names_itself(options, error, message):
    model = make_model("llama")
    before = module_layout(model)
    with pytest.raises(error, match=message):
        torch_offload.apply(model, **options)
    assert module_layout(model) == before


def test_paths_may_be_path_objects(tmp_path):
    model, ids = make_model("llama"), batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=tmp_path)
    assert_close_runs(want, loss_and_grads(model, ids))
    assert handle.chunk_recurrent == "on" and handle.chunk_recurrent_calls == 1  # its file in tmp_path
    handle.remove()
    handle = torch_offload.apply(model, spill_directory=tmp_path, min_bytes=0, num_shards=2, chunk_recurrent=False)
    assert_close_runs(want, loss_and_grads(model, ids))
    assert handle.stats()["disk_bytes"] > 0
    handle.remove()
    ticket = torch_offload.disk_spill(torch.arange(4.0), directory=tmp_path)
    torch.testing.assert_close(torch_offload.disk_restore(ticket, [4], torch.float32, "cpu"), torch.arange(4.0))


def test_a_modules_own_getstate_still_makes_its_copies_and_remove_puts_it_back(tmp_path):
    # A layer that leaves a cache out of its copies through a __getstate__ of its own.
    model, ids = make_model("llama"), batch()
    layer = model.model.layers[0]
    layer.cache = torch.zeros(4)

    def own_getstate():
        return {key: value for key, value in nn.Module.__getstate__(layer).items() if key != "cache"}

    layer.__getstate__ = own_getstate
    before = module_layout(model)
    copied_before = module_layout(copy.deepcopy(model))
    assert copied_before != before  # the copy has no cache
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert vars(layer)["__getstate__"] is not own_getstate  # apply's, while applied
    copied = copy.deepcopy(model)
    assert module_layout(copied) == copied_before
    assert vars(copied.model.layers[0])["__getstate__"] is own_getstate
    assert_close_runs(want, loss_and_grads(copied, ids))
    handle.remove()
    assert vars(layer)["__getstate__"] is own_getstate
    assert module_layout(model) == before


@pytest.mark.parametrize("checkpoint", ["layer", "attention"])
def test_remove_between_a_forward_and_its_backward_keeps_that_backward_right(checkpoint, tmp_path):
    # The backward recomputes checkpointed layers, which must compute what the forward did
    # (TiledMLP and the attention op save other tensors than the modules they stand for).
    model, ids = make_model("llama"), batch()
    before = module_layout(model)
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(
        model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, checkpoint=checkpoint
    )
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    handle.remove()
    assert module_layout(model) == before
    loss.backward()
    assert_close_runs(want, (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert module_layout(model) == before  # apply's forwards were back for the recomputation only


def test_a_module_replaced_after_apply_is_the_one_computed_and_recomputed(tmp_path):
    # Recomputation puts back what its forward found, never apply's own patches over a later change.
    ids = batch()
    torch.manual_seed(1)
    replacement = make_model("llama").model.layers[0].mlp
    for parameter in replacement.parameters():
        nn.init.normal_(parameter, std=0.05)
    reference = make_model("llama")
    reference.model.layers[0].mlp = copy.deepcopy(replacement)
    want = loss_and_grads(reference, ids)
    model = make_model("llama")
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, checkpoint="layer")
    model.model.layers[0].mlp = copy.deepcopy(replacement)
    assert_close_runs(want, loss_and_grads(model, ids))
    with pytest.raises(RuntimeError, match=r"model.layers.0.mlp changed after apply\(\)"):
        handle.remove()


def test_apply_twice_is_refused_and_remove_is_idempotent():
    model = make_model("llama")
    handle = torch_offload.apply(model, offload=None)
    with pytest.raises(ValueError, match=r"model.layers.0 is already changed by an earlier apply\(\)"):
        torch_offload.apply(model, offload=None, tiled_mlp=False)
    handle.remove()
    handle.remove()
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in model.modules())
    torch_offload.apply(model, offload=None).remove()  # after remove() it applies again


def test_offload_default_on_a_cpu_model_says_what_it_does(tmp_path, monkeypatch):
    model, ids = make_model("llama"), batch()
    want = loss_and_grads(model, ids)
    monkeypatch.setenv("TORCH_OFFLOAD_SPILL_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # "auto": the disk tier, where the chunk-recurrent step keeps its chunks
        handle = torch_offload.apply(model)
    assert handle.offload == "disk" and handle.route == "chunk-recurrent step"
    assert_close_runs(want, loss_and_grads(model, ids))
    assert handle.chunk_recurrent_calls == 1  # training with labels: the chunk-recurrent step, its file on the disk
    assert_close_runs(want, loss_and_grads(model, ids, run=lambda **call: model(**call, logits_to_keep=0)))
    with torch.no_grad():
        model(input_ids=ids)
    assert handle.chunk_recurrent_calls == 2
    handle.remove()
    # A spill directory in RAM would hold what the tier is meant to free: plain checkpointing instead.
    monkeypatch.setenv("TORCH_OFFLOAD_SPILL_DIR", "/dev/shm")
    handle = torch_offload.apply(model)
    assert handle.offload is None and set(handle.checkpointing.values()) == {"layer"} and handle.stats() == {}
    handle.remove()
    handle = torch_offload.apply(model, allow_tmpfs=True)  # unless asked for
    assert handle.offload == "disk"
    handle.remove()
    # The spill directory as the library finds it: no usable default, no disk tier, with a warning.
    monkeypatch.delenv("TORCH_OFFLOAD_SPILL_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    assert torch_offload.disk.default_spill_directory() == str(tmp_path / "missing")
    with pytest.warns(
        UserWarning,
        match=r"offload='auto' keeps this CPU model's activations in memory: the "
        r"default spill directory '.*missing' is not a writable directory",
    ):
        handle = torch_offload.apply(model)
    assert handle.offload is None
    handle.remove()
    handle = torch_offload.apply(model, spill_directory=str(tmp_path))  # named: the disk tier there
    assert handle.offload == "disk"
    handle.remove()
    with pytest.warns(UserWarning, match="offload='cpu' moves nothing while the model is in host memory"):
        handle = torch_offload.apply(model, offload="cpu")
    assert handle.offload == "cpu"
    handle.remove()


def test_ram_file_systems_are_known_from_the_mount_table(tmp_path):
    assert torch_offload.disk.spill_directory_in_ram("/dev/shm")
    assert torch_offload.disk.spill_directory_in_ram("/dev/shm/not/made/yet")  # by the mount above it
    assert not torch_offload.disk.spill_directory_in_ram(str(tmp_path))


class GatedMLP(nn.Module):
    def __init__(self, dropout=None, mix_tokens=False):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()
        if dropout is not None:
            self.dropout = nn.Dropout(dropout)
        self.mix_tokens = mix_tokens

    def forward(self, x):
        y = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        if hasattr(self, "dropout"):
            y = self.dropout(y)
        return y - y.mean(dim=-2, keepdim=True) if self.mix_tokens else y


class Block(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(x)


def test_layers_are_found_or_named():
    model = nn.Module()
    model.vision, model.text = nn.ModuleList([Block(GatedMLP())]), nn.ModuleList([Block(GatedMLP()), Block(GatedMLP())])
    with pytest.raises(ValueError, match=r"cannot tell which of \['vision', 'text'\] are the decoder layers"):
        torch_offload.apply(model, offload=None)
    handle = torch_offload.apply(model, offload=None, layers="text")
    assert handle.layer_path == "text" and handle.mlp_tiling == {"text.0.mlp": "tiled_mlp", "text.1.mlp": "tiled_mlp"}
    handle.remove()
    with pytest.raises(ValueError, match=r"layers='vision.0' is a Block, not a non-empty nn.ModuleList"):
        torch_offload.apply(model, layers="vision.0")
    with pytest.raises(ValueError, match="nothing to change in text with tiled_mlp=False, checkpoint=False"):
        torch_offload.apply(model, layers="text", tiled_mlp=False, checkpoint=False, offload=None)
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in model.modules())


def test_each_mlp_is_tiled_only_as_its_forward_allows():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ModuleList([Block(GatedMLP()), Block(GatedMLP(dropout=0.0)), Block(GatedMLP(mix_tokens=True))])
    )
    x = torch.randn(2, 6, 8, requires_grad=True)

    def run():
        model.zero_grad(set_to_none=True)
        x.grad = None
        y = x
        for block in model[0]:
            y = block(y)
        y.square().sum().backward()
        return y.detach(), {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}

    want = run()
    with pytest.warns(UserWarning, match=r"1 of 3 MLPs stay untiled \(0.2.mlp: its output for a token depends"):
        handle = torch_offload.apply(model, offload=None, num_shards=2)
    # A dropout the op would drop (p=0 here, but p is the module's to change): its own forward, in shards.
    assert handle.mlp_tiling == {
        "0.0.mlp": "tiled_mlp",
        "0.1.mlp": "tiled_apply",
        "0.2.mlp": "untiled: its output for a token depends on the other tokens",
    }
    assert_close_runs(want, run())
    handle.remove()


def _labelled_batch():
    ids = batch()
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that is not trained on
    return ids, labels


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_fused_loss_honours_transformers_loss_arguments(name):
    """num_items_in_batch (gradient accumulation), shift_labels, ignored labels and return_dict=False."""
    model, (ids, labels) = make_model(name), _labelled_batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].flip(1)  # any precomputed shift
    calls = {
        "plain": dict(labels=labels),
        "accumulated": dict(labels=labels, num_items_in_batch=torch.tensor(17)),
        "shift_labels": dict(labels=labels, shift_labels=shifted),
    }
    want = {key: loss_and_grads(model, ids, run=lambda **kw: model(**{**kw, **call})) for key, call in calls.items()}
    unpatched_tuple = model(input_ids=ids, labels=labels, use_cache=False, output_hidden_states=True, return_dict=False)
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=ids, labels=labels, use_cache=False)
    model.train()
    handle = torch_offload.apply(model, offload=None)
    assert handle.loss == "linear_cross_entropy"
    model.eval()
    with torch.no_grad():  # evaluation (Trainer's compute_metrics): the model's own loss and logits
        got = model(input_ids=ids, labels=labels, use_cache=False)
    model.train()
    torch.testing.assert_close(got.loss, evaluated.loss)
    torch.testing.assert_close(got.logits, evaluated.logits)
    for key, call in calls.items():
        got = loss_and_grads(model, ids, run=lambda **kw: model(**{**kw, **call}))
        assert_close_runs(want[key], got)
    output = model(input_ids=ids, labels=labels, use_cache=False)
    assert output.logits is None  # never materialized
    as_tuple = model(input_ids=ids, labels=labels, use_cache=False, output_hidden_states=True, return_dict=False)
    torch.testing.assert_close(as_tuple[0], output.loss)
    assert len(as_tuple) == len(unpatched_tuple) and as_tuple[1] is None  # the logits' place is kept
    for got, want_hidden in zip(as_tuple[2], unpatched_tuple[2]):
        torch.testing.assert_close(got, want_hidden)
    without_labels = model(input_ids=ids, use_cache=False)  # generation, evaluation: the model's own logits
    assert without_labels.loss is None and without_labels.logits.shape == (*ids.shape, 128)
    handle.remove()
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in model.modules())


def test_fused_loss_adds_router_losses_as_the_model_does_and_leaves_a_replaced_head_to_it():
    model, (ids, _) = FAMILIES["mixtral"][0](), _labelled_batch()
    model.train()
    model.router_aux_loss_coef = 0.5
    model.config.output_router_logits = False  # Mixtral's released configs: asked for per call
    routed = lambda **kw: model(**kw, output_router_logits=True)  # noqa: E731  the model adds coef * aux_loss
    want = loss_and_grads(model, ids, run=routed)
    handle = torch_offload.apply(model, offload=None, tiled_mlp=False)
    assert handle.loss == "linear_cross_entropy"
    fused = torch.ops.offload.linear_cross_entropy_with_gradients.default
    with CountCalls(fused) as calls:
        assert_close_runs(want, loss_and_grads(model, ids, run=routed))
    assert calls.counts[fused] == 1
    output = routed(input_ids=ids, labels=ids, use_cache=False)
    assert output.logits is None and output.aux_loss is not None
    model.config.output_router_logits = True  # asked for by the config after apply
    assert_close_runs(want, loss_and_grads(model, ids))
    handle.remove()
    # A model that takes the flag through **kwargs and ignores it: no router loss, the fused loss as always.
    model, ids = make_model("llama"), batch()
    flagged = lambda **kw: model(**kw, output_router_logits=True)  # noqa: E731
    want = loss_and_grads(model, ids, run=flagged)
    handle = torch_offload.apply(model, offload=None)
    with CountCalls(fused) as calls:
        assert_close_runs(want, loss_and_grads(model, ids, run=flagged))
    assert calls.counts[fused] == 1
    handle.remove()
    model, ids = make_model("llama"), batch()
    handle = torch_offload.apply(model, offload=None)
    model.resize_token_embeddings(136)  # a new output layer: the model's own head and loss
    got = loss_and_grads(model, ids)
    handle.remove()
    assert_close_runs(loss_and_grads(model, ids), got)


def test_fused_loss_with_frozen_head_under_lora_and_its_own_loss_when_unprovable():
    model = make_model("llama")
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids, labels = _labelled_batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload=None)
    assert handle.loss == "linear_cross_entropy" and not model.get_output_embeddings().weight.requires_grad
    assert_close_runs(want, loss_and_grads(model, ids))
    handle.remove()

    class ScaledLlama(transformers.LlamaForCausalLM):  # changes its logits in a way apply cannot know
        def forward(self, input_ids=None, labels=None, **kwargs):
            output = super().forward(input_ids, **kwargs)
            output.logits = output.logits * 2
            if labels is not None:
                output.loss = self.loss_function(output.logits, labels, self.config.vocab_size)
            return output

    torch.manual_seed(0)
    scaled = ScaledLlama(make_model("llama").config).train()
    want = loss_and_grads(scaled, ids)
    with pytest.warns(UserWarning, match="the loss stays the model's own .*differs"):
        handle = torch_offload.apply(scaled, offload=None)
    assert handle.loss.startswith("unfused: the fused loss")
    assert "forward" not in vars(scaled) and "forward" not in vars(scaled.lm_head)
    assert_close_runs(want, loss_and_grads(scaled, ids))
    handle.remove()
    model = make_model("llama")
    assert torch_offload.apply(model, offload=None, loss=False).loss == "off"


def test_fused_loss_of_a_bf16_model_is_float32_like_transformers():
    # transformers upcasts a bf16 model's logits and returns a float32 loss: the fused one
    # must not round it to bf16 (an error of up to 2e-3 relative). It keeps the logits' products
    # unrounded on the CPU, where transformers rounds each logit to bf16 first: within 2e-5.
    model = make_model("llama").to(torch.bfloat16)
    ids, labels = _labelled_batch()
    want = loss_and_grads(model, ids, run=lambda **kw: model(**{**kw, "labels": labels}))
    # Only the loss changes (the tiled MLP's bf16 roundings would move the hidden states).
    assert torch_offload.apply(model, offload=None, tiled_mlp=False, checkpoint=False).loss == "linear_cross_entropy"
    got = loss_and_grads(model, ids, run=lambda **kw: model(**{**kw, "labels": labels}))
    assert got[0].dtype == want[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=0)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=2e-2, atol=2e-3, msg=lambda m: f"{name}: {m}")


def test_a_model_whose_output_embeddings_getter_raises_keeps_its_own_loss():
    model = make_model("llama")
    ids, labels = _labelled_batch()
    want = loss_and_grads(model, ids, run=lambda **kw: model(**{**kw, "labels": labels}))

    def no_head():
        raise NotImplementedError("no output embeddings")

    model.get_output_embeddings = no_head
    handle = torch_offload.apply(model, offload=None)
    assert not handle.loss.startswith("linear_cross_entropy")
    assert_close_runs(want, loss_and_grads(model, ids, run=lambda **kw: model(**{**kw, "labels": labels})))
    handle.remove()


@pytest.mark.parametrize("checkpoint", ["layer", "attention"])
def test_backward_recomputes_what_checkpoint_names(checkpoint, tmp_path):
    model, ids = make_model("llama"), batch()
    calls = {"attention": 0, "norm": 0}
    for layer in model.model.layers:
        layer.self_attn.q_proj.register_forward_pre_hook(
            lambda *_: calls.__setitem__("attention", calls["attention"] + 1)
        )
        layer.post_attention_layernorm.register_forward_pre_hook(
            lambda *_: calls.__setitem__("norm", calls["norm"] + 1)
        )
    handle = torch_offload.apply(
        model,
        offload="disk",
        checkpoint=checkpoint,
        keep_last=0,
        min_bytes=0,
        spill_directory=str(tmp_path),
        chunk_recurrent=False,  # the layers' path: what backward recomputes there
    )
    assert set(handle.checkpointing.values()) == {checkpoint}
    calls.update(attention=0, norm=0)  # apply's probes ran the model
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert calls == {"attention": 3, "norm": 3}
    stats = handle.stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss.backward()
    # Attention runs again in backward either way; the rest of a layer only when it is checkpointed whole,
    # and otherwise its saved tensors (norms, residuals) went to disk in forward.
    assert calls == {"attention": 6, "norm": 6 if checkpoint == "layer" else 3}
    # Each recomputation is named in a profile, once per checkpointed call.
    assert sum(event.name == "torch_offload.recompute" for event in profile.events()) == 3
    assert stats["pack_calls"] >= (6 if checkpoint == "layer" else 20)
    handle.remove()


# Which attention modules apply() hands to the attention_block op, and why the others keep their own.
ATTENTION = {
    "llama": "attention_block",
    "mistral": "attention_block",
    "qwen2": "attention_block",
    "gemma": "attention_block",
    "qwen3": "attention_block",  # its per-head norms are the op's q_norm and k_norm
    "phi3": "attention_block",  # its fused qkv_proj split into the op's q, k, v
    "gpt2": "module: it has no q_proj, k_proj, v_proj, o_proj (c_attn, c_proj",  # Conv1D c_attn
    "gemma2": "module: config.attn_logit_softcapping is 50.0",  # soft-capped attention scores
}


@pytest.mark.parametrize("name", list(MODELS))
def test_attention_block_is_used_only_where_the_module_computes_it(name, tmp_path):
    model = make_model(name)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert len(handle.attention) == 3
    assert all(how.startswith(ATTENTION[name]) for how in handle.attention.values()), handle.attention
    assert handle.attention_blocks == (3 if ATTENTION[name] == "attention_block" else 0)
    handle.remove()


def test_a_partial_rotary_embedding_runs_the_module(tmp_path):
    # The probe's rotary tables span the head, so it passes; at call time the model's cover half of it.
    torch.manual_seed(0)
    config = transformers.Phi3Config(**COMMON, num_key_value_heads=4, partial_rotary_factor=0.5)
    model, ids = transformers.Phi3ForCausalLM(config).float().train(), batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    got = {}
    assert op_calls(lambda: got.__setitem__("partial", loss_and_grads(model, ids))) == (0, 0)
    assert_close_runs(want, got["partial"])
    handle.remove()


def op_calls(fn):
    ops = torch.ops.offload.attention_block.default, torch.ops.offload.attention_block_backward.default
    with CountCalls(*ops) as mode:
        fn()
    return tuple(mode.counts.values())


@pytest.mark.parametrize("checkpoint", ["attention", "layer"])
def test_attention_block_runs_for_plain_causal_calls_and_the_module_for_the_others(checkpoint, tmp_path):
    model, ids = make_model("llama"), batch()
    padded = torch.ones_like(ids)
    padded[0, :5] = 0  # left padding: the mask reaches the op as segment ids
    want = {
        mask: loss_and_grads(model, ids, run=lambda **kw: model(**kw, attention_mask=m))
        for mask, m in (("none", None), ("padded", padded))
    }
    handle = torch_offload.apply(
        model,
        offload="disk",
        checkpoint=checkpoint,
        spill_directory=str(tmp_path),
        min_bytes=0,
        chunk_recurrent=False,  # the layers' path, where the op runs
    )
    assert handle.attention_blocks == 3
    got = {}
    # One op per layer in forward, and once more where a whole layer is recomputed (every one under "layer"; none
    # under "attention", where keep_last's default is 0).
    calls = op_calls(lambda: got.__setitem__("none", loss_and_grads(model, ids)))
    assert calls == ((3, 3) if checkpoint == "attention" else (6, 3))
    calls = op_calls(
        lambda: got.__setitem__(
            "padded", loss_and_grads(model, ids, run=lambda **kw: model(**kw, attention_mask=padded))
        )
    )
    assert calls == ((3, 3) if checkpoint == "attention" else (6, 3))
    for mask in want:
        assert_close_runs(want[mask], got[mask])
    with torch.no_grad():  # inference: the module's own forward
        assert op_calls(lambda: model(input_ids=ids)) == (0, 0)
    handle.remove()


def test_attention_block_leaves_bidirectional_calls_to_the_module(tmp_path):
    model, ids = make_model("llama"), batch()
    bidirectional = lambda **kw: model(**kw, is_causal=False)  # noqa: E731
    want = loss_and_grads(model, ids, run=bidirectional)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    got = []
    assert op_calls(lambda: got.append(loss_and_grads(model, ids, run=bidirectional))) == (0, 0)
    assert_close_runs(want, got[0])
    model.model.layers[0].self_attn.is_causal = False  # a module made bidirectional after apply
    # Layers 1 and 2 still use it.
    assert op_calls(lambda: loss_and_grads(model, ids)) == (2, 2)
    handle.remove()


def cache_length(output):
    return output.past_key_values.get_seq_length()


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointed_layers_train_without_a_cache_and_infer_with_it(name, tmp_path):
    # use_cache=True is transformers' default, in training too. Backward's recomputation of a
    # checkpointed layer would append to the cache again (twice the tokens; Gemma 2's mask then fails).
    model, ids = make_model(name), batch()
    caching = lambda **kw: model(**{**kw, "use_cache": True})  # noqa: E731
    want = loss_and_grads(model, ids, run=caching)
    with torch.no_grad():
        inferred = model(input_ids=ids, use_cache=True)
    # keep_last=1: the last layer recomputed whole, whose recomputation would append to the cache.
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, keep_last=1)
    outputs = []
    with pytest.warns(
        UserWarning, match="checkpointed layers in training mode run with use_cache=False and no key/value cache"
    ):
        got = loss_and_grads(model, ids, run=lambda **kw: outputs.append(caching(**kw)) or outputs[-1])
    assert_close_runs(want, got)
    assert cache_length(outputs[0]) == 0  # as after transformers' own gradient checkpointing: nothing cached
    with torch.no_grad():  # inference is not checkpointed: the cache is filled as without apply
        applied = model(input_ids=ids, use_cache=True)
    assert cache_length(applied) == cache_length(inferred) == ids.shape[1]
    torch.testing.assert_close(applied.logits, inferred.logits)
    if name == "llama":  # and the attention op runs in training calls that asked for a cache
        assert op_calls(lambda: loss_and_grads(model, ids, run=caching)) == (4, 3)  # 4: the last layer recomputes
    handle.remove()


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_call_that_continues_a_filled_cache_with_gradients_matches_the_unpatched_model(training, tmp_path):
    # Scoring a continuation of a cached prompt with gradients on: not checkpointed (recomputation
    # would append to the cache again), and not dropped (the continuation needs the prompt's keys).
    model, ids = make_model("llama"), batch()
    model.train(training)

    def continuation(new_tokens):
        with torch.no_grad():
            cache = model(input_ids=ids[:, :-new_tokens], use_cache=True).past_key_values
        out = model(input_ids=ids[:, -new_tokens:], past_key_values=cache, use_cache=True)
        out.logits.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out.logits.detach(), cache.get_seq_length(), grads

    want = [continuation(n) for n in (8, 1)]
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    for n, (logits, length, grads) in zip((8, 1), want):
        got_logits, got_length, got_grads = continuation(n)
        torch.testing.assert_close(got_logits, logits)
        assert got_length == length == ids.shape[1]
        assert got_grads.keys() == grads.keys()
        for name in grads:  # gradients of summed logits: large, with float32 sums in another order
            torch.testing.assert_close(got_grads[name], grads[name], rtol=1e-5, atol=1e-5)
    handle.remove()


def test_layers_that_are_not_recomputed_fill_the_cache(tmp_path):
    model, ids = make_model("llama"), batch()
    plain = model(input_ids=ids, labels=ids, use_cache=True)
    handle = torch_offload.apply(model, offload="disk", checkpoint=False, spill_directory=str(tmp_path), min_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # attention_block's: the module's forward fills the cache
        applied = model(input_ids=ids, labels=ids, use_cache=True)
    applied.loss.backward()  # nothing is recomputed: the cache keeps one copy of each token
    assert cache_length(applied) == cache_length(plain) == ids.shape[1]
    for mine, theirs in zip(applied.past_key_values.layers, plain.past_key_values.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)
    handle.remove()


def test_lora_on_the_mlp_added_after_apply_is_computed_and_kept_by_remove(tmp_path):
    # The tiled_mlp op would read the base weights and bypass the adapters (and so train none of them).
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "down_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    ids = batch()
    reference = peft.get_peft_model(make_model("llama"), lora)
    want = loss_and_grads(reference, ids)
    model = make_model("llama")
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, num_shards=2)
    assert handle.tiled_mlps == 3
    model = peft.get_peft_model(model, lora)
    model.load_state_dict(reference.state_dict())  # the same adapter weights, under the same names
    tiled_mlp_op = torch.ops.offload.tiled_mlp.default
    with CountCalls(tiled_mlp_op) as mode:
        got = loss_and_grads(model, ids)
    assert mode.counts[tiled_mlp_op] == 0  # each MLP's own forward, in shards
    assert_close_runs(want, got)
    assert any("lora_A" in name for name in got[1])
    handle.remove()
    assert_close_runs(want, loss_and_grads(model, ids))  # remove() keeps the adapters


class HalveOutput(accelerate.hooks.ModelHook):
    def post_forward(self, module, output):
        return output * 0.5


def test_accelerate_hooks_put_on_projections_after_apply_are_honoured(tmp_path):
    # accelerate wraps a module's forward on the instance (dispatch_model, cpu_offload): the ops would bypass it.
    def hook_projections(model):
        for layer in model.model.layers:
            for projection in (layer.mlp.down_proj, layer.self_attn.k_proj):
                accelerate.hooks.add_hook_to_module(projection, HalveOutput())

    ids = batch()
    reference = make_model("llama")
    hook_projections(reference)
    want = loss_and_grads(reference, ids)
    model = make_model("llama")
    # The layers' path, where the ops run (the chunk-recurrent step's: test_chunk_recurrent_route.py).
    options = dict(spill_directory=str(tmp_path), min_bytes=0, num_shards=2, chunk_recurrent=False)
    handle = torch_offload.apply(model, offload="disk", **options)
    assert (handle.tiled_mlps, handle.attention_blocks) == (3, 3)
    hook_projections(model)
    tiled_mlp_op = torch.ops.offload.tiled_mlp.default
    got = {}
    with CountCalls(tiled_mlp_op) as mode:
        assert op_calls(lambda: got.__setitem__("hooked", loss_and_grads(model, ids))) == (0, 0)
    assert mode.counts[tiled_mlp_op] == 0
    assert_close_runs(want, got["hooked"])
    for layer in model.model.layers:  # accelerate leaves the bound nn.Linear.forward on the instance
        for projection in (layer.mlp.down_proj, layer.self_attn.k_proj):
            accelerate.hooks.remove_hook_from_module(projection)
    with CountCalls(tiled_mlp_op) as mode:
        assert op_calls(lambda: loss_and_grads(model, ids)) == (3, 3)  # the ops again
    assert mode.counts[tiled_mlp_op] == 3
    handle.remove()
    hook_projections(model)
    assert_close_runs(want, loss_and_grads(model, ids))


def test_train_and_eval_after_apply_reach_the_mlps_that_copies_and_remove_give_back():
    model = make_model("llama").eval()
    handle = torch_offload.apply(model, offload=None)
    assert handle.tiled_mlps == 3
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())
    model.eval()
    copied = copy.deepcopy(model)
    assert not any(m.training for m in copied.modules())
    handle.remove()
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def test_two_handles_on_one_model_are_undone_together_in_copies_and_one_by_one_by_remove(tmp_path):
    # Two decoder stacks applied one at a time: the module above both has its forward patched by each.
    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = make_model("llama"), make_model("llama")

        def forward(self, input_ids, labels, use_cache):
            return (
                self.a(input_ids=input_ids, labels=labels, use_cache=use_cache).loss
                + self.b(input_ids=input_ids, labels=labels, use_cache=use_cache).loss
            )

    def loss_and_grads_of_two(model, ids):
        model.zero_grad(set_to_none=True)
        loss = model(ids, ids, False)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model, ids = TwoStacks(), batch()
    before = module_layout(model)
    want = loss_and_grads_of_two(model, ids)
    options = dict(offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    first = torch_offload.apply(model, layers="a.model.layers", **options)
    second = torch_offload.apply(model, layers="b.model.layers", **options)
    copied = copy.deepcopy(model)
    assert module_layout(copied) == before
    model.zero_grad(set_to_none=True)
    assert_close_runs(want, loss_and_grads_of_two(copied, ids))
    assert all(p.grad is None for p in model.parameters())  # the copy trains its own parameters
    assert_close_runs(want, loss_and_grads_of_two(model, ids))
    second.remove()
    assert module_layout(copy.deepcopy(model)) == before  # the first handle's patches are still undone in copies
    first.remove()
    assert module_layout(model) == before


def test_attention_block_leaves_projections_wrapped_or_hooked_after_apply_to_the_module(tmp_path):
    model, ids = make_model("llama"), batch()
    handle = torch_offload.apply(
        model, offload="disk", spill_directory=str(tmp_path), min_bytes=0, chunk_recurrent=False
    )
    assert handle.attention_blocks == 3
    # LoRA added after apply replaces q_proj and v_proj in every layer: the op would bypass the adapters.
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(model, lora)
    got = {}
    assert op_calls(lambda: got.__setitem__("lora", loss_and_grads(model, ids))) == (0, 0)
    handle.remove()
    assert_close_runs(loss_and_grads(model, ids), got["lora"])
    plain = make_model("llama")
    handle = torch_offload.apply(
        plain, offload="disk", spill_directory=str(tmp_path), min_bytes=0, chunk_recurrent=False
    )
    calls = []
    plain.model.layers[1].self_attn.k_proj.register_forward_hook(lambda *_: calls.append(1))
    assert op_calls(lambda: loss_and_grads(plain, ids)) == (2, 2)  # layer 1 runs its module: the hook fires
    assert calls
    handle.remove()
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in model.modules())
