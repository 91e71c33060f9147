"""apply() never changes what a model computes or how the stack around it sees it.

Each test compares an applied model with a copy of it made before apply: forwards' signatures
(which generate() and Trainer read), generation, training through Trainer, and the cases that a
probe on small activations or an unmasked batch could not tell apart.
"""

import copy
import inspect
import warnings

import pytest
import torch
import transformers
from test_apply import (
    FAMILIES,
    MODELS,
    TINY,
    assert_close_runs,
    batch,
    loss_and_grads,
    make_model,
    op_calls,
    tier_options,
)
from torch import nn

import torch_offload


def build(name):
    if name in MODELS:
        return make_model(name)
    torch.manual_seed(0)
    return FAMILIES[name][0]().float().train()


def forward_signatures(model):
    return {name: inspect.signature(module.forward) for name, module in model.named_modules()}


@pytest.mark.parametrize("offload", [None, "disk"])
@pytest.mark.parametrize("name", list(MODELS) + list(FAMILIES))
def test_every_forward_apply_installs_presents_the_originals_signature(name, offload, tmp_path):
    model = build(name)
    before = forward_signatures(model)
    docs = {name: module.forward.__doc__ for name, module in model.named_modules()}
    handle = torch_offload.apply(model, offload=offload, **tier_options(offload, tmp_path))
    installed = [patch for patch in handle._patches if patch.key == "forward"]
    assert installed
    for name_, module in model.named_modules():
        if isinstance(module, torch_offload.TiledMLP):  # a module in the MLP's place takes its one input
            assert [module.input_name] == list(before[name_].parameters)
            continue
        assert inspect.signature(module.forward) == before[name_], name_
        assert module.forward.__doc__ == docs[name_], name_
    for patch in installed:
        assert inspect.unwrap(patch.value) is not patch.value  # __wrapped__ leads to the original
    handle.remove()
    assert forward_signatures(model) == before


def test_a_tiled_mlp_takes_its_input_by_the_mlps_own_name():
    model = make_model("llama")
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 32)
    tiled = torch_offload.TiledMLP(mlp, num_shards=2)
    torch.testing.assert_close(tiled(x=x), mlp(x))
    with pytest.raises(TypeError, match="takes one argument, 'x'; got 2"):
        tiled(x, x)


def left_padded():
    ids = batch()[:, :10]
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0  # the pad token
    return ids, mask


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])  # absolute positions, rotary positions
def test_left_padded_generate_equals_the_unapplied_model(name, sample, tmp_path):
    model = make_model(name)
    plain = copy.deepcopy(model)
    ids, mask = left_padded()
    torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path))
    runs = []
    for m in (plain, model):
        m.eval()
        torch.manual_seed(3)
        runs.append(
            m.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=8,
                do_sample=sample,
                top_k=0,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
        )
    torch.testing.assert_close(runs[1].sequences, runs[0].sequences, rtol=0, atol=0)
    for mine, theirs in zip(runs[1].logits, runs[0].logits):
        torch.testing.assert_close(mine, theirs)


def tiny_qwen2_vl():
    build_model, _, _ = FAMILIES["qwen2_vl"]
    model = build_model()
    model.config.image_token_id, model.config.vision_start_token_id, model.config.vision_end_token_id = 5, 6, 7
    return model.float().eval()


def test_qwen2_vl_generate_with_pixels_equals_the_unapplied_model(tmp_path):
    torch.manual_seed(0)
    model = tiny_qwen2_vl()
    plain = copy.deepcopy(model)
    torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path))
    # One 2x2-patch image (patch 2, temporal patch 1, merge 1): four image tokens.
    grid = torch.tensor([[1, 2, 2]])
    pixels = torch.randn(4, 3 * 2 * 2, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[9, 6, 5, 5, 5, 5, 7, 11, 12]])
    outputs = [
        m.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels,
            image_grid_thw=grid,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
        )
        for m in (plain, model)
    ]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def word_tokenizer():
    import tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 3, **{f"w{i}": i for i in range(4, 128)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def trainer_losses(model, tmp_path):
    """Three steps of transformers' Trainer with its defaults (remove_unused_columns=True) on rows of 5-12 tokens,
    padded by DataCollatorWithPadding to 12, labels ignored at the pads."""
    generator = torch.Generator().manual_seed(2)
    rows = []
    for length in (5, 12, 9, 7, 12, 6):
        ids = torch.randint(4, 128, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": ids + [-100] * (12 - length)})
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    collator = transformers.DataCollatorWithPadding(word_tokenizer(), padding="max_length", max_length=12)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=rows, data_collator=collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_with_its_default_column_removal_gives_the_unapplied_losses(tmp_path):
    model = make_model("llama")
    plain = copy.deepcopy(model)
    want = trainer_losses(plain, tmp_path / "plain")
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path))
    got = trainer_losses(model, tmp_path / "applied")
    assert len(want) == 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    handle.remove()


def tiny_olmo(**options):
    torch.manual_seed(0)
    config = transformers.OlmoConfig(**dict(TINY, intermediate_size=80), **options)
    return transformers.OlmoForCausalLM(config).float().train()


def scale_qkv(model, factor):
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.weight.mul_(factor)


def test_olmo_clip_qkv_keeps_the_modules_attention(tmp_path):
    model, ids = tiny_olmo(clip_qkv=8.0).double(), batch()
    scale_qkv(model, 100.0)  # q, k and v well past the clip, as trained OLMo weights reach it (float64: exact)
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert all(
        how == "module: config.clip_qkv is 8.0, which the op does not compute" for how in handle.attention.values()
    ), handle.attention
    got = []
    assert op_calls(lambda: got.append(loss_and_grads(model, ids))) == (0, 0)
    assert_close_runs(want, got[0])
    handle.remove()


def test_a_clip_qkv_set_after_apply_sends_calls_to_the_module(tmp_path):
    model, ids = tiny_olmo().double(), batch()
    scale_qkv(model, 100.0)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert handle.attention_blocks == 3
    model.config.clip_qkv = 8.0  # the attention modules share it
    want = loss_and_grads(copy.deepcopy(model), ids)  # a copy is the model before apply
    got = []
    assert op_calls(lambda: got.append(loss_and_grads(model, ids))) == (0, 0)
    assert_close_runs(want, got[0])
    handle.remove()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_olmo_float32_rotary_tables_in_a_bf16_or_float64_model(dtype, tmp_path):
    # OLMo's rotary embedding returns float32 tables whatever the model's dtype; its attention rotates in
    # the wider of the two dtypes. float64: the tables promote exactly, the op runs; bfloat16: the module.
    model, ids = tiny_olmo().to(dtype), batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert handle.attention_blocks == 3
    got = []
    calls = op_calls(lambda: got.append(loss_and_grads(model, ids)))
    if dtype == torch.float64:
        assert calls == (3, 3)  # each layer's forward and backward
        assert_close_runs(want, got[0])
    else:
        assert calls == (0, 0)
        torch.testing.assert_close(got[0][0], want[0], rtol=2e-2, atol=2e-2)
    handle.remove()


class ClampedMLP(nn.Module):
    """Llama's MLP with its gate clamped at 8: only activations past 8 tell it from the op's."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x).clamp(-8, 8)) * self.up_proj(x))


class ClampedAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """Llama's attention on its input clamped at 8: only activations past 8 tell it from the op's."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        return super().forward(hidden_states.clamp(-8, 8), position_embeddings, attention_mask, cache, **kwargs)


def test_a_difference_only_large_activations_reach_is_never_sent_to_an_op_that_lacks_it(tmp_path):
    model, ids = make_model("llama"), batch()
    for index, layer in enumerate(model.model.layers):
        attention = ClampedAttention(model.config, index)
        attention.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn, layer.mlp = attention, ClampedMLP(layer.mlp)
    with torch.no_grad():  # activations past the clamps, in this batch too
        for layer in model.model.layers:
            layer.input_layernorm.weight.mul_(100.0)
            layer.post_attention_layernorm.weight.mul_(100.0)
    want = loss_and_grads(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert set(handle.mlp_tiling.values()) == {"tiled_apply"}  # token-wise, so its own forward in shards
    assert all(
        how.startswith(
            "module: its forward computes something else than the op (a probe on random weights "
            "at input scale 16 differs)"
        )
        for how in handle.attention.values()
    ), handle.attention
    assert_close_runs(want, loss_and_grads(model, ids))
    handle.remove()


def tiny_qwen2_audio():
    torch.manual_seed(0)
    config = transformers.Qwen2AudioConfig(
        audio_config=dict(
            d_model=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            num_mel_bins=8,
            max_source_positions=16,
        ),
        text_config=dict(TINY, intermediate_size=80, model_type="qwen2"),
        audio_token_index=200,
    )
    return transformers.Qwen2AudioForConditionalGeneration(config).float().train()


def test_a_model_whose_loss_drops_masked_positions_keeps_its_own_loss(tmp_path):
    # Qwen2-Audio's loss leaves out the positions where attention_mask is 0, labels or not.
    model, ids = tiny_qwen2_audio(), batch()
    mask = torch.ones_like(ids)
    mask[0, -6:] = 0
    run = lambda m: lambda **kw: m(**kw, attention_mask=mask)  # noqa: E731 - labels are not -100 at the pads
    want = loss_and_grads(model, ids, run=run(model))
    with pytest.warns(UserWarning, match="the loss stays the model's own"):
        handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert handle.loss.startswith("unfused: the fused loss") and "attention_mask" in handle.loss, handle.loss
    assert_close_runs(want, loss_and_grads(model, ids, run=run(model)))
    handle.remove()


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_models_with_transformers_loss_keep_the_fused_loss_on_padded_batches(name, tmp_path):
    model, ids = make_model(name), batch()
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    run = lambda **kw: model(**kw, attention_mask=mask)  # noqa: E731
    want = loss_and_grads(model, ids, run=run)
    handle = torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path), min_bytes=0)
    assert handle.loss == "linear_cross_entropy"
    assert_close_runs(want, loss_and_grads(model, ids, run=run))
    handle.remove()


def test_transformers_output_capturing_hooks_keep_the_attention_op_and_record_its_outputs():
    # A first call asking for hidden states (or attentions, or router logits) hooks every decoder layer and attention
    # module for good; the hooks run around the op's forward as around the module's, so apply keeps the op.
    model, ids = make_model("llama"), batch()
    with torch.no_grad():
        want_states = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    assert all(layer.self_attn._forward_hooks for layer in model.model.layers)
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, num_shards=2)
    assert handle.attention_blocks == 3, handle.attention
    states, got = [], {}

    def run(**kwargs):
        out = model(**kwargs, output_hidden_states=True)
        states.extend(out.hidden_states)
        return out

    # The op's forward in each layer, and its backward.
    assert op_calls(lambda: got.update(applied=loss_and_grads(model, ids, run=run))) == (3, 3)
    assert_close_runs(want, got["applied"])
    assert len(states) == len(want_states) == 4
    for have, expected in zip(states, want_states):
        torch.testing.assert_close(have, expected, rtol=1e-5, atol=1e-6)
    handle.remove()
