"""``apply(model, loss=True)``: a causal LM's head and loss through the ``linear_cross_entropy`` op.

When the model is called with ``labels``, its own forward runs with ``labels=None`` while
its output layer (``model.get_output_embeddings()``), patched for that call, computes the
loss from its input, the final hidden states, with the op and returns empty logits: the
``[tokens, vocab]`` logits never exist. The loss follows transformers' ``ForCausalLMLoss``:
labels shifted by one (or ``shift_labels``), ``ignore_index``, ``num_items_in_batch``
under gradient accumulation; the logits' own transforms (Gemma 2's final soft-capping,
Cohere's ``logit_scale``, Granite's ``logits_scaling``) are folded into the op. A probe at
apply time compares the fused loss with the model's own on a short random batch; a model
it does not match keeps its own loss.

The fused loss computes no logits for the output layer's hooks to see, nor their gradient:
an output layer with hooks (its own or global module hooks) at apply time keeps the model's
own loss, and a call made while it has hooks gained since apply runs the model's own head
and loss (refused under sequence parallelism, where the model's own loss is each rank's).

The op computes the gradients in forward (3 GEMMs instead of 4) only when the owner module is
in training mode, where a backward follows; a call with gradients enabled in eval mode (a
validation loop without ``torch.no_grad()``) takes the op's recompute path, whose forward is
one GEMM, and a backward of its loss recomputes the logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from . import sequence_parallel
from .linear_cross_entropy import linear_cross_entropy
from .tiled_mlp import _first_argument

__all__ = ["fuse_causal_lm_loss"]

_requests = threading.local()  # the loss request of the forward running on this thread
_NO_HEAD = "no output layer: found no module whose forward takes labels and calls get_output_embeddings()"
_PROBE_RTOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # 1e-5 in float32/float64


@dataclass
class _LossRequest:
    labels: torch.Tensor
    shift_labels: torch.Tensor | None
    ignore_index: int
    num_items_in_batch: Any
    sequence_parallel: str | None = None  # the group's name: the loss is the whole batch's over its ranks
    # None: the op's choice, gradients in forward for a mean or sum (training: a backward follows);
    # False: its recompute path, whose forward does no gradient GEMMs (eval mode, probably no backward).
    gradients_in_forward: bool | None = None
    loss: torch.Tensor | None = None


@dataclass(frozen=True)
class _HeadMath:
    """What the model does to ``head(hidden)`` before its loss: ``softcap(scale * logits)``."""

    scale: float
    softcap: float | None


def _hooks_of(head: nn.Module) -> str | None:
    """The hooks a call of ``head`` runs, its own and every module's (the global ones), named; None if none."""
    kinds = [
        kind
        for kind, hooks in (
            ("forward-pre", head._forward_pre_hooks),
            ("forward", head._forward_hooks),
            ("backward-pre", head._backward_pre_hooks),
            ("backward", head._backward_hooks),  # register_full_backward_hook's and register_backward_hook's
            ("global forward-pre", _module._global_forward_pre_hooks),
            ("global forward", _module._global_forward_hooks),
            ("global backward-pre", _module._global_backward_pre_hooks),
            ("global backward", _module._global_backward_hooks),
        )
        if hooks
    ]
    return f"{', '.join(kinds)} hooks" if kinds else None


def _owner_of_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | str:
    """The module whose forward takes ``labels`` and calls the output layer, and that layer; or why there is none."""
    for module in model.modules():
        get_head = getattr(module, "get_output_embeddings", None)
        if not callable(get_head) or "labels" not in inspect.signature(module.forward).parameters:
            continue
        try:
            head = get_head()
        except (NotImplementedError, AttributeError):  # transformers' base classes may raise for a model without one
            continue
        if head is None or not any(child is head for child in module.children()):
            continue
        if type(head) is not nn.Linear:
            return f"its output layer is a {type(head).__name__}, not a plain nn.Linear (LoRA'd or quantized head?)"
        hooks = _hooks_of(head)
        if hooks is not None:
            return f"its output layer runs {hooks}, which would see no logits, nor their gradient, under the fused loss"
        if "forward" in vars(head):
            return "its output layer has a forward of its own (accelerate's hooks?), which the fused loss would bypass"
        return module, head
    return _NO_HEAD


def _head_math(owner: nn.Module, head: nn.Linear) -> _HeadMath | str:
    config = getattr(owner, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    text_config = get_text_config() if callable(get_text_config) else config
    scale = 1.0
    if isinstance(getattr(owner, "logit_scale", None), (int, float)):  # Cohere: logits * logit_scale
        scale *= owner.logit_scale
    if isinstance(getattr(text_config, "logits_scaling", None), (int, float)):  # Granite: logits / logits_scaling
        scale /= text_config.logits_scaling
    if scale != 1.0 and head.bias is not None:
        return "its logits are scaled and its output layer has a bias"
    return _HeadMath(scale, getattr(text_config, "final_logit_softcapping", None) or None)


def _fused_loss(request: _LossRequest, hidden: torch.Tensor, head: nn.Linear, math: _HeadMath) -> torch.Tensor:
    target = request.shift_labels
    if target is None:  # tokens < n predict token n, as transformers' ForCausalLMLoss
        target = F.pad(request.labels, (0, 1), value=request.ignore_index)[..., 1:]
    target = target.to(hidden.device)
    if math.scale != 1.0:
        hidden = hidden * math.scale
    group = request.sequence_parallel
    count = request.num_items_in_batch
    if count is None and group is not None:  # the mean over the whole batch's labelled tokens, not this rank's
        count = sequence_parallel.group_sum((target != request.ignore_index).sum(), group)
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        target,
        bias=head.bias,
        ignore_index=request.ignore_index,
        reduction="mean" if count is None else "sum",
        softcap=math.softcap,
        gradients_in_forward=request.gradients_in_forward,
    )
    # At least float32 until the end, where it is float32 as transformers' loss is for any head: a float64
    # model's division by the count and sum over the ranks stay float64, and so do its gradients.
    loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
    if count is not None:
        loss = loss / (count.to(loss.device) if isinstance(count, torch.Tensor) else count)
    return (loss if group is None else sequence_parallel.global_loss(loss, group)).float()


def _kwargs_name(signature: inspect.Signature) -> str | None:
    return next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def _patched_forwards(owner: nn.Module, head: nn.Linear, math: _HeadMath, group: str | None = None):
    """The owner's forward (routes a call with labels and gradients to the op), that routing alone
    (for the probe, which runs without gradients), and the head's forward (serves a routed call).
    With ``group`` (sequence parallelism), every call with labels is routed, gradients or not, and
    its loss is the whole batch's over the group's ranks."""
    original = owner.forward
    head_original = head.forward
    signature = inspect.signature(original)
    extra_name = _kwargs_name(signature)

    @functools.wraps(head_original)
    def head_forward(*args, **kwargs):
        request = getattr(_requests, "request", None)
        if request is None or request.loss is not None:
            return head_original(*args, **kwargs)
        hidden, _, _ = _first_argument("input", args, kwargs)  # nn.Linear.forward's one argument
        request.loss = _fused_loss(request, hidden, head, math)
        return hidden.new_empty((*hidden.shape[:-1], 0))  # what the model's logit transforms run on

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled() and group is None:
            # Evaluation: no backward to save memory for, and Trainer's compute_metrics needs the logits.
            return original(*args, **kwargs)
        return fused_forward(*args, **kwargs)

    def fused_forward(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # let the model's forward say what is wrong
        arguments = bound.arguments
        extra = dict(arguments.get(extra_name, {})) if extra_name else {}
        if group is not None:
            _check_sequence_parallel_call(arguments, extra)
        keep = arguments.get("logits_to_keep", 0)
        adds_router_loss = _adds_router_loss(owner, signature, arguments)
        if adds_router_loss and group is not None:
            raise ValueError(
                f"torch_offload sequence parallelism: {type(owner).__name__} was asked for its router loss "
                "(output_router_logits), which would be each rank's, not the whole batch's; pass "
                "output_router_logits=False"
            )
        if (
            arguments.get("labels") is None
            or not (isinstance(keep, int) and keep == 0)
            or (adds_router_loss and not isinstance(_router_loss_coefficient(owner), (int, float)))
            or owner.get_output_embeddings() is not head
            or extra.get("fused_lm_head")
        ):
            # No loss asked for, or logits asked for; a router loss whose coefficient apply cannot find; an
            # output layer replaced since apply (resize_token_embeddings); TRL's own fused LM head, patched in
            # before apply (its SFTTrainer, then TorchOffloadCallback), which computes the loss itself: the
            # model's own path.
            return original(*args, **kwargs)
        # Hooks put on the output layer since apply (a user's, FSDP2's) would see no logits, nor a
        # gradient of them: the model's own head and loss, logits and all.
        hooked = _hooks_of(head)
        if hooked is not None:
            if group is not None:
                raise ValueError(
                    f"torch_offload sequence parallelism: {type(owner).__name__}'s output layer runs {hooked}, "
                    "gained since apply, which the fused loss would bypass, and the model's own loss is each "
                    "rank's mean, not the whole batch's; remove them"
                )
            return original(*args, **kwargs)
        request = _LossRequest(
            arguments["labels"],
            extra.get("shift_labels"),
            extra.get("ignore_index", -100),
            extra.get("num_items_in_batch"),
            group,
            None if owner.training else False,  # eval mode: a backward is unlikely, spare forward the gradients
        )
        arguments["labels"] = None
        as_tuple = extra.pop("return_dict", None) is False
        if extra_name:
            arguments[extra_name] = dict(extra, return_dict=True)
        previous = getattr(_requests, "request", None)
        _requests.request = request
        try:
            output = original(*bound.args, **bound.kwargs)
        finally:
            _requests.request = previous
        if request.loss is None:
            raise RuntimeError(
                f"torch_offload: {type(owner).__name__}'s forward did not call its output layer; "
                "apply(..., loss=False) keeps the model's own loss"
            )
        loss = request.loss
        aux_loss = output.get("aux_loss") if adds_router_loss else None
        if aux_loss is not None:  # the model adds its router loss to a loss of its own only; to the op's, as it would
            loss = loss + _router_loss_coefficient(owner) * aux_loss.to(loss.device)
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        output = type(output)(loss=loss, logits=None, **fields)
        if as_tuple:  # the logits' place kept (as None), so that out[1:] mean what they mean without apply
            return tuple(
                output[f.name] if f.name != "logits" else None
                for f in dataclasses.fields(output)
                if f.name == "logits" or output.get(f.name) is not None
            )
        return output

    return forward, fused_forward, head_forward


def _adds_router_loss(owner: nn.Module, signature: inspect.Signature, arguments: dict) -> bool:
    """Whether a call makes a mixture-of-experts model add its router loss to its loss: its forward takes
    output_router_logits, and the call's (else its config's, the text model's in a VLM) is true."""
    if "output_router_logits" not in signature.parameters:
        return False
    asked = arguments.get("output_router_logits")
    return bool(getattr(_text_config(owner), "output_router_logits", False) if asked is None else asked)


def _router_loss_coefficient(owner: nn.Module):
    """What the model multiplies its router loss by: its own attribute, else its (text) config's."""
    coefficient = getattr(owner, "router_aux_loss_coef", None)
    return coefficient if coefficient is not None else getattr(_text_config(owner), "router_aux_loss_coef", None)


def _text_config(owner: nn.Module):
    config = getattr(owner, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _check_sequence_parallel_call(arguments: dict, extra: dict) -> None:
    """A sequence-parallel call must carry what shard_batch adds: the whole rows' positions (this rank's
    part), and with labels, the labels shifted over the whole rows (a chunk's last token labelled with
    the next rank's first)."""
    if arguments.get("position_ids") is None:
        raise ValueError(
            "torch_offload sequence parallelism: the model was called without position_ids; pass "
            "torch_offload.shard_batch(batch, group)'s (the whole rows' positions, for the rotary "
            "embedding and the documents)"
        )
    if arguments.get("labels") is not None and extra.get("shift_labels") is None:
        raise ValueError(
            "torch_offload sequence parallelism: the model was called with labels but no shift_labels; "
            "pass torch_offload.shard_batch(batch, group)'s (labels shifted across the ranks' chunks)"
        )


@contextlib.contextmanager
def _eval_without_grad(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def _probe_batches(forward, vocab: int, device: torch.device) -> list[dict[str, Any]]:
    """The calls the loss probe compares the fused loss on, with the model's own.

    Random ids with some labels ignored; where the forward takes them, the same with a left- and
    a right-padded row whose labels are not ignored at the pads (a model whose own loss drops
    the masked positions, as Qwen2-Audio's, must keep it), and with ``num_items_in_batch``.
    """
    parameters = inspect.signature(forward).parameters
    takes_any = _kwargs_name(inspect.signature(forward)) is not None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=generator).to(device)
    labels = ids.clone()
    labels[0, :3] = -100
    calls = [dict(input_ids=ids, labels=labels, use_cache=False)]
    if "attention_mask" in parameters:
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding
        mask[1, -3:] = 0  # right padding
        calls.append(dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, use_cache=False))
    if "num_items_in_batch" in parameters or takes_any:
        calls.append(dict(calls[0], num_items_in_batch=torch.tensor(5, device=device)))
    if "output_router_logits" in parameters:  # the router loss added, whatever the config says
        calls.append(dict(calls[-1], output_router_logits=True))
    return calls


def _probe_problem(owner: nn.Module, head: nn.Linear, original, fused) -> str | None:
    """None when the fused loss equals the model's own on each of the probe's batches; else why not."""
    if head.weight.is_meta:
        return "its output layer's weight is on the meta device, so apply cannot probe it"
    rtol = _PROBE_RTOL.get(head.weight.dtype, 1e-5)
    calls = _probe_batches(original, head.weight.shape[0], head.weight.device)
    for call in calls:
        try:
            with _eval_without_grad(owner):
                want_output = original(**call)
                got_output = fused(**call)
            want, got = want_output.loss, got_output.loss
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as error:
            return f"its forward cannot be probed ({type(error).__name__}: {error})"
        given = ", ".join(sorted(set(call) - {"input_ids", "labels", "use_cache"})) or "no mask"
        # A forward patched to return more with labels (TRL 1.9's SFTTrainer: its chunked loss's token counts,
        # which its compute_loss reads) would lose it: the fused path calls that forward without labels.
        dropped = sorted(set(want_output.keys()) - set(got_output.keys()) - {"logits"})
        if dropped:
            return f"its forward returns {', '.join(dropped)} with labels, which the fused loss's output would lack"
        if call is calls[0] and not torch.isfinite(want):
            return f"the model's own loss is {want.item()} on a probe batch with {given}: nothing to compare with"
        # A NaN in both is the same result: eager attention softmaxes in float32, where a float64 model's mask
        # value is -inf, so a left pad's query, whose every key is masked, is NaN there, and so is the loss.
        if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=rtol, equal_nan=True):
            return (
                f"the fused loss ({got.item():.6g}) differs from the model's own ({want.item():.6g}) on a batch "
                f"with {given}"
            )
    return None


def fuse_causal_lm_loss(handle, model: nn.Module, sequence_parallel_group: str | None = None) -> str:
    """Patch ``model`` (through ``handle``) so that a call with labels computes its loss with the op
    (the whole batch's over the ranks of the group named ``sequence_parallel_group``, if given).

    Returns "linear_cross_entropy"; "unfused: <why>" when the model keeps its own loss; or,
    for a model that is not a causal LM, "no output layer: ...".
    """
    found = _owner_of_head(model)
    if found is _NO_HEAD:
        return found
    if isinstance(found, str):
        return f"unfused: {found}"
    owner, head = found
    math = _head_math(owner, head)
    if isinstance(math, str):
        return f"unfused: {math}"
    original = owner.forward
    forward, fused_forward, head_forward = _patched_forwards(owner, head, math)
    owner_name = next(name for name, module in model.named_modules() if module is owner) or "model"
    head_name = next(name for name, module in owner.named_children() if module is head)
    handle._patch(f"{owner_name}.{head_name}.forward", head, "forward", head_forward)  # serves no request unasked
    problem = _probe_problem(owner, head, original, fused_forward)
    if problem is not None:
        handle._undo_last_patch()
        return f"unfused: {problem}"
    if sequence_parallel_group is not None:  # probed on one process's batches above, installed for the group's
        forward = _patched_forwards(owner, head, math, sequence_parallel_group)[0]
    handle._patch(f"{owner_name}.forward", owner, "forward", forward)
    return "linear_cross_entropy"
