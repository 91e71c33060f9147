"""chunk_recurrent_loss: the loss and every gradient of the model's own step, in float64 to rounding, for the
families it takes, chunks that do and do not divide the sequence, tied heads, frozen weights and a scaled loss;
nothing left open; bad input refused by name."""

import gc
import os

import pytest
import torch
import transformers
from test_apply import assert_close_runs, make_model

import torch_offload

TOKENS = 23


def tokens_and_labels():
    ids = torch.randint(3, 128, (1, TOKENS), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 4:9] = -100  # a prompt's tokens, not counted
    return ids, labels


def build(name, **overrides):
    if name == "mistral":
        overrides.setdefault("sliding_window", None)
    return make_model(name, **overrides)


def reference(model, ids, labels):
    """Plain PyTorch's loss and gradients: transformers' shifted cross-entropy on the model's logits, in the logits'
    dtype (transformers' own loss is float32 even for a float64 model)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits[0]
    targets = torch.cat([labels[0, 1:], labels.new_full((1,), -100)])
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    loss.backward()
    return loss.detach(), gradients(model)


def chunked(model, ids, labels, directory, scale=1.0, **options):
    model.zero_grad(set_to_none=True)
    loss = torch_offload.chunk_recurrent_loss(model, ids, labels, directory=directory, **options)
    (loss * scale if scale != 1.0 else loss).backward()
    return loss.detach(), gradients(model)


def gradients(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal_to_rounding(want, got):
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-13)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("chunk_tokens", [1, 5, TOKENS, 64])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_float64_loss_and_gradients_equal_plain_pytorch(name, chunk_tokens, tmp_path):
    model, (ids, labels) = build(name).double(), tokens_and_labels()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped queries
    want = reference(model, ids, labels)
    got = chunked(model, ids, labels, tmp_path, chunk_tokens=chunk_tokens)
    assert got[0].dtype == torch.float64
    assert_equal_to_rounding(want, got)


def test_tied_head_frozen_weights_and_a_scaled_loss(tmp_path):
    model, (ids, labels) = build("llama", tie_word_embeddings=True).double(), tokens_and_labels()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for parameter in (*model.model.layers[0].parameters(), model.model.norm.weight):
        parameter.requires_grad_(False)
    loss, grads = reference(model, ids, labels)
    got = chunked(model, ids, labels, tmp_path, scale=3.0, chunk_tokens=4)
    assert "model.layers.0.mlp.up_proj.weight" not in got[1] and "model.norm.weight" not in got[1]
    assert_equal_to_rounding((loss, {n: 3 * g for n, g in grads.items()}), got)


def test_a_kept_graph_runs_backward_again_and_a_freed_one_says_so(tmp_path):
    model, (ids, labels) = build("llama").double(), tokens_and_labels()
    loss, grads = reference(model, ids, labels)
    model.zero_grad(set_to_none=True)
    got = torch_offload.chunk_recurrent_loss(model, ids, labels, chunk_tokens=5, directory=tmp_path)
    got.backward(retain_graph=True)
    got.backward()
    assert_equal_to_rounding((loss, {n: 2 * g for n, g in grads.items()}), (got.detach(), gradients(model)))
    with pytest.raises(RuntimeError, match="chunk_recurrent_loss: a second backward through the step"):
        got.backward()


def test_frozen_embeddings_and_one_trained_projection(tmp_path):
    model, (ids, labels) = build("qwen2").double(), tokens_and_labels()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name == "model.layers.1.self_attn.q_proj.weight")  # as LoRA leaves a base model
    want = reference(model, ids, labels)
    assert list(want[1]) == ["model.layers.1.self_attn.q_proj.weight"]
    assert_equal_to_rounding(want, chunked(model, ids, labels, tmp_path, chunk_tokens=7))


def test_float32_equals_the_models_own_step(tmp_path):
    model, (ids, labels) = build("llama"), tokens_and_labels()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    want = loss.detach(), gradients(model)
    got = chunked(model, ids, labels, tmp_path, chunk_tokens=6)
    assert got[0].dtype == torch.float32
    assert_close_runs(want, got)


def test_gradcheck_float64(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=11, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().train()
    for norm in (m for m in model.modules() if isinstance(m, transformers.models.llama.modeling_llama.LlamaRMSNorm)):
        norm.forward = float64_rms_norm(norm)  # transformers' computes in float32: too coarse for finite differences
    ids = torch.randint(0, 11, (1, 7), generator=torch.Generator().manual_seed(1))
    parameters = [p for p in model.parameters()]

    def step(*_parameters):  # the model's own parameters: gradcheck perturbs them in place
        return torch_offload.chunk_recurrent_loss(model, ids, ids, chunk_tokens=3, directory=tmp_path)

    assert torch.autograd.gradcheck(step, parameters, eps=1e-6, atol=1e-6)


def float64_rms_norm(norm):
    def forward(hidden):
        return norm.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)

    return forward


def test_without_gradients_and_without_backward_nothing_stays_open(tmp_path):
    model, (ids, labels) = build("llama").double(), tokens_and_labels()
    want = reference(model, ids, labels)[0]
    gc.collect()
    descriptors = len(os.listdir("/proc/self/fd"))
    with torch.no_grad():
        loss = torch_offload.chunk_recurrent_loss(model, ids, labels, chunk_tokens=5, directory=tmp_path)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-13)
    assert not loss.requires_grad
    loss = torch_offload.chunk_recurrent_loss(model, ids, labels, chunk_tokens=5, directory=tmp_path)
    assert len(os.listdir("/proc/self/fd")) == descriptors + 1  # the step's chunk file, kept for backward
    del loss  # a graph dropped without backward
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == descriptors
    chunked(model, ids, labels, tmp_path, chunk_tokens=5)
    assert len(os.listdir("/proc/self/fd")) == descriptors and os.listdir(tmp_path) == []


def with_query_norm(model):
    model.model.layers[0].self_attn.q_norm = torch.nn.Identity()  # as Qwen3's, which its forward would call
    return model


def skip_a_layer(model):
    model.model.layers[1].forward = lambda hidden_states, **_: hidden_states  # its modules as before
    return model


BAD_MODELS = {
    "qwen3": (lambda: build("qwen3"), "model type 'qwen3'"),
    "attention_child": (lambda: with_query_norm(build("llama")), "an attention's children are not"),
    "gpt2": (lambda: build("gpt2"), "model type 'gpt2'"),
    "sliding_window": (lambda: build("mistral", sliding_window=8), "a sliding window"),
    "attention_dropout": (lambda: build("llama", attention_dropout=0.1), "attention dropout"),
    "forward_not_llamas": (lambda: skip_a_layer(build("llama")), "its forward is not Llama's"),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_a_model_it_does_not_compute_exactly_is_refused(case, tmp_path):
    make, message = BAD_MODELS[case]
    ids, labels = tokens_and_labels()
    with pytest.raises(ValueError, match="chunk_recurrent_loss: model: .*" + message.replace("(", r"\(")):
        torch_offload.chunk_recurrent_loss(make(), ids, labels, directory=tmp_path)
    assert os.listdir(tmp_path) == []


BAD_INPUTS = {
    "float_ids": (dict(input_ids=torch.ones(1, 8)), TypeError, "input_ids must be an int64 CPU tensor"),
    "int32_labels": (dict(labels=torch.ones(1, 8, dtype=torch.int32)), TypeError, "labels must be an int64"),
    "two_rows": (dict(input_ids=torch.ones(2, 4, dtype=torch.long)), ValueError, r"input_ids must be \[1, T\]"),
    "empty": (dict(input_ids=torch.ones(1, 0, dtype=torch.long)), ValueError, "input_ids must be"),
    "shapes": (dict(labels=torch.ones(1, 7, dtype=torch.long)), ValueError, "labels' shape"),
    "zero_chunk": (dict(chunk_tokens=0), ValueError, "chunk_tokens must be a positive int"),
    "bool_chunk": (dict(chunk_tokens=True), ValueError, "chunk_tokens must be a positive int"),
    "float_chunk": (dict(chunk_tokens=4.0), ValueError, "chunk_tokens must be a positive int"),
    "no_directory": (dict(directory="/nonexistent/chunks"), ValueError, "directory '/nonexistent/chunks'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_by_name(case, tmp_path):
    overrides, error, message = BAD_INPUTS[case]
    ids = torch.ones(1, 8, dtype=torch.long)
    arguments = {**dict(input_ids=ids, labels=ids, directory=tmp_path), **overrides}
    with pytest.raises(error, match="chunk_recurrent_loss: " + message):
        torch_offload.chunk_recurrent_loss(build("llama"), **arguments)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_ram_directory_is_refused():
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="directory '/dev/shm' is on a RAM file system"):
        torch_offload.chunk_recurrent_loss(build("llama"), ids, ids, directory="/dev/shm")
