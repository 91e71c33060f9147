"""apply()'s fused loss (torch_offload/causal_lm_loss.py): the output layer's hooks, the loss probe on float64
eager models, and the op's path for calls that are not training steps."""

import copy
import dataclasses
import inspect
import types

import pytest
import torch
import torch.distributed as dist
from op_recording import CountCalls
from test_apply import assert_close_runs, batch, loss_and_grads, make_model
from transformers.modeling_outputs import CausalLMOutputWithPast

import torch_offload

HIDDEN, LOGITS = (2, 24, 32), (2, 24, 128)  # test_apply's batch through its models
global_hooks = torch.nn.modules.module
# Each kind of hook a call of the output layer runs: how handle.loss names it, its registration by
# (head, record), and what record sees: the hidden states for a forward-pre hook, else the logits (backward:
# their gradient).
HOOKS = {
    "forward-pre": ("forward-pre", lambda h, rec: h.register_forward_pre_hook(lambda m, a: rec(m, a)), HIDDEN),
    "forward": ("forward", lambda h, rec: h.register_forward_hook(lambda m, a, out: rec(m, out)), LOGITS),
    "backward-pre": (
        "backward-pre",
        lambda h, rec: h.register_full_backward_pre_hook(lambda m, grad_out: rec(m, grad_out)),
        LOGITS,
    ),
    "full-backward": (
        "backward",
        lambda h, rec: h.register_full_backward_hook(lambda m, grad_in, grad_out: rec(m, grad_out)),
        LOGITS,
    ),
    "backward": (  # deprecated, but still run by nn.Module
        "backward",
        lambda h, rec: h.register_backward_hook(lambda m, grad_in, grad_out: rec(m, grad_out)),
        LOGITS,
    ),
    "global-forward-pre": (
        "global forward-pre",
        lambda h, rec: global_hooks.register_module_forward_pre_hook(lambda m, a: rec(m, a)),
        HIDDEN,
    ),
    "global-forward": (
        "global forward",
        lambda h, rec: global_hooks.register_module_forward_hook(lambda m, a, out: rec(m, out)),
        LOGITS,
    ),
    "global-backward-pre": (
        "global backward-pre",
        lambda h, rec: global_hooks.register_module_full_backward_pre_hook(lambda m, grad_out: rec(m, grad_out)),
        LOGITS,
    ),
    "global-full-backward": (
        "global backward",
        lambda h, rec: global_hooks.register_module_full_backward_hook(lambda m, grad_in, grad_out: rec(m, grad_out)),
        LOGITS,
    ),
}


# torch's own about the hooks: register_backward_hook's deprecation, global backward hooks on every module
@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")
@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("kind", list(HOOKS))
@pytest.mark.parametrize("when", ["before apply", "after apply"])
def test_hooks_on_the_output_layer_see_its_logits_and_the_loss_is_the_models(kind, when):
    model, ids = make_model("llama").double(), batch()
    want = loss_and_grads(copy.deepcopy(model), ids)
    named, register, shape = HOOKS[kind]
    seen = []

    def record(module, value):  # a hook's tensor, or the first of its tuple (args, grad_output)
        if module is model.lm_head:
            seen.append(tuple((value[0] if isinstance(value, tuple) else value).shape))

    hook = register(model.lm_head, record) if when == "before apply" else None
    try:
        if hook is None:
            handle = torch_offload.apply(model, offload=None)
            assert handle.loss == "linear_cross_entropy"
            hook = register(model.lm_head, record)
        else:
            with pytest.warns(UserWarning, match="the loss stays the model's own"):
                handle = torch_offload.apply(model, offload=None)
            assert handle.loss.startswith(f"unfused: its output layer runs {named} hooks, "), handle.loss
        seen.clear()  # apply's probes called the output layer
        outputs = []
        got = loss_and_grads(model, ids, run=lambda **kw: outputs.append(model(**kw)) or outputs[-1])
        assert seen == [shape] and outputs[0].logits.shape == LOGITS
        assert_close_runs(want, got)
        handle.remove()
    finally:
        hook.remove()  # a global hook would run in every later test


def test_a_hook_put_on_the_output_layer_after_a_sequence_parallel_apply_is_refused_by_name():
    # Its own loss would be this rank's mean; hooks on at apply time keep the model's own loss,
    # which sequence parallelism refuses at apply.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, ids = make_model("llama").double(), batch()
        handle = torch_offload.apply(model, offload=None, sequence_parallel=dist.group.WORLD)
        sharded = torch_offload.shard_batch(dict(input_ids=ids, labels=ids))
        assert model(**sharded, use_cache=False).logits is None  # the fused loss
        model.lm_head.register_full_backward_hook(lambda *_: None)
        with pytest.raises(
            ValueError, match="output layer runs backward hooks, gained since apply, which the fused loss would"
        ):
            model(**sharded, use_cache=False)
        handle.remove()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name, overrides", [("llama", dict(attn_implementation="eager")), ("gemma2", {})])
def test_a_float64_eager_model_keeps_the_fused_loss(name, overrides):
    # Eager attention softmaxes in float32, where float64's mask value is -inf: a query with every key
    # masked (a left pad) is NaN, and so were both losses on the probe's padded batch.
    model, ids = make_model(name, **overrides).double(), batch()
    assert model.config._attn_implementation == "eager"
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload=None)
    assert handle.loss == "linear_cross_entropy"
    assert_close_runs(want, loss_and_grads(model, ids))
    handle.remove()


def test_a_model_whose_own_loss_is_nan_keeps_it_and_says_so():
    model = make_model("llama")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.warns(UserWarning, match="the loss stays the model's own"):
        handle = torch_offload.apply(model, offload=None)
    assert handle.loss == "unfused: the model's own loss is nan on a probe batch with no mask: nothing to compare with"
    handle.remove()


def test_the_gradients_are_computed_in_forward_only_in_training_mode():
    # eval mode with gradients enabled (a validation loop without torch.no_grad()): probably no backward,
    # so the recompute path, whose forward computes no gradient; a backward of it still gives exact ones.
    paths = ("with_gradients", "forward", "backward")
    ops = [getattr(torch.ops.offload, f"linear_cross_entropy_{path}").default for path in paths]
    model, ids = make_model("llama").double(), batch()
    want = {training: loss_and_grads(model.train(training), ids) for training in (True, False)}
    handle = torch_offload.apply(model, offload=None)
    assert handle.loss == "linear_cross_entropy"
    for training, calls in ((True, [1, 0, 0]), (False, [0, 1, 1])):
        model.train(training)
        with CountCalls(*ops) as mode:
            got = loss_and_grads(model, ids)
        assert dict(zip(paths, mode.counts.values())) == dict(zip(paths, calls))
        assert_close_runs(want[training], got)
    handle.remove()


@dataclasses.dataclass
class CountedOutput(CausalLMOutputWithPast):
    """What a forward patched as TRL 1.9's SFTTrainer patches it returns with labels: its loss and more."""

    num_valid_tokens: torch.Tensor | None = None


def test_a_forward_that_returns_more_with_labels_keeps_the_models_loss():
    # The fused path calls the model's forward without labels: it would return no num_valid_tokens.
    model, ids = make_model("llama"), batch()
    own = model.forward

    def counting_forward(self, input_ids=None, labels=None, **kwargs):
        output = own(input_ids=input_ids, labels=labels, **kwargs)
        return output if labels is None else CountedOutput(**output, num_valid_tokens=(labels != -100).sum())

    model.forward = types.MethodType(counting_forward, model)
    want = loss_and_grads(model, ids)
    with pytest.warns(UserWarning, match="the loss stays the model's own"):
        handle = torch_offload.apply(model, offload=None)
    assert (
        handle.loss
        == "unfused: its forward returns num_valid_tokens with labels, which the fused loss's output would lack"
    )
    assert model(input_ids=ids, labels=ids, use_cache=False).num_valid_tokens == ids.numel()
    assert_close_runs(want, loss_and_grads(model, ids))
    handle.remove()


def test_a_forward_patched_through_its_function_after_apply_keeps_the_fused_loss():
    # TRL 1.9's SFTTrainer patches model.forward.__func__ with the same signature: apply's forward is a method.
    model, ids = make_model("llama").double(), batch()
    want, signature = loss_and_grads(model, ids), inspect.signature(model.forward)
    handle = torch_offload.apply(model, offload=None)
    applied = model.forward
    assert inspect.signature(applied) == signature

    def patched(self, input_ids=None, labels=None, **kwargs):
        return applied(input_ids=input_ids, labels=labels, **kwargs)

    patched.__signature__ = inspect.signature(applied.__func__)
    model.forward = types.MethodType(patched, model)
    assert inspect.signature(model.forward) == signature
    with CountCalls(torch.ops.offload.linear_cross_entropy_with_gradients.default) as mode:
        got = loss_and_grads(model, ids)
    assert list(mode.counts.values()) == [1]
    assert_close_runs(want, got)
    model.forward = applied
    handle.remove()
    assert "forward" not in vars(model)
