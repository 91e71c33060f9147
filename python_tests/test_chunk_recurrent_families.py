"""apply()'s chunk-recurrent step, family by family: on one sequence, packed documents and right- and left-padded
rows, in chunks of 5 tokens (and once at the default 2048, past two chunks), the loss and every gradient of the
un-applied model in float64 (to the model's own float32 parts: a family that computes its norms or router in
float32 sums them over other groupings of tokens). Every family of the registry: Llama 4 with its attention chunks and
query temperature at the tests' lengths, Gemma 3n with a layer attending with an earlier one's keys and values,
Qwen2-VL with its vision tower trained (text calls do not reach it)."""

import re

import pytest
import torch
import transformers
from test_apply import FAMILIES, MODELS, make_model
from test_chunk_recurrent import assert_equal_to_rounding, batches, reference
from test_chunk_recurrent_route import applied, applied_step, small_chunks  # noqa: F401 (a fixture)

from torch_offload.integrations import chunk_recurrent_route

# Families whose own forward computes in float32 inside a float64 model (norms, routers): their gradients are the
# plain model's to float32's rounding of sums over tokens, which the step groups by chunk.
FLOAT32_INSIDE = {"gemma", "gemma2", "gemma3_text", "gemma3n", "cohere", "deepseek_v3", "gpt_oss"}


def build(name):
    if name in MODELS:
        return make_model(name)
    torch.manual_seed(0)
    model = (gemma3n_sharing_keys_and_values() if name == "gemma3n" else FAMILIES[name][0]()).float().train()
    model.config.output_router_logits = False  # a router loss keeps calls on the other path (not computed yet)
    if name == "llama4":  # its layers with rotary embedding in attention chunks, as at long context
        model.config.attention_chunk_size = 8
    return model


def gemma3n_sharing_keys_and_values():
    """Gemma 3n as released: its last layers attend with the keys and values of the last earlier layer of their
    type (here layer 2 with layer 0's), which the decoder hands on."""
    config = FAMILIES["gemma3n"][0]().config
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    config.num_kv_shared_layers = 1
    model = transformers.Gemma3nForCausalLM(config)
    assert model.model.layers[2].self_attn.is_kv_shared_layer
    return model


def float64(model):
    model = model.double()
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":  # a float32-only kernel on the CPU
        model.set_experts_implementation("eager")
    return model


STEPPED = [*MODELS, *FAMILIES]
KINDS = ["one row", "packed documents", "padded rows"]  # padded rows: a left-padded row and a right-padded one
# Eager attention gives a query that sees no key (a left pad) a softmax over its whole row, and NaN in float64: the
# step keeps such calls on the other path (test_a_left_pad_of_eager_attention_keeps_the_other_path); these families'
# padded rows are right-padded.
EAGER = {"gemma2", "gpt_oss"}


def right_padded_rows():
    call = batches()["padded rows"]
    call["attention_mask"] = call["attention_mask"][[1, 1]]  # row 1's right padding in both rows
    call["labels"] = call["input_ids"].clone()
    return call


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", STEPPED)
def test_every_family_through_the_step_gives_the_un_applied_models_loss_and_gradients(name, kind, tmp_path):
    reference_model = float64(build(name))
    call = right_padded_rows() if name in EAGER and kind == "padded rows" else batches()[kind]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    if name in EAGER:  # probed in float32: float64 eager attention gives a left pad's query NaN, its own loss NaN
        model = build(name)
        handle = applied(model, tmp_path)
        model = float64(model)
    else:
        model = float64(build(name))
        handle = applied(model, tmp_path)
    assert handle.route == "chunk-recurrent step", handle.chunk_recurrent
    output, grads = applied_step(model, call)
    assert handle.chunk_recurrent_calls == 1
    if name in FLOAT32_INSIDE:
        torch.testing.assert_close(output.loss.detach(), want[0].float(), rtol=1e-6, atol=1e-7)
        assert grads.keys() == want[1].keys()
        for key, gradient in want[1].items():
            torch.testing.assert_close(grads[key], gradient, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    else:
        assert_equal_to_rounding((want[0].float(), want[1]), (output.loss.detach(), grads))


def test_a_sequence_past_two_default_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_recurrent_route, "CHUNK_TOKENS", 2048)
    reference_model, model = (make_model("llama", max_position_embeddings=8192).double() for _ in range(2))
    ids = torch.randint(3, 128, (1, 2 * 2048 + 100), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(3000), torch.arange(ids.shape[1] - 3000)])[None]  # a document across a bound
    want = reference(reference_model, ids, ids, position_ids=positions)
    handle = applied(model, tmp_path)
    output, grads = applied_step(model, dict(input_ids=ids, labels=ids, position_ids=positions))
    assert handle.chunk_recurrent_calls == 1
    assert_equal_to_rounding((want[0].float(), want[1]), (output.loss.detach(), grads))


def test_a_router_loss_asked_for_keeps_the_other_path_with_the_models_loss(tmp_path):
    reference_model, model = float64(build("mixtral")), float64(build("mixtral"))
    handle = applied(model, tmp_path)
    call = dict(batches()["two rows"], output_router_logits=True)
    want = reference_model(**call, use_cache=False)
    got = model(**call, use_cache=False)
    assert handle.chunk_recurrent_calls == 0 and re.match("off|on", handle.chunk_recurrent)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(EAGER))
def test_a_left_pad_of_eager_attention_keeps_the_other_path(name, tmp_path):
    """Its query sees no key: eager attention gives it a softmax over the whole row, later keys too, where the step
    gives 0; a call that counts its target runs the model's own path (float32: float64 eager gives NaN there)."""
    reference_model, model = build(name), build(name)
    handle = applied(model, tmp_path)
    call = batches()["padded rows"]  # row 0 left-padded, its labels counted
    want, got = reference_model(**call, use_cache=False), model(**call, use_cache=False)
    assert handle.route == "chunk-recurrent step" and handle.chunk_recurrent_calls == 0
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_a_layer_handing_on_what_its_attention_did_not_pass_keeps_the_other_path(tmp_path):
    """Backward recomputes a layer at a time and can hand on again only the keys and values the attention passed:
    a layer that hands on copies (which the later layer's gradient would not reach through the step) is refused by
    name at apply, and its calls give the un-applied model's results on the other path."""
    reference_model, model = (float64(build("gemma3n")) for _ in range(2))
    for each in (reference_model, model):
        attention = each.model.layers[0].self_attn
        own = attention.forward

        def copies_handed_on(*args, shared_kv_states, own=own, **kwargs):
            output = own(*args, shared_kv_states=shared_kv_states, **kwargs)
            shared_kv_states["sliding_attention"] = tuple(t * 1 for t in shared_kv_states["sliding_attention"])
            return output

        attention.forward = copies_handed_on
    handle = applied(model, tmp_path)
    assert handle.route == "layers' path"
    assert handle.chunk_recurrent.startswith("off: layer 0 hands shared_kv_states['sliding_attention'] on to the")
    call = batches()["packed documents"]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    output, grads = applied_step(model, call)
    torch.testing.assert_close(output.loss.detach(), want[0].float(), rtol=1e-6, atol=1e-7)
    for key, gradient in want[1].items():
        torch.testing.assert_close(grads[key], gradient, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
