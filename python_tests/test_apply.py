"""torch_offload.apply() on tiny random-init Hugging Face causal LMs (nothing downloaded)."""
import peft
import pytest
import torch
import transformers
from torch import nn

import torch_offload

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(num_key_value_heads=2)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=8)),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(num_key_value_heads=1, head_dim=8)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(num_key_value_heads=4)),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
}
# How each family's MLP is tiled: by the tiled_mlp op, or by the generic tiled_apply.
EXPECTED_PATH = {"phi3": "tiled_applies", "gpt2": "tiled_applies"}


def make_model(name):
    config_cls, model_cls, extra = MODELS[name]
    kwargs = dict(COMMON, **extra)
    if name == "gpt2":
        kwargs = {k: v for k, v in kwargs.items() if k not in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                                 "num_attention_heads", "max_position_embeddings")}
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
    assert list(model.state_dict()) == keys  # same parameters under the same names
    got = loss_and_grads(model, ids)
    assert_close_runs(want, got)
    stats = handle.stats()
    assert stats["disk_bytes"] > 0 and stats["live_entries"] == 0
    handle.remove()
    assert [type(m) for m in model.modules()] == mlp_types
    assert not any("forward" in vars(m) for m in model.modules())
    assert_close_runs(want, loss_and_grads(model, ids))


@pytest.mark.parametrize("options", [
    dict(offload=None),
    dict(offload=None, checkpoint=False),
    dict(tiled_mlp=False, offload="disk", min_bytes=0, keep_last=0),
    dict(offload="cpu", keep_last=3),
], ids=["checkpoint_only", "tiled_only", "offload_only", "keep_all"])
def test_apply_options_keep_results(options, tmp_path):
    if options.get("offload") == "disk":
        options = dict(options, spill_directory=str(tmp_path))
    model, ids = make_model("llama"), batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, **options)
    assert_close_runs(want, loss_and_grads(model, ids))
    handle.remove()


def test_peft_lora_llama_trains_with_apply(tmp_path):
    model = make_model("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
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


@pytest.mark.parametrize("offload", [None, "disk"])
def test_compiled_patched_model_matches_eager(offload, tmp_path):
    model, ids = make_model("llama"), batch()
    handle = torch_offload.apply(model, offload=offload, num_shards=2, min_bytes=0, spill_directory=str(tmp_path))
    want = loss_and_grads(model, ids)
    torch._dynamo.reset()
    got = loss_and_grads(model, ids, run=torch.compile(model))
    assert_close_runs(want, got)
    handle.remove()


def test_bad_inputs_are_explained(tmp_path):
    with pytest.raises(ValueError, match="found no decoder layers in Sequential: looked for an nn.ModuleList"):
        torch_offload.apply(nn.Sequential(nn.Linear(4, 4)))
    model = make_model("llama")
    with pytest.raises(ValueError, match="offload must be one of"):
        torch_offload.apply(model, offload="gpu")
    with pytest.raises(ValueError, match="keep_last must be an int >= 0"):
        torch_offload.apply(model, keep_last=-1)
    with pytest.raises(RuntimeError, match="disk_spill: directory .* cannot be used"):
        torch_offload.apply(model, offload="disk", spill_directory=str(tmp_path / "missing"))
    # Nothing was left patched by the failed calls.
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.model.layers)
