"""apply()'s RMSNorms through the rms_norm op (torch_offload/integrations/norms.py): which norms it takes, the
model's loss and gradients with them, and the norms it leaves to their own forward."""

import pytest
import torch
from op_recording import CountCalls
from test_apply import assert_close_runs, batch, loss_and_grads, make_model

import torch_offload

RMS_NORM = torch.ops.offload.rms_norm.default


def norm_names(model):
    layers = [
        f"model.layers.{i}.{child}" for i in range(3) for child in ("input_layernorm", "post_attention_layernorm")
    ]
    return [*layers, "model.norm"]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_every_norm_runs_through_the_op_with_the_models_loss_and_gradients(name):
    model, ids = make_model(name), batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload=None)
    assert handle.norms == dict.fromkeys(norm_names(model), "rms_norm")
    assert handle.report()["norms"] == "7 of 7 through rms_norm"
    with CountCalls(RMS_NORM) as mode:
        got = loss_and_grads(model, ids)
    assert mode.counts[RMS_NORM] == 7 + 6  # each once, and the layers' again in their checkpoints' recompute
    assert_close_runs(want, got)
    handle.remove()
    assert not any("forward" in vars(model.get_submodule(n)) for n in norm_names(model))


@pytest.mark.parametrize(
    "name, dtype, why",
    [
        ("gemma", torch.float32, "its output differs from rms_norm's (eps=1e-06) on a probe input"),  # 1 + weight
        ("llama", torch.float64, "its output differs from rms_norm's (eps=1e-06) on a probe input"),  # in float32
    ],
)
def test_norms_the_op_does_not_compute_keep_their_own_forward(name, dtype, why):
    model, ids = make_model(name).to(dtype), batch()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload=None)
    assert handle.norms == dict.fromkeys(norm_names(model), f"module: {why}")
    assert handle.report()["norms"] == f"0 of 7 through rms_norm (model.layers.0.input_layernorm: {why})"
    with CountCalls(RMS_NORM) as mode:
        assert_close_runs(want, loss_and_grads(model, ids))
    assert mode.counts[RMS_NORM] == 0
    handle.remove()


def test_a_norm_with_a_hook_keeps_its_forward_and_rms_norm_false_keeps_all():
    model = make_model("llama")
    seen = []
    model.model.norm.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    handle = torch_offload.apply(model, offload=None)
    assert handle.norms["model.norm"] == "module: it has a forward of its own or hooks, which the op would bypass"
    assert handle.report()["norms"].startswith("6 of 7 through rms_norm (model.norm: it has a forward")
    seen.clear()  # the loss probe's calls
    loss_and_grads(model, batch())
    assert seen == [(2, 24, 32)]
    handle.remove()
    handle = torch_offload.apply(model, offload=None, rms_norm=False)
    assert handle.norms == {} and handle.report()["norms"] == "the model's own (rms_norm=False)"
    handle.remove()


def test_a_call_in_another_dtype_than_the_weight_runs_the_modules_forward():
    # Under autocast or in a mixed model, a bf16 input can meet float32 weights: the module's own arithmetic.
    model = make_model("llama")
    handle = torch_offload.apply(model, offload=None)
    norm = model.model.norm
    x = torch.randn(2, 5, 32).to(torch.bfloat16)
    with CountCalls(RMS_NORM) as mode:
        got = norm(x)
    assert mode.counts[RMS_NORM] == 0
    assert torch.equal(got, type(norm).forward(norm, x))
    handle.remove()


def test_bad_rms_norm_option_is_refused_by_name():
    with pytest.raises(TypeError, match="rms_norm"):
        torch_offload.apply(make_model("llama"), rms_norm="yes")
