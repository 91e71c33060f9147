"""apply()'s chunk-recurrent step (torch_offload/integrations/chunk_recurrent_route.py): a training call with labels
gives the un-applied model's loss and gradients (float64, to rounding) on every kind of batch, for the families it
takes; the calls and models that keep apply's other path get it, with the same results; remove() restores."""

import copy
import functools
import gc
import os
import re
import warnings

import accelerate.hooks
import peft
import pytest
import torch
from test_apply import HalveOutput, make_model, tier_options
from test_chunk_recurrent import assert_equal_to_rounding, batches, gradients, reference
from test_disk_spill import free_bytes, small_fs, spill_files_in, wait_for_io  # noqa: F401 (small_fs: a fixture)

import torch_offload
from torch_offload.integrations import chunk_recurrent_route

STEPPED = ["llama", "mistral_without_window", "qwen2", "qwen3"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 5 tokens: the tests' rows of 23 cross four chunk bounds, their documents and padding too."""
    monkeypatch.setattr(chunk_recurrent_route, "CHUNK_TOKENS", 5)


def build(name):
    if name == "mistral_without_window":
        return make_model("mistral", sliding_window=None)
    return make_model(name)


def applied(model, tmp_path, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loss probe's, on models whose losses it fuses
        return torch_offload.apply(model, **tier_options("disk", tmp_path), **options)


def applied_step(model, call):
    model.zero_grad(set_to_none=True)
    output = model(**call, use_cache=False)
    output.loss.backward()
    return output, gradients(model)


# Llama on every kind of batch, the other families on packed and padded rows (test_chunk_recurrent.py has every
# family on one row, and the step's own checks on every batch).
CASES = [("llama", kind) for kind in batches()] + [
    (name, kind) for name in STEPPED[1:] for kind in ("padded rows", "packed rows")
]


@pytest.mark.parametrize("name, kind", CASES)
def test_the_step_gives_the_un_applied_models_loss_and_gradients(name, kind, tmp_path):
    reference_model, model = build(name).double(), build(name).double()
    call = batches()[kind]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    handle = applied(model, tmp_path)
    assert handle.chunk_recurrent == "on" and "chunk-recurrent step: on" in str(handle)
    output, grads = applied_step(model, call)
    assert handle.chunk_recurrent_calls == 1 and output.logits is None
    assert output.loss.dtype == torch.float32  # as the fused loss's and transformers' own
    assert_equal_to_rounding((want[0].float(), want[1]), (output.loss.detach(), grads))
    handle.remove()
    assert "forward" not in vars(model)


def test_the_step_runs_in_float32_and_under_gradient_accumulation(tmp_path):
    reference_model, model = build("llama"), build("llama")
    handle = applied(model, tmp_path)
    call = batches()["padded rows"]
    reference_model.zero_grad(set_to_none=True)
    for _ in range(2):
        reference_model(**call, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        model(**call, use_cache=False).loss.backward()
    assert handle.chunk_recurrent_calls == 2
    for name, parameter in model.named_parameters():
        want = dict(reference_model.named_parameters())[name].grad
        torch.testing.assert_close(parameter.grad, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_call_asking_for_a_cache_gets_an_empty_one_and_a_warning(tmp_path):
    model = build("llama")
    handle = applied(model, tmp_path)
    with pytest.warns(UserWarning, match="run with use_cache=False and no key/value cache"):
        output = model(**batches()["one row"])  # use_cache from the config: True
    assert handle.chunk_recurrent_calls == 1
    assert output.get("cache", output.get("past_key_values")).get_seq_length() == 0


def with_attention_hook(model):
    model.model.layers[1].self_attn.register_forward_hook(lambda *args: None)


def holes(call):
    call["attention_mask"] = torch.ones_like(call["input_ids"])
    call["attention_mask"][0, 3] = 0
    call["labels"] = call["labels"].masked_fill(call["attention_mask"] == 0, -100)


# Calls the step does not take: each runs the forward apply installed before it, with the model's own results.
KEPT = {
    "no labels": (lambda model: None, lambda call: call.pop("labels")),
    "eval mode": (lambda model: model.eval(), lambda call: None),
    "shift_labels without labels": (lambda model: None, lambda call: call.update(shift_labels=call.pop("labels"))),
    "hidden states recorded": (lambda model: None, lambda call: call.update(output_hidden_states=True)),
    "a hook on an attention module": (with_attention_hook, lambda call: None),
    "a hook on an MLP": (
        lambda model: model.model.layers[0].mlp.register_forward_hook(lambda *a: None),
        lambda c: None,
    ),
    "an attention_mask with holes": (lambda model: None, holes),
    "autocast": (lambda model: None, lambda call: None),
}
# The model of a case, where not Llama.
KEPT_MODELS = {}


@pytest.mark.parametrize("case", list(KEPT))
def test_calls_the_step_does_not_take_keep_applys_other_path(case, tmp_path):
    change_model, change_call = KEPT[case]
    make = KEPT_MODELS.get(case, lambda: build("llama"))
    reference_model, model = make(), make()
    handle = applied(model, tmp_path)
    assert handle.chunk_recurrent == "on"
    call = batches()["two rows"]
    change_call(call)
    for each in (model, reference_model):
        change_model(each)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else torch.enable_grad()
    with context:
        got = model(**call, use_cache=False)
        want = reference_model(**call, use_cache=False)
    assert handle.chunk_recurrent_calls == 0
    if "labels" in call:
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replaced", ["the attention class's forward", "a layer's attention module"])
def test_an_attention_replaced_after_apply_runs_in_the_step(replaced, tmp_path, monkeypatch):
    """The step runs the attention modules' own forwards: one replaced since apply, or its class's forward, runs in
    it, with the un-applied model's results."""
    reference_model, model = build("llama").double(), build("llama").double()
    handle = applied(model, tmp_path)
    if replaced == "a layer's attention module":
        for each in (reference_model, model):
            each.model.layers[1].self_attn = copy.deepcopy(each.model.layers[1].self_attn)
            each.model.layers[1].self_attn.o_proj.weight.data.mul_(2)
    else:
        own = type(model.model.layers[1].self_attn).forward
        halved = lambda self, *args, **kwargs: (own(self, *args, **kwargs)[0] / 2, None)  # noqa: E731
        monkeypatch.setattr(type(model.model.layers[1].self_attn), "forward", halved)
    call = batches()["two rows"]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    output, grads = applied_step(model, call)
    assert handle.chunk_recurrent_calls == 1
    assert_equal_to_rounding((want[0].float(), want[1]), (output.loss.detach(), grads))


def test_accelerate_hooks_put_on_projections_after_apply_are_honoured(tmp_path):
    def hook_projections(model):  # accelerate wraps a module's forward on the instance (dispatch_model, offloading)
        for layer in model.model.layers:
            for projection in (layer.mlp.down_proj, layer.self_attn.k_proj):
                accelerate.hooks.add_hook_to_module(projection, HalveOutput())

    reference_model, model = build("llama").double(), build("llama").double()
    hook_projections(reference_model)
    call = batches()["padded rows"]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    handle = applied(model, tmp_path)
    hook_projections(model)
    output, grads = applied_step(model, call)
    assert handle.chunk_recurrent_calls == 1
    assert_equal_to_rounding((want[0].float(), want[1]), (output.loss.detach(), grads))


def lora(model):
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def test_a_lora_model_takes_the_step_with_its_adapters_gradients(tmp_path):
    reference_model, model = lora(build("llama").double()), lora(build("llama").double())
    for each in (model, reference_model):  # adapters that are not zero, so that every gradient shows
        torch.manual_seed(2)
        for name, parameter in each.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_()
    call = batches()["packed documents"]
    arguments = dict(call)
    want = reference(reference_model, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    handle = applied(model, tmp_path)
    assert handle.chunk_recurrent == "on"
    output, grads = applied_step(model, call)
    assert handle.chunk_recurrent_calls == 1 and all("lora_" in name for name in grads)
    assert_equal_to_rounding((want[0].float(), want[1]), (output.loss.detach(), grads))


OFF = {
    "the option": (lambda: build("llama"), dict(chunk_recurrent=False), "off: chunk_recurrent=False"),
    "lora dropout": (
        lambda: peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1)),
        {},
        "off: .*lora_dropout.* drops out in training mode",
    ),
    "a forward on the instance": (
        lambda: forward_on_the_instance(build("llama")),
        {},
        "off: LlamaForCausalLM's forward was replaced before apply",
    ),
}


def forward_on_the_instance(model):
    """A forward put on the instance, as accelerate's hooks and TRL's trainers do: the step would bypass it."""
    model.forward = functools.partial(type(model).forward, model)
    return model


@pytest.mark.parametrize("case", list(OFF))
def test_models_the_step_does_not_take_say_why(case, tmp_path):
    make, options, reason = OFF[case]
    model = make()
    handle = applied(model, tmp_path, **options)
    assert re.match(reason, handle.chunk_recurrent), handle.chunk_recurrent
    model(**batches()["one row"], use_cache=False).loss.backward()
    assert handle.chunk_recurrent_calls == 0


def test_a_bad_option_is_refused_by_name():
    with pytest.raises(TypeError, match="chunk_recurrent must be True or False"):
        torch_offload.apply(build("llama"), chunk_recurrent="yes")


def test_a_spill_directory_removed_after_apply_is_named_and_nothing_is_left(tmp_path):
    directory = tmp_path / "spill"
    directory.mkdir()
    model = build("llama")
    handle = applied(model, directory)
    directory.rmdir()
    with pytest.raises(RuntimeError, match=f"disk_spill: directory '{directory}' cannot be used: No such file"):
        model(**batches()["two rows"], use_cache=False)
    directory.mkdir()  # back: the next call runs
    model(**batches()["two rows"], use_cache=False).loss.backward()
    assert handle.chunk_recurrent_calls == 1 and os.listdir(directory) == []


def test_a_full_spill_directory_is_the_tiers_error_and_its_space_comes_back(small_fs):  # noqa: F811 (the fixture)
    """The step's chunks in a 64 MiB file system nearly full: the tier's error, and once the step is gone, its
    space back and its spill file closed."""
    model = make_model("llama", max_position_embeddings=4096)
    handle = applied(model, small_fs)
    filler = os.path.join(small_fs, "filler")
    with open(filler, "wb") as file:  # 2 MiB left, where the step's 3000 tokens write about 4
        os.posix_fallocate(file.fileno(), 0, free_bytes(small_fs) - (2 << 20))
    empty = free_bytes(small_fs)
    ids = torch.randint(3, 128, (1, 3000), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="No space left on device"):
        model(input_ids=ids, labels=ids, use_cache=False)
    assert handle.chunk_recurrent_calls == 0
    gc.collect()
    wait_for_io()
    assert free_bytes(small_fs) >= empty - (256 << 10) and spill_files_in(small_fs) == []
