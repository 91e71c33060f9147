"""apply() running the loop over the decoder layers itself, where it can prove it computes what the decoder's own
forward computes.

Why: Hugging Face's loop keeps two ``[tokens, hidden]`` tensors alive through every layer that nothing needs any
more: the embeddings (its ``inputs_embeds``) and the running layer's input (its loop variable, and the call's
arguments while the layer runs). With the layers offloaded, they are two of the six hidden vectors the forward
holds at its peak (BENCHMARKS.md, "Long context"). apply's loop holds the running layer's tensors alone: the
embeddings go once the first layer has read them, and each layer's input once its residual add has.

Where (docs/apply.md, "The loop over the layers"): every layer offloaded with only its attention recomputed (the disk
tier's default), no sequence parallelism, a family whose decoder and layer forwards are Llama's (``llama_loop`` in
torch_offload.families, read in transformers 5.24 and 5.16) built as Llama's (its children ``embed_tokens``,
``layers``, ``norm``, ``rotary_emb``; each layer's ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``,
``mlp``; none with a parameter or buffer of its own), the decoder's forward still its class's, and a probe at apply
time: in training mode, on one row, padded rows and packed documents, apply's loop gives the decoder's own output bit
for bit. Per call, only where nothing could tell the difference (``_call_allows``); any other call runs the decoder's
own forward.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules import module as _module

from .. import masking
from ..families import family_of
from .checkpointing import warn_empty_cache_dropped
from .probes import _PROBE_ERRORS

if TYPE_CHECKING:
    from .handle import OffloadHandle

_DECODER_CHILDREN = {"embed_tokens", "layers", "norm", "rotary_emb"}
_LAYER_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
_TAKEN_ARGUMENTS = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids"})
_KEY_VALUE_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_position")
# What a causal LM passes its decoder for its loss alone: the layers do not read them.
_LOSS_ARGUMENTS = frozenset({"num_items_in_batch", "shift_labels"})
# transformers records these through hooks (capture_outputs); a decoder's _can_record_outputs may name more.
_RECORDED_OUTPUTS = ("attentions", "hidden_states", "router_logits")
# Installed on the layers the first time a call records outputs (even apply's loss probe, for a mixture of experts'
# router logits), and kept.
_RECORDERS = "transformers.utils.output_capturing"
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def install_layer_loop(handle: OffloadHandle, model: nn.Module) -> str:
    """Install apply's loop over ``handle.layers`` where it is proven (see the module's docstring); returns
    ``"apply's"``, or ``"the model's own: <why>"``."""
    decoder_path = handle.layer_path.rpartition(".")[0]
    decoder = model.get_submodule(decoder_path)
    problem = _install_problem(handle, decoder)
    if problem is not None:
        return f"the model's own: {problem}"
    original = decoder.forward
    signature = inspect.signature(original)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    # Each layer with the forward apply gave it and its class's forward, which apply's loop stands for.
    layers = [(layer, vars(layer).get("forward"), type(layer).forward) for layer in handle.layers]
    cache_name = _cache_name(decoder)
    run_layers = functools.partial(_run, decoder, handle.context, [each[0] for each in layers], cache_name=cache_name)
    recorded = {
        f"output_{name}" for name in (*_RECORDED_OUTPUTS, *(getattr(decoder, "_can_record_outputs", None) or {}))
    }
    problem, output_type = _probe(decoder, original, run_layers)
    for config, _, _ in handle._attention_implementations:  # the probe's masks are apply's, not the user's
        masking.forget(config)
    if problem is not None:
        return f"the model's own: {problem}"
    run = functools.partial(run_layers, output_type)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and decoder.training):
            return original(*args, **kwargs)
        try:
            call = signature.bind(*args, **kwargs).arguments
        except TypeError:  # the decoder's own forward says what is wrong
            return original(*args, **kwargs)
        extra = call.pop(var_keyword, None) or {}
        if "use_cache" in call and "use_cache" not in kwargs:
            return original(*args, **kwargs)  # transformers' merge_with_config_defaults passes it again: a TypeError
        asks_for_cache = _asks_for_cache(decoder, call.get("use_cache"))
        if not _call_allows(decoder, layers, recorded, output_type, cache_name, call, extra):
            return original(*args, **kwargs)
        cache = None
        if asks_for_cache:
            # What the decoder's own forward returns then: the cache it makes, which apply's layers leave empty.
            cache = sys.modules[type(decoder).__module__].DynamicCache(config=decoder.config)
            warn_empty_cache_dropped(stacklevel=2)
        inputs = (call.get(name) for name in ("input_ids", "inputs_embeds", "attention_mask", "position_ids"))
        return run(*inputs, cache)

    handle._patch(f"{decoder_path}.forward", decoder, "forward", forward)
    return "apply's"


def _install_problem(handle: OffloadHandle, decoder: nn.Module) -> str | None:
    if handle.context is None:
        return "no layer is offloaded"
    if handle.sequence_parallel is not None:
        return "sequence parallelism"
    names = [f"{handle.layer_path}.{index}" for index in range(len(handle.layers))]
    if len(handle._offloaded) != len(names) or any(handle.checkpointing.get(n) != "attention" for n in names):
        return "not every layer is offloaded with only its attention recomputed"
    config = getattr(decoder, "config", None)
    model_type = getattr(config, "model_type", None)
    if not getattr(family_of(config), "llama_loop", False):
        return f"model type {model_type!r}, whose decoder forward is not known to be Llama's"
    if handle.layer_path.rpartition(".")[2] != "layers" or set(dict(decoder.named_children())) != _DECODER_CHILDREN:
        return f"{type(decoder).__name__}'s children are not {sorted(_DECODER_CHILDREN)}"
    if any(set(dict(layer.named_children())) != _LAYER_CHILDREN for layer in handle.layers):
        return f"a layer's children are not {sorted(_LAYER_CHILDREN)}"
    for module in (decoder, *handle.layers):
        if (
            next(module.parameters(recurse=False), None) is not None
            or next(module.buffers(recurse=False), None) is not None
        ):
            return f"{type(module).__name__} has a parameter or buffer of its own, which its forward may read"
    own = inspect.unwrap(type(decoder).forward)
    if "forward" in vars(decoder) or own.__module__ != type(decoder).__module__:
        return f"{type(decoder).__name__}'s forward was replaced before apply (its replacement would not run)"
    return _config_problem(decoder)


def _config_problem(decoder: nn.Module) -> str | None:
    """What in the decoder's config makes its forward other than apply's loop: read at apply and at each call."""
    config = decoder.config
    if getattr(config, "sliding_window", None) is not None or getattr(config, "use_sliding_window", False):
        return "a sliding window, whose mask the decoder builds its own way"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "layers of other kinds than full attention, each with its own mask"
    # Granite's multipliers scale the embeddings and the residual stream: at 1.0 the probe could not see them.
    multipliers = sorted(name for name in vars(config) if name.endswith("_multiplier"))
    if multipliers:
        return f"config.{multipliers[0]}, which the decoder's own forward may apply"
    if getattr(config, "is_causal", None) not in (None, True):
        return "config.is_causal is not True"
    if getattr(config, "num_hidden_layers", None) != len(decoder.layers):
        return "config.num_hidden_layers is not the number of layers"
    if not callable(getattr(sys.modules[type(decoder).__module__], "create_causal_mask", None)):
        return f"{type(decoder).__module__} has no create_causal_mask"
    return None


def _call_allows(
    decoder: nn.Module,
    layers: list,
    recorded: set[str],
    output_type: type,
    cache_name: str,
    call: dict,
    extra: dict,
) -> bool:
    """Whether apply's loop computes what this call of the decoder's own forward would, and nothing could tell the
    difference; ``call`` holds the named arguments, ``extra`` the others, ``output_type`` the decoder's output's."""
    config = decoder.config
    extra = dict(extra)
    # A cache asked for (transformers' default, even in training): the decoder makes an empty one, and each of
    # apply's layers drops it in training mode (checkpointing.py), as apply's loop does.
    if _asks_for_cache(decoder, call.pop("use_cache", None)) and not (
        all(layer.training for layer, *_ in layers)
        and callable(getattr(sys.modules[type(decoder).__module__], "DynamicCache", None))
        and cache_name in getattr(output_type, "__dataclass_fields__", {})
    ):
        return False
    if any(
        call.pop(name, None) is not None or extra.pop(name, None) is not None for name in _KEY_VALUE_CACHE_ARGUMENTS
    ):
        return False
    for name in recorded:
        recording = extra.pop(name, None)
        if recording if recording is not None else getattr(config, name, False):
            return False
    if extra.pop("return_dict", getattr(config, "return_dict", True)) is False:
        return False
    mask, positions = call.get("attention_mask"), call.get("position_ids")
    if (
        set(call) - _TAKEN_ARGUMENTS
        or set(extra) - _LOSS_ARGUMENTS
        or (call.get("input_ids") is None) == (call.get("inputs_embeds") is None)  # the decoder's own error
        or (mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2))
        or (positions is not None and not (isinstance(positions, torch.Tensor) and positions.dim() == 2))
        or _config_problem(decoder) is not None
        or getattr(decoder, "gradient_checkpointing", False)
        or len(decoder.layers) != len(layers)
        or _recording_outside()
    ):
        return False
    return all(
        current is layer
        and vars(layer).get("forward") is installed  # a wrapper installed since apply would not run
        and type(layer).forward is class_forward  # nor its class's forward patched since
        and layer._compiled_call_impl is None  # layer.compile() since apply
        and not _runs_hooks(layer)
        and not getattr(layer, "gradient_checkpointing", False)
        for current, (layer, installed, class_forward) in zip(decoder.layers, layers)
    )


def _cache_name(decoder: nn.Module) -> str:
    """What the family's decoder forward, ``create_causal_mask`` and output call the cache: ``cache`` from
    transformers 5.24, ``past_key_values`` before. Read off the decoder class's own forward (the probe has proven it
    is Llama's), not off ``create_causal_mask``: libraries wrap that one without keeping its signature."""
    forward = inspect.signature(type(decoder).forward)
    return "cache" if "cache" in forward.parameters else "past_key_values"


def _asks_for_cache(decoder: nn.Module, use_cache: bool | None) -> bool:
    """The call's ``use_cache``, else the config's, as transformers' ``merge_with_config_defaults`` reads it."""
    return bool(use_cache if use_cache is not None else getattr(decoder.config, "use_cache", False))


def _runs_hooks(layer: nn.Module) -> bool:
    """Whether a call of ``layer`` runs a hook: a global module hook, or one of its own other than transformers'
    output recorders, which record nothing in a call that asks for no outputs (``_recording_outside``)."""
    if any(getattr(_module, name) for name in _GLOBAL_HOOKS):
        return True
    own = (layer._forward_pre_hooks, layer._forward_hooks, layer._backward_pre_hooks, layer._backward_hooks)
    return any(getattr(hook, "__module__", None) != _RECORDERS for hooks in own for hook in hooks.values())


def _recording_outside() -> bool:
    """Whether a forward around the decoder's (a VLM's) is recording outputs through transformers' hooks."""
    capturing = sys.modules.get(_RECORDERS)
    return capturing is not None and bool(capturing._active_collector.get())


def _run(
    decoder,
    context,
    layers,
    output_type,
    input_ids,
    inputs_embeds,
    attention_mask,
    position_ids,
    cache=None,
    *,
    cache_name,
):
    """The decoder's forward as Llama's writes it, for a call whose cache, if any, stays empty: the layers' input
    carried in a list that each layer empties, so that no frame holds it past its residual add."""
    hidden = decoder.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    cache_argument = {cache_name: cache}
    mask = sys.modules[type(decoder).__module__].create_causal_mask(
        config=decoder.config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **cache_argument,
    )
    rotary = decoder.rotary_emb(hidden, position_ids=position_ids)
    carried = [hidden]
    del hidden
    for layer in layers:
        with context:  # as apply's layer forward runs each layer
            carried.append(_run_layer(layer, carried, mask, rotary, position_ids))
    hidden = decoder.norm(carried.pop())
    return (
        output_type(last_hidden_state=hidden)
        if cache is None
        else output_type(last_hidden_state=hidden, **cache_argument)
    )


def _run_layer(layer, carried, mask, rotary, position_ids):
    """Llama's decoder layer; its input taken out of ``carried`` and dropped after the first residual add."""
    residual = carried.pop()
    hidden = layer.input_layernorm(residual)
    hidden = layer.self_attn(
        hidden_states=hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary
    )[0]
    hidden = residual + hidden
    del residual
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _probe(decoder: nn.Module, original, run) -> tuple[str | None, type | None]:
    """(None, the type of the decoder's output) when ``run`` gives the decoder's own output bit for bit in training
    mode (dropout drawn alike), on one row, on padded rows and on packed documents; else (why not, None)."""
    vocab, device = decoder.embed_tokens.weight.shape[0], decoder.embed_tokens.weight.device
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    padding = torch.ones_like(ids)
    padding[0, :2] = 0  # left padding
    padding[1, -3:] = 0  # right padding
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]], device=device)
    calls = {
        "one row": dict(input_ids=ids[:1]),
        "padded rows": dict(input_ids=ids, attention_mask=padding),
        "packed documents": dict(input_ids=ids[:1], position_ids=packed),
    }
    # What the loop runs for: nothing recorded (a config recording router logits, as the tests' mixtures of experts
    # do, gets the decoder's own loop at each call).
    not_recorded = {f"output_{name}": False for name in getattr(decoder, "_can_record_outputs", None) or {}}
    output_type = None
    modes = [(module, module.training) for module in decoder.modules()]
    devices = [device] if device.type == "cuda" else []
    try:
        decoder.train()
        for what, call in calls.items():
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(0)
                want = original(**call, use_cache=False, **not_recorded)
                torch.manual_seed(0)
                output_type = type(want)
                got = run(output_type, call["input_ids"], None, call.get("attention_mask"), call.get("position_ids"))
            same = got.keys() == want.keys() and all(
                # A pad's NaN in both is the same.
                a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
                for a, b in zip(got.values(), want.values())
            )
            if not same:
                return f"apply's loop does not give the decoder's own output bit for bit ({what})", None
    except _PROBE_ERRORS as error:
        return f"its forward cannot be probed ({type(error).__name__}: {error})", None
    finally:
        for module, mode in modes:
            module.training = mode
    return None, output_type
