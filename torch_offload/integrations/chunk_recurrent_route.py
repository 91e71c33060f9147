"""apply()'s route through the chunk-recurrent step: a training call with labels of a model in host memory runs
chunk_recurrent.py's step, whose memory does not grow with the sequence, where apply can prove it computes what the
model's own forward and loss compute.

Where (docs/apply.md, "The chunk-recurrent step"): the plan chose it (apply's options as their CPU defaults, no
sequence parallelism), the model is one the step takes (chunk_recurrent.step_problem), on the CPU, its output layer
one the fused loss takes, and a probe at apply time shows that in training mode the step's loss is the model's own
on one row, on padded rows, on packed documents and with ``num_items_in_batch``. Then apply installs the fused loss
and, above it, the step's forward, and nothing on the layers. Per call (``_batch_of_call``): gradients, training
mode, eager, ``input_ids`` and ``labels`` on the CPU, no logits, cache or recorded outputs asked for, no router loss,
no autocast, no hook on any module under the causal LM (one would see chunks), no layer checkpointed by transformers,
the output layer as the probe found it (the step computes the loss from its weight, never calling it), and an
``attention_mask`` whose real tokens are contiguous in each row. Any other call, and one whose attention asks for
what the step does not compute (``Unsupported``, found in its first chunk), runs the model's own forward with the
fused loss.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..causal_lm_loss import _PROBE_RTOL, _adds_router_loss, _hooks_of, _owner_of_head, fuse_causal_lm_loss
from ..disk import default_spill_directory, spill_directory_in_ram
from .checkpointing import warn_empty_cache_dropped
from .chunk_batch import batch_of, runs_of_real_tokens
from .chunk_model import packs_documents, reached_outside, trained_outside
from .chunk_recurrent import CHUNK_TOKENS, autocast_on, chunk_recurrent_step, step_problem
from .chunk_seam import Unsupported
from .layer_loop import _asks_for_cache, _cache_name, _recording_outside, _runs_hooks
from .options import _on_accelerator
from .probes import _PROBE_ERRORS

if TYPE_CHECKING:
    from .handle import OffloadHandle

_PROBE_CHUNK_TOKENS = 3  # the probe's 8-token rows in three chunks, its documents and rows across their bounds
# What a call may pass that the step reads or that changes nothing it computes.
_READ = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "use_cache", "logits_to_keep"})
_RECORDED = ("output_hidden_states", "output_attentions", "output_router_logits")


def step_route(model: nn.Module, options: dict[str, Any]) -> tuple[str | None, nn.Module | None, type | None]:
    """(None, the causal LM in ``model`` (itself, or the one a PEFT model wraps), the type of its output) where
    apply's training calls with labels can take the step (see the module's docstring), else (why not, None, None);
    probes the model, installs nothing. ``options`` are apply's offload options (the spill directory)."""
    if _on_accelerator(model):
        return "the model is on an accelerator (the step runs on the CPU only)", None, None
    found = _owner_of_head(model)
    if isinstance(found, str):
        return found.removeprefix("no output layer: "), None, None
    owner, head = found
    inside = {id(p) for p in owner.parameters()}
    outside = next((n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside), None)
    if outside is not None:
        return f"{outside} is trained and is outside the causal LM {type(owner).__name__}", None, None
    problem = step_problem(owner, unreached=None)  # the probe looks at the parameters outside
    if problem is None and "forward" in vars(owner):  # the step would bypass it (TRL's, accelerate's)
        problem = f"{type(owner).__name__}'s forward was replaced before apply"
    if problem is None:
        directory = _directory(options)
        problem = (
            f"the spill directory {directory!r} is on a RAM file system"
            if spill_directory_in_ram(directory) and not options.get("allow_tmpfs")
            else None
        )
    if problem is not None:
        return problem, None, None
    problem, output_type = _probe(model, owner, _directory(options))
    return problem, owner if problem is None else None, output_type


def install_step_route(
    handle: OffloadHandle, model: nn.Module, owner: nn.Module, output_type: type, options: dict[str, Any]
) -> str:
    """The fused loss, and above it, on ``owner`` (the causal LM), the forward that sends training calls with labels
    to the step (building ``output_type``, its output class); returns ``"on"``, or ``"off: <why>"`` where the fused
    loss cannot be installed (then nothing is)."""
    handle.loss = fuse_causal_lm_loss(handle, model)
    if handle.loss != "linear_cross_entropy":
        return f"off: the loss is not fused ({handle.loss})"
    directory = _directory(options)
    installed = owner.forward  # the fused loss's
    signature = inspect.signature(installed)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    head = owner.get_output_embeddings()
    head_forward = vars(head).get("forward")  # the fused loss's: one put on since, the step would not call
    modelling, cache_name = sys.modules[type(owner).__module__], _cache_name(owner)
    unreached = frozenset(trained_outside(owner))  # the probe found its loss on text reaches none of them

    @functools.wraps(installed)
    def forward(*args, **kwargs):
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and owner.training):
            return installed(*args, **kwargs)
        try:
            call = dict(signature.bind(*args, **kwargs).arguments)
        except TypeError:  # the model's own forward says what is wrong
            return installed(*args, **kwargs)
        extra = dict(call.pop(var_keyword, None) or {})
        batch = _batch_of_call(owner, head, head_forward, unreached, signature, call, extra)
        if batch is None:
            return installed(*args, **kwargs)
        try:
            loss = chunk_recurrent_step(owner, batch, CHUNK_TOKENS, directory)
        except Unsupported:  # found in its first chunk, before anything is kept: the model's own path computes it
            return installed(*args, **kwargs)
        handle.chunk_recurrent_calls += 1
        fields = {}
        if _asks_for_cache(owner, call.get("use_cache")):  # the empty cache the decoder would make, and leave empty
            fields[cache_name] = modelling.DynamicCache(config=owner.config)
            warn_empty_cache_dropped(stacklevel=2)
        # float32 as the fused loss (and transformers' for any head): a float64 model's gradients stay float64.
        return output_type(loss=loss.float(), logits=None, **fields)

    owner_name = next(name for name, module in model.named_modules() if module is owner) or "model"
    handle._patch(f"{owner_name}.forward", owner, "forward", forward)
    return "on"


def _directory(options: dict[str, Any]) -> str:
    directory = options.get("spill_directory")
    return os.fspath(directory) if directory is not None else default_spill_directory()


def _batch_of_call(model, head, head_forward, unreached, signature, call: dict, extra: dict):
    """The step's batch for a causal LM's call (its named arguments and the others), or None where the step would
    not compute what the model's own forward does (see the module's docstring); ``unreached``: the trained parameters
    outside its decoder and output layer the probe cleared."""
    labels, input_ids = call.get("labels"), call.get("input_ids")
    shift_labels, ignore_index = extra.pop("shift_labels", None), extra.pop("ignore_index", -100)
    mask, positions, keep = call.get("attention_mask"), call.get("position_ids"), call.get("logits_to_keep", 0)
    recorded = any(call.get(name, extra.get(name)) for name in _RECORDED)
    unread = {name for name, value in call.items() if value is not None and name not in _READ} | (
        set(extra) - {"num_items_in_batch", "return_dict"}
    )
    if not (
        not unread
        and not recorded
        and extra.get("return_dict", True) is not False
        and isinstance(input_ids, torch.Tensor)
        and input_ids.dim() == 2
        and input_ids.dtype == torch.int64
        and input_ids.device.type == "cpu"
        and all(
            isinstance(value, torch.Tensor) and value.shape == input_ids.shape and value.device.type == "cpu"
            for value in (labels, *(given for given in (shift_labels, mask) if given is not None))
        )
        and (positions is None or (isinstance(positions, torch.Tensor) and positions.shape[-1] == input_ids.shape[1]))
        and (positions is None or (positions.dim() == 2 and positions.shape[0] in (1, input_ids.shape[0])))
        and isinstance(keep, int)
        and keep == 0
        and isinstance(ignore_index, int)
        and not autocast_on()
        and not _adds_router_loss(model, signature, call)
        and model.get_output_embeddings() is head
        and _hooks_of(head) is None
        and vars(head).get("forward") is head_forward
        # A hook would see chunks; transformers' own checkpointing would recompute inside the step.
        and not any(_runs_hooks(module) for module in model.modules() if module is not model)
        and not any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
        and not _recording_outside()
        and step_problem(model, unreached) is None
    ):
        return None
    if mask is not None and bool((runs_of_real_tokens(mask) > 1).any()):
        return None  # real tokens with holes: transformers' dense mask, which segments do not describe
    return batch_of(
        input_ids,
        labels,
        attention_mask=mask,
        position_ids=positions,
        shift_labels=shift_labels,
        ignore_index=ignore_index,
        num_items_in_batch=extra.get("num_items_in_batch"),
        # transformers packs only without a cache, in the families whose decoders read position_ids for it
        packed=packs_documents(model) and not _asks_for_cache(model, call.get("use_cache")),
    )


def _probe(model: nn.Module, owner: nn.Module, directory: str) -> tuple[str | None, type | None]:
    """(None, the type of the model's output) when, in training mode, the step's loss on ``owner`` (the causal LM
    in ``model``) is the model's own on one row, padded rows (their pads' labels counted), packed documents and with
    ``num_items_in_batch``; else (why not, None)."""
    vocab = owner.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    padding = torch.ones_like(ids)
    padding[0, :2] = 0  # left padding
    padding[1, -3:] = 0  # right padding
    before_text = padding.cumsum(1) <= 1  # the left pads and the first real token
    calls = {
        "one row": dict(input_ids=ids[:1], labels=labels[:1]),
        # The right pads' labels counted (they see their row's text); not the left pads' targets (the labels up to
        # the first real token's), whose queries see no key, where eager attention (Gemma 2's, GPT-OSS's) gives a
        # softmax over the whole row (a call that counts them keeps the other path).
        "padded rows": dict(input_ids=ids, labels=ids.masked_fill(before_text, -100), attention_mask=padding),
        "packed documents": dict(
            input_ids=ids[:1], labels=ids[:1], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
        ),
        "num_items_in_batch": dict(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5)),
    }
    rtol = _PROBE_RTOL.get(owner.get_output_embeddings().weight.dtype, 1e-5)
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.train()
        problem = step_problem(owner, unreached=None)  # in training mode, where dropout counts
        problem = problem or reached_outside(owner, calls["one row"])
        if problem is not None:
            return problem, None
        for what, call in calls.items():
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                want = model(**call, use_cache=False)
                batch = batch_of(
                    call["input_ids"],
                    call["labels"],
                    attention_mask=call.get("attention_mask"),
                    position_ids=call.get("position_ids"),
                    num_items_in_batch=call.get("num_items_in_batch"),
                    packed=packs_documents(owner),
                )
                got = chunk_recurrent_step(owner, batch, _PROBE_CHUNK_TOKENS, directory)
            if not torch.allclose(got.float(), want.loss.float(), rtol=rtol, atol=rtol, equal_nan=True):
                loss, own = got.item(), want.loss.item()
                return f"the step's loss ({loss:.6g}) is not the model's own ({own:.6g}) on {what}", None
    except Unsupported as error:
        return str(error), None
    except _PROBE_ERRORS as error:
        return f"the step cannot be probed ({type(error).__name__}: {error})", None
    finally:
        for module, mode in modes:
            module.training = mode
    return None, type(want)
