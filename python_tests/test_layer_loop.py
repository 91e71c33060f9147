"""apply()'s own loop over the decoder layers (torch_offload/integrations/layer_loop.py): where it runs, that it
gives the decoder's own loop's loss and gradients bit for bit, that it drops the embeddings and each layer's input,
and the calls and models that keep the decoder's own forward."""

import functools
import inspect
import weakref
from unittest import mock

import pytest
import torch
import transformers
from test_apply import make_model, tier_options
from test_real_batches import BATCHES, build, step

import torch_offload
from torch_offload.integrations import layer_loop

# The tested families whose decoders get apply's loop (docs/apply.md, "The loop over the layers").
LOOPED = ["llama", "qwen2", "qwen3", "gemma", "smollm3", "mixtral", "qwen3_moe", "deepseek_v3"]
# The cache's argument and output field: ``cache`` from transformers 5.24, ``past_key_values`` before (axolotl's 5.16,
# whose venv runs these tests too).
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"


def applied(name, tmp_path, **overrides):
    model = make_model(name, **overrides) if overrides else build(name)
    model.config.output_router_logits = False  # the tests' mixtures record them; released configs ask per call
    # The chunk-recurrent step, which would take these tests' training calls with labels, off: the loop runs for
    # the calls it does not take (test_chunk_recurrent_route.py).
    return model, torch_offload.apply(model, **tier_options("disk", tmp_path), chunk_recurrent=False)


def counting_layers():
    """A context in which ``.call_count`` says how many layers apply's loop ran."""
    return mock.patch.object(layer_loop, "_run_layer", wraps=layer_loop._run_layer)


def seeded_step(model, batch):
    torch.manual_seed(1)  # dropout, where a model has some, drawn alike in both loops
    with counting_layers() as run_layer:
        loss, grads = step(model, batch)
    return loss, grads, run_layer.call_count


# Every family on a packed and a left-padded batch; Llama on labelled padding and num_items_in_batch too.
CASES = [("llama", "right_padded_labelled"), ("llama", "packed_num_items")] + [
    (name, batch)
    for name in (*LOOPED, "llama_attention_dropout", "mistral_without_window")
    for batch in ("packed", "left_padded")
]


@pytest.mark.parametrize("name, batch", CASES)
def test_the_loop_gives_the_decoders_own_loss_and_gradients_bit_for_bit(name, batch, tmp_path):
    if name == "llama_attention_dropout":
        model, handle = applied("llama", tmp_path, attention_dropout=0.25)
    elif name == "mistral_without_window":
        model, handle = applied("mistral", tmp_path, sliding_window=None)
    else:
        model, handle = applied(name, tmp_path)
    assert handle.layer_loop == "apply's" and "layer loop: apply's" in str(handle)
    inputs = BATCHES[batch]()
    loss, grads, layers_run = seeded_step(model, inputs)
    assert layers_run == len(handle.layers)
    # A hook on a layer sends the call to the decoder's own forward (a hook would not run in apply's loop).
    with model.model.layers[0].register_forward_hook(lambda *args: None):
        own_loss, own_grads, layers_run = seeded_step(model, inputs)
    assert layers_run == 0
    assert torch.equal(loss, own_loss) and grads.keys() == own_grads.keys()
    assert [n for n in grads if not torch.equal(grads[n], own_grads[n])] == []
    handle.remove()
    assert "forward" not in vars(model.model)


def test_the_embeddings_and_each_layers_input_are_dropped_once_read(tmp_path):
    model, handle = applied("llama", tmp_path, num_hidden_layers=4)
    inputs = BATCHES["packed"]()
    held, alive = {}, {}
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: held.update(embeddings=weakref.ref(out)))
    # Layer 1's input (layer 0's output), caught as the argument of layer 1's first norm.
    model.model.layers[1].input_layernorm.register_forward_pre_hook(
        lambda m, a: held.update(layer_1_input=weakref.ref(a[0]))
    )
    model.model.layers[1].post_attention_layernorm.register_forward_pre_hook(
        lambda m, a: alive.update({what: ref() is not None for what, ref in held.items()})
    )
    step(model, inputs)
    assert alive == {"embeddings": False, "layer_1_input": False}
    # The decoder's own loop (a hook on a layer) keeps both through layer 1: the check above can fail.
    with model.model.layers[2].register_forward_hook(lambda *args: None):
        step(model, inputs)
    assert alive == {"embeddings": True, "layer_1_input": True}
    handle.remove()


def test_a_call_with_the_embeddings_given_takes_the_loop(tmp_path):
    model, handle = applied("llama", tmp_path)
    ids = BATCHES["packed"]()["input_ids"]
    embeddings = model.model.embed_tokens(ids).detach()
    with counting_layers() as run_layer:
        got = model.model(inputs_embeds=embeddings, use_cache=False).last_hidden_state
    assert run_layer.call_count == len(handle.layers)
    want = make_model("llama").model(inputs_embeds=embeddings, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    handle.remove()


def _on_both(change):
    """A change made to the applied model and to the reference alike."""
    return lambda model, reference: [change(model), change(reference)] and None


def _global_hook(model, reference):
    return torch.nn.modules.module.register_module_forward_hook(lambda *args: None).remove


def _replace_layer(model, reference):
    """Layer 1 behind a wrapper module, as FSDP1's auto-wrap or a checkpoint wrapper puts it."""
    layers, original = model.model.layers, model.model.layers[1]
    wrapper = torch.nn.Module()
    wrapper.forward = lambda hidden, **kwargs: original(hidden, **kwargs)
    layers[1] = wrapper
    return lambda: layers.__setitem__(1, original)


CALLS = {
    "hidden_states_recorded": (dict(output_hidden_states=True), None),
    "attentions_recorded": (dict(output_attentions=True), None),
    "cache_given": (dict(use_cache=True, **{CACHE: transformers.DynamicCache()}), None),
    "cache_with_a_layer_in_eval_mode": (dict(use_cache=True), _on_both(lambda model: model.model.layers[1].eval())),
    "tuple_output": (dict(return_dict=False), None),
    "flash_attention_arguments": (dict(cu_seq_lens_q=torch.tensor([0, 24], dtype=torch.int32)), None),
    "not_causal": ({}, _on_both(lambda model: setattr(model.config, "is_causal", False))),
    "sliding_window_set_since": ({}, _on_both(lambda model: setattr(model.config, "sliding_window", 4))),
    "global_hook": ({}, _global_hook),
    # activation_checkpointing_enable is 5.24's name for gradient_checkpointing_enable, which it deprecates.
    "hf_gradient_checkpointing": (
        {},
        _on_both(
            lambda model: getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        ),
    ),
    "layer_replaced": ({}, _replace_layer),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_calls_it_does_not_take_run_the_decoders_own_forward(case, tmp_path):
    call, change = CALLS[case]
    model, handle = applied("llama", tmp_path)
    reference = make_model("llama")
    undo = change(model, reference) if change is not None else None
    arguments = {"input_ids": BATCHES["packed"]()["input_ids"], "use_cache": False, **call}
    try:
        with counting_layers() as run_layer:
            got, want = model.model(**arguments), reference.model(**arguments)
    finally:
        if undo is not None:
            undo()
    assert run_layer.call_count == 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    if case == "hidden_states_recorded":
        assert len(got.hidden_states) == len(want.hidden_states) == len(handle.layers) + 1
        for a, b in zip(got.hidden_states, want.hidden_states):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    handle.remove()


def test_use_cache_given_by_position_gets_the_decoders_own_error(tmp_path):
    model, handle = applied("llama", tmp_path)
    ids = BATCHES["packed"]()["input_ids"]
    with counting_layers() as run_layer, pytest.raises(TypeError, match="multiple values for argument 'use_cache'"):
        model.model(ids, None, None, None, None, False)
    assert run_layer.call_count == 0
    handle.remove()


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_a_call_asking_for_a_cache_takes_the_loop_and_returns_the_decoders_empty_cache(name, tmp_path):
    """transformers' default (config.use_cache true, as a loaded model's config has it): the decoder makes a cache
    that apply's layers leave empty in training mode, and apply's loop returns one alike."""
    model, handle = applied(name, tmp_path)
    model.config.use_cache = True
    inputs = BATCHES["packed"]()

    def cached_step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with counting_layers() as run_layer, pytest.warns(UserWarning, match="returns an empty cache"):
            out = model(**inputs)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, grads, run_layer.call_count

    out, grads, layers_run = cached_step()
    assert layers_run == len(handle.layers)
    with model.model.layers[0].register_forward_hook(lambda *args: None):  # the decoder's own loop
        own_out, own_grads, layers_run = cached_step()
    assert layers_run == 0
    cache, own_cache = out[CACHE], own_out[CACHE]
    assert out.keys() == own_out.keys() and type(cache) is type(own_cache) is transformers.DynamicCache
    assert cache.get_seq_length() == own_cache.get_seq_length() == 0
    assert len(cache.layers) == len(own_cache.layers) == len(handle.layers)
    assert torch.equal(out.loss, own_out.loss) and grads.keys() == own_grads.keys()
    assert [n for n in grads if not torch.equal(grads[n], own_grads[n])] == []
    handle.remove()


def test_a_create_causal_mask_wrapped_without_its_signature_keeps_the_loop_and_the_caches_name(tmp_path):
    """Libraries wrap a family's create_causal_mask without functools.wraps (axolotl does for Gemma 4): the cache's
    name is the decoder forward's, so a call asking for a cache still takes the loop and returns the cache."""
    modeling = transformers.models.llama.modeling_llama
    create_causal_mask = modeling.create_causal_mask
    with mock.patch.object(modeling, "create_causal_mask", lambda **kwargs: create_causal_mask(**kwargs)):
        model, handle = applied("llama", tmp_path)
        model.config.use_cache = True
        with counting_layers() as run_layer, pytest.warns(UserWarning, match="returns an empty cache"):
            out = model(**BATCHES["packed"]())
        assert run_layer.call_count == len(handle.layers)
        assert type(out[CACHE]) is transformers.DynamicCache and out[CACHE].get_seq_length() == 0
        handle.remove()


def test_without_gradients_or_in_eval_mode_the_decoders_own_forward_runs(tmp_path):
    model, handle = applied("llama", tmp_path)
    ids = BATCHES["packed"]()["input_ids"]
    with counting_layers() as run_layer:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        model.eval()
        model(input_ids=ids, use_cache=False)
    assert run_layer.call_count == 0
    handle.remove()


def test_a_layer_forward_replaced_after_apply_is_the_one_that_runs(tmp_path):
    model, handle = applied("llama", tmp_path)
    layer = model.model.layers[1]
    wrapped = layer.forward
    calls = []
    layer.forward = lambda *args, **kwargs: calls.append(1) or wrapped(*args, **kwargs)
    step(model, BATCHES["packed"]())
    assert calls == [1]
    layer.forward = wrapped
    handle.remove()


class _ScaledResidualLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """A layer with Llama's children whose forward is not Llama's: the probe must see it."""

    def forward(self, hidden_states, **kwargs):
        return 0.5 * hidden_states + super().forward(hidden_states, **kwargs)


class _EmbeddingDropoutModel(transformers.models.llama.modeling_llama.LlamaModel):
    """Starcoder2's difference from Llama: dropout on the embeddings, in training mode only."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        embeddings = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        embeddings = torch.nn.functional.dropout(embeddings, p=0.5, training=self.training)
        return super().forward(inputs_embeds=embeddings, **kwargs)


# As if transformers defined it: the probe, not the check of a forward replaced before apply, must refuse it.
_EmbeddingDropoutModel.__module__ = _EmbeddingDropoutModel.forward.__module__ = (
    transformers.models.llama.modeling_llama.__name__
)


def _scaled_residual(model):
    for layer in model.model.layers:
        layer.__class__ = _ScaledResidualLayer


def _embedding_dropout(model):
    model.model.__class__ = _EmbeddingDropoutModel


def _wrapped_decoder_forward(model):
    forward = model.model.forward
    model.model.forward = functools.wraps(forward)(lambda *args, **kwargs: forward(*args, **kwargs))


def _parameter_of_its_own(model):
    model.model.register_parameter("scale", torch.nn.Parameter(torch.ones(())))


@pytest.mark.parametrize(
    "name, change, why",
    [
        ("llama", _scaled_residual, "apply's loop does not give the decoder's own output bit for bit (one row)"),
        ("llama", _embedding_dropout, "apply's loop does not give the decoder's own output bit for bit (one row)"),
        ("llama", _wrapped_decoder_forward, "LlamaModel's forward was replaced before apply"),
        ("llama", _parameter_of_its_own, "LlamaModel has a parameter or buffer of its own"),
        ("llama", lambda model: setattr(model.config, "residual_multiplier", 1.0), "config.residual_multiplier"),
        ("gpt2", None, "model type 'gpt2', whose decoder forward is not known to be Llama's"),
        ("granite", None, "model type 'granite'"),
        ("mistral", None, "a sliding window"),
    ],
    ids=[
        "scaled_residual",
        "embedding_dropout",
        "wrapped_decoder_forward",
        "parameter_of_its_own",
        "multiplier",
        "gpt2",
        "granite",
        "mistral_window",
    ],
)
def test_models_it_does_not_prove_keep_the_decoders_own_loop(name, change, why, tmp_path):
    model = build(name)
    if change is not None:
        change(model)
    handle = torch_offload.apply(model, **tier_options("disk", tmp_path), chunk_recurrent=False)
    assert handle.layer_loop.startswith(f"the model's own: {why}"), handle.layer_loop
    handle.remove()


@pytest.mark.parametrize(
    "options, why",
    [
        (dict(keep_last=1), "not every layer is offloaded with only its attention recomputed"),
        (dict(offload=None), "no layer is offloaded"),
    ],
)
def test_options_it_does_not_cover_keep_the_decoders_own_loop(options, why, tmp_path):
    tier = tier_options("disk", tmp_path) if options.get("offload", "disk") == "disk" else {}
    handle = torch_offload.apply(build("llama"), **tier, **options)
    assert handle.layer_loop == f"the model's own: {why}"
    handle.remove()
