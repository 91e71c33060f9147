"""apply()'s chunk-recurrent step on models as users change them: adapters on the embedding, parameters beside a
module's weight, attention subclasses, per-layer attributes, classes patched after apply, tensors changed in place
between forward and backward. Each call gives what the un-applied model gives, its loss and every gradient in float64
to rounding, or its error; where the step cannot compute it, the call keeps apply's other path (handle.chunk_recurrent
says why)."""

import re

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from test_chunk_recurrent import assert_equal_to_rounding, batches, reference
from test_chunk_recurrent_route import applied, applied_step, build, small_chunks  # noqa: F401 (a fixture)

# A subclass in a user's module, which imports the family's rotary function as such modules do.
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: F401

import torch_offload


class GatedAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """Llama's attention with a trained gate of its own on the output: zero at first, where it changes nothing."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.gate = torch.nn.Parameter(torch.zeros(()))

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * (1 + self.gate), weights


class ShiftedLlama(transformers.LlamaForCausalLM):
    """A causal LM whose own forward adds a trained shift (zero at first) to its decoder's output: a parameter in
    neither the decoder nor the output layer that its loss reaches, which the step would give no gradient."""

    def __init__(self, config):
        super().__init__(config)
        self.shift = torch.nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state + self.shift
        logits = self.lm_head(hidden)
        targets = None if labels is None else F.pad(labels, (0, 1), value=-100)[:, 1:]
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten()).float()
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def llama():
    return build("llama").double()


def a_shift_outside_the_decoder():
    model = ShiftedLlama(llama().config).double()
    model.load_state_dict(llama().state_dict(), strict=False)
    return model


def lora_on_the_embedding():
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    torch.manual_seed(2)
    for name, parameter in model.named_parameters():
        if "lora_B" in name or "lora_embedding_B" in name:  # adapters that are not zero, so that every gradient shows
            parameter.data.normal_()
    return model


def trainable_tokens():
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[5, 6, 7])
    return peft.get_peft_model(llama(), config)


def a_bias_on_the_final_norm():
    model = llama()
    norm = model.model.norm
    norm.bias = torch.nn.Parameter(torch.zeros(norm.weight.shape, dtype=norm.weight.dtype))
    own = type(norm).forward

    class NormWithBias(type(norm)):
        def forward(self, hidden):
            return own(self, hidden) + self.bias

    norm.__class__ = NormWithBias
    return model


def scale_grad_by_freq():
    model = llama()
    model.model.embed_tokens.scale_grad_by_freq = True
    return model


def sparse_embedding():
    model = llama()
    model.model.embed_tokens.sparse = True
    return model


def one_layer_scaled_otherwise():
    model = llama()
    model.model.layers[1].self_attn.scaling = 0.7
    return model


def gated_attention():
    model = llama()
    for index, layer in enumerate(model.model.layers):
        gated = GatedAttention(model.config, index).double()
        gated.load_state_dict(layer.self_attn.state_dict(), strict=False)
        layer.self_attn = gated
    return model


def open_the_gates(model):
    for layer in model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers:
        layer.self_attn.gate.data.fill_(0.5)


def move_the_bias(model):
    model.model.norm.bias.data.fill_(0.3)


# name: (the model, what changes after apply (in both models), whether the step takes the calls)
CASES = {
    "lora on the embedding": (lora_on_the_embedding, None, True),
    "peft's trainable tokens": (trainable_tokens, None, True),
    "a parameter of the final norm beside its weight": (a_bias_on_the_final_norm, move_the_bias, True),
    "a trained parameter outside the decoder its loss reaches": (a_shift_outside_the_decoder, None, False),
    "scale_grad_by_freq": (scale_grad_by_freq, None, False),
    "a sparse embedding": (sparse_embedding, None, False),
    "a layer's own attention scaling": (one_layer_scaled_otherwise, None, True),
    "an attention subclass with a parameter of its own": (gated_attention, open_the_gates, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_gives_the_un_applied_models_results_or_keeps_the_other_path(case, tmp_path):
    make, change, stepped = CASES[case]
    reference_model, model = make(), make()
    handle = applied(model, tmp_path)
    for each in (reference_model, model) if change is not None else ():
        change(each)
    call = batches()["packed rows"]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    output, grads = applied_step(model, call)
    assert handle.chunk_recurrent_calls == int(stepped), handle.chunk_recurrent
    for name, gradient in want[1].items():
        assert grads[name].layout == gradient.layout, name  # sparse where the model's own gradient is
    dense = {name: gradient.to_dense() for name, gradient in grads.items()}
    assert_equal_to_rounding((want[0].float(), {n: g.to_dense() for n, g in want[1].items()}), (output.loss, dense))


@pytest.mark.parametrize(
    "case, reason",
    [
        ("a trained parameter outside the decoder its loss reaches", "shift is trained, .* its loss reaches it"),
        ("scale_grad_by_freq", "scales gradients by token frequency"),
        ("a sparse embedding", "gradient is sparse"),
    ],
)
def test_what_the_step_cannot_differentiate_is_named(case, reason, tmp_path):
    handle = applied(CASES[case][0](), tmp_path)
    assert handle.chunk_recurrent.startswith("off: ") and re.search(reason, handle.chunk_recurrent)
    ids = batches()["one row"]["input_ids"]
    with pytest.raises(ValueError, match="chunk_recurrent_loss: model: .*" + reason):
        torch_offload.chunk_recurrent_loss(CASES[case][0](), ids, ids, directory=tmp_path)


@pytest.mark.parametrize("chunk_recurrent", [True, False], ids=["the step", "the layers' path"])
def test_a_layer_class_patched_after_apply_runs_its_new_forward(chunk_recurrent, tmp_path, monkeypatch):
    reference_model, model = llama(), llama()
    handle = applied(model, tmp_path, chunk_recurrent=chunk_recurrent)
    layer_class = type(model.model.layers[0])
    own = layer_class.forward
    monkeypatch.setattr(layer_class, "forward", lambda self, *args, **kwargs: own(self, *args, **kwargs) * 1.5)
    call = batches()["two rows"]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    output, grads = applied_step(model, call)
    assert handle.chunk_recurrent_calls == int(chunk_recurrent)  # the step runs the layers' own forwards
    assert_equal_to_rounding((want[0].float(), want[1]), (output.loss.detach(), grads))


def change_the_positions(model, call):
    call["position_ids"].add_(1)


def change_the_ids(model, call):
    call["input_ids"][0, 0] = 9


def change_a_weight(model, call):
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)


@pytest.mark.parametrize(
    "change, raises",
    [(change_the_positions, False), (change_the_ids, True), (change_a_weight, True)],
    ids=["position_ids", "input_ids", "a weight"],
)
def test_tensors_changed_in_place_before_backward_give_plain_pytorchs_gradients_or_error(change, raises, tmp_path):
    """Plain PyTorch's backward raises where a tensor it saved changed since forward (a weight, the ids the embedding
    saved); the step's does too. Where plain PyTorch saved what it computed from one (the rotary embedding of
    position_ids), the step's gradients are its."""
    reference_model, model = llama(), llama()
    handle = applied(model, tmp_path)
    results = []
    for each in (reference_model, model):
        each.zero_grad(set_to_none=True)
        call = batches()["packed documents"]
        if each is model:
            loss = model(**call, use_cache=False).loss
        else:  # transformers' loss in the logits' dtype, float64 (its own .loss is float32), as reference() has it
            targets = torch.nn.functional.pad(call["labels"], (0, 1), value=-100)[0, 1:]
            logits = each(input_ids=call["input_ids"], position_ids=call["position_ids"], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[0], targets)
        change(each, call)
        if raises:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
            continue
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in each.named_parameters()}))
    assert handle.chunk_recurrent_calls == 1
    if not raises:
        assert_equal_to_rounding((results[0][0].float(), results[0][1]), results[1])
