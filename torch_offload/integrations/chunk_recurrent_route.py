"""apply()'s chunk-recurrent step: a training call with labels of a model in host memory runs chunk_recurrent.py's
step, whose memory does not grow with the sequence, where apply can prove it computes what the model's own forward
and loss compute.

Where (docs/apply.md, "The chunk-recurrent step"): apply runs the loop over the layers itself (layer_loop.py: every
layer offloaded to the disk tier with only its attention recomputed, a family read to be Llama's built as Llama's,
its probe), the loss is fused, the model is one the step takes (chunk_recurrent.parts_problem), on the CPU, and a
probe at apply time shows that in training mode the step's loss is the model's own on one row, on padded rows, on
packed documents and with ``num_items_in_batch``; the causal LM's forward its class's (the step would bypass one
put on the instance). Per call (``_batch_of_call``): gradients, training mode, eager, ``input_ids`` and ``labels`` on
the CPU, no logits asked for, no autocast, a decoder call that would run apply's loop (no cache given, nothing
recorded), no hook on any module under the causal LM (one would see chunks, or not run where the step does not call
the module's forward: the decoder, its layers and their attention modules, the head), those modules, their forwards
and the attention implementation as the probe found them, and an ``attention_mask`` whose real tokens are
contiguous in each row. Any other call runs the forward apply installed before (the fused loss over apply's layers).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..causal_lm_loss import _PROBE_RTOL
from ..disk import default_spill_directory, spill_directory_in_ram
from .checkpointing import warn_empty_cache_dropped
from .chunk_batch import batch_of, runs_of_real_tokens
from .chunk_recurrent import CHUNK_TOKENS, autocast_on, chunk_recurrent_step, parts_problem
from .layer_loop import _asks_for_cache, _cache_name, _runs_hooks
from .options import _on_accelerator
from .probes import _PROBE_ERRORS

if TYPE_CHECKING:
    from .handle import OffloadHandle

_PROBE_CHUNK_TOKENS = 3  # the probe's 8-token rows in three chunks, its documents and rows across their bounds


def install_chunk_recurrent(handle: OffloadHandle, model: nn.Module, options: dict[str, Any]) -> str:
    """Route ``model``'s training calls with labels to the step where it is proven (see the module's docstring);
    returns ``"on"``, or ``"off: <why>"``. ``options`` are apply's offload options (the spill directory)."""
    if handle.layer_loop != "apply's":
        return "off: apply does not run the loop over the layers (handle.layer_loop)"
    if handle.loss != "linear_cross_entropy":
        return "off: the loss is not fused (handle.loss)"
    if _on_accelerator(model):
        return "off: the model is on an accelerator (the step runs on the CPU only)"
    owner, head, class_forward = handle._fused_loss_owner
    decoder = model.get_submodule(handle.layer_path.rpartition(".")[0])
    problem = parts_problem(owner)
    if problem is None and getattr(owner, "model", None) is not decoder:
        problem = "the decoder apply's loop runs is not the causal LM's model"
    own = inspect.unwrap(type(owner).forward)
    if problem is None and not (class_forward and own.__module__ == type(owner).__module__):
        # The step would bypass it (the fused loss calls it, without labels).
        problem = f"{type(owner).__name__}'s forward was replaced before apply"
    if problem is not None:
        return f"off: {problem}"
    directory = options.get("spill_directory")
    directory = os.fspath(directory) if directory is not None else default_spill_directory()
    if spill_directory_in_ram(directory) and not options.get("allow_tmpfs"):
        return f"off: the spill directory {directory!r} is on a RAM file system"
    installed = owner.forward  # the fused loss's
    problem, output_type = _probe(owner, installed, directory)
    if problem is not None:
        return f"off: {problem}"
    probed = _bypassed(decoder, head)
    signature = inspect.signature(installed)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    cache_name = _cache_name(decoder)

    @functools.wraps(installed)
    def forward(*args, **kwargs):
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and owner.training):
            return installed(*args, **kwargs)
        try:
            call = dict(signature.bind(*args, **kwargs).arguments)
        except TypeError:  # the model's own forward says what is wrong
            return installed(*args, **kwargs)
        extra = dict(call.pop(var_keyword, None) or {})
        unchanged = _bypassed(decoder, head) == probed
        batch = _batch_of_call(handle, owner, head, decoder, call, extra) if unchanged else None
        if batch is None:
            return installed(*args, **kwargs)
        loss = chunk_recurrent_step(owner, batch, CHUNK_TOKENS, directory)
        handle.chunk_recurrent_calls += 1
        fields = {}
        if _asks_for_cache(decoder, call.get("use_cache")):  # as apply's loop: the empty cache the decoder makes
            fields[cache_name] = sys.modules[type(decoder).__module__].DynamicCache(config=decoder.config)
            warn_empty_cache_dropped(stacklevel=2)
        # float32 as the fused loss (and transformers' for any head): a float64 model's gradients stay float64.
        return output_type(loss=loss.float(), logits=None, **fields)

    owner_name = next(name for name, module in model.named_modules() if module is owner) or "model"
    handle._patch(f"{owner_name}.forward", owner, "forward", forward)
    return "on"


def _bypassed(decoder, head) -> list:
    """What the step does not call but the installed forward would, to compare with the probe's: the attention
    implementation and each bypassed module (the decoder, the head, each layer and its attention) with
    a forward put on it and its class's forward. A change since sends a call to the installed forward."""
    modules = [decoder, head, *(m for layer in decoder.layers for m in (layer, layer.self_attn))]
    return [
        decoder.config._attn_implementation,
        *((module, vars(module).get("forward"), type(module).forward) for module in modules),
    ]


def _batch_of_call(handle, owner, head, decoder, call: dict, extra: dict):
    """The step's batch for a causal LM's call (its named arguments and the others), or None where the step would
    not compute what the installed forward does (see the module's docstring)."""
    labels, input_ids = call.pop("labels", None), call.get("input_ids")
    shift_labels, ignore_index = extra.get("shift_labels"), extra.pop("ignore_index", -100)
    mask, positions = call.get("attention_mask"), call.get("position_ids")
    keep = call.pop("logits_to_keep", 0)
    if not (
        isinstance(input_ids, torch.Tensor)
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
        and owner.get_output_embeddings() is head
        and head.weight.device.type == "cpu"
        # A hook would see chunks, or not run (on the modules whose forwards the step does not call).
        and not any(_runs_hooks(module) for module in owner.modules() if module is not owner)
        and parts_problem(owner) is None
        and handle._layer_loop_allows(dict(call), dict(extra))
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
        packed=not _asks_for_cache(decoder, call.get("use_cache")),  # transformers packs only without a cache
    )


def _probe(owner: nn.Module, installed, directory: str) -> tuple[str | None, type | None]:
    """(None, the type of the model's output) when, in training mode, the step's loss is the model's own on one row,
    padded rows (their pads' labels counted), packed documents and with ``num_items_in_batch``; else (why not, None).
    """
    vocab = owner.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    padding = torch.ones_like(ids)
    padding[0, :2] = 0  # left padding
    padding[1, -3:] = 0  # right padding
    calls = {
        "one row": dict(input_ids=ids[:1], labels=labels[:1]),
        "padded rows": dict(input_ids=ids, labels=ids, attention_mask=padding),
        "packed documents": dict(
            input_ids=ids[:1], labels=ids[:1], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
        ),
        "num_items_in_batch": dict(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5)),
    }
    rtol = _PROBE_RTOL.get(owner.get_output_embeddings().weight.dtype, 1e-5)
    modes = [(module, module.training) for module in owner.modules()]
    output_type = None
    try:
        owner.train()
        problem = parts_problem(owner)  # in training mode, where dropout counts
        if problem is not None:
            return problem, None
        for what, call in calls.items():
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                want = installed(**call, use_cache=False)
                batch = batch_of(
                    call["input_ids"],
                    call["labels"],
                    attention_mask=call.get("attention_mask"),
                    position_ids=call.get("position_ids"),
                    num_items_in_batch=call.get("num_items_in_batch"),
                )
                got = chunk_recurrent_step(owner, batch, _PROBE_CHUNK_TOKENS, directory)
            output_type = type(want)
            if not torch.allclose(got.float(), want.loss.float(), rtol=rtol, atol=rtol, equal_nan=True):
                return (
                    f"the step's loss ({got.item():.6g}) is not the model's own ({want.loss.item():.6g}) on {what}",
                    None,
                )
    except _PROBE_ERRORS as error:
        return f"the step cannot be probed ({type(error).__name__}: {error})", None
    finally:
        for module, mode in modes:
            module.training = mode
    return None, output_type
