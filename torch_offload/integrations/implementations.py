"""The attention implementations apply gives the model's configs (segment-id masks, attention over ranks)."""

from __future__ import annotations

import copyreg
import pickle
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from .. import eager_attention, masking, sequence_parallel
from ..families import family_of

if TYPE_CHECKING:
    from .handle import OffloadHandle


# Where a transformers config keeps its attention implementation (the `_attn_implementation` property's value).
_IMPLEMENTATION_KEY = "_attn_implementation_internal"


# id(config) -> (a weak reference to it, the implementation it had before the first apply): read by
# _reduce_config. The config itself holds a plain str: torch.compile (torch 2.11's dynamo) traces no str
# subclass, and transformers looks the name up in its registries inside the compiled code.
_BEFORE_APPLY: dict[int, tuple[weakref.ref, Any]] = {}


def _reduce_config(config: Any) -> Any:
    """How copies and pickles (``copy.deepcopy``, ``torch.save(model)``) reduce a config of a class apply
    gave an implementation: as the config does by itself, with the implementation it had before apply
    while it holds one of ours, as they do the modules' patches (_StateBeforeApply): a copy loads where
    torch_offload is not imported and runs as the model did before apply."""
    reduced = config.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    entry = _BEFORE_APPLY.get(id(config))
    state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else None
    if entry is None or entry[0]() is not config or not isinstance(state, dict):
        return reduced
    ours = (masking.IMPLEMENTATION, eager_attention.IMPLEMENTATION, sequence_parallel.IMPLEMENTATION)
    if state.get(_IMPLEMENTATION_KEY) not in ours:
        return reduced  # removed, or set by the user since
    return (*reduced[:2], dict(state, **{_IMPLEMENTATION_KEY: entry[1]}), *reduced[3:])


def masks_of(config: Any) -> str | None:
    """How the config's family takes packed and padded batches (torch_offload.families: "sdpa", "eager", None)."""
    family = family_of(config)
    return None if family is None else family.masks


def _set_implementation(handle: OffloadHandle, config: Any, implementation: str) -> None:
    previous = vars(config)[_IMPLEMENTATION_KEY]
    handle._attention_implementations.append((config, previous, implementation))
    entry = _BEFORE_APPLY.get(id(config))
    if entry is None or entry[0]() is not config:  # a second handle's: the config's own from before the first
        key = id(config)
        _BEFORE_APPLY[key] = (weakref.ref(config, lambda _: _BEFORE_APPLY.pop(key, None)), previous)
        copyreg.pickle(type(config), _reduce_config)
    vars(config)[_IMPLEMENTATION_KEY] = implementation


def _configs(model: nn.Module) -> list[Any]:
    """The model's configs (a VLM has several), each once."""
    return list(
        {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")}.values()
    )


def _eager_attention_module(model: nn.Module, config: Any) -> nn.Module | None:
    """One attention module of ``config``'s (one whose forward takes its eager attention function's arguments)."""
    return next(
        (
            m
            for m in model.modules()
            if getattr(m, "config", None) is config and hasattr(m, "num_key_value_groups") and hasattr(m, "scaling")
        ),
        None,
    )


def _use_segment_masks(handle: OffloadHandle, model: nn.Module) -> str:
    """Every config of the model whose attention is SDPA gets masking.IMPLEMENTATION: packed and padded
    batches then reach attention modules as segment ids, not as a dense [batch, 1, T, T] mask. Returns
    what the model's masks are, for the handle's report."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():  # attention not through transformers' AttentionInterface
        return "the model's own (its attention does not go through transformers' attention functions)"
    configs = _configs(model)
    ours = [c for c in configs if vars(c).get(_IMPLEMENTATION_KEY) == "sdpa" and masks_of(c) == "sdpa"]
    eager, eager_problems = [], {}
    for c in configs:
        if vars(c).get(_IMPLEMENTATION_KEY) == "eager" and masks_of(c) == "eager":
            module = _eager_attention_module(model, c)
            problem = "no attention module found" if module is None else eager_attention.probe_problem(module)
            if problem is None:
                eager.append(c)
            else:
                eager_problems[id(c)] = problem
    if ours:
        masking.register()
    if eager:
        eager_attention.register()
    for config in ours:
        _set_implementation(handle, config, masking.IMPLEMENTATION)
    for config in eager:
        _set_implementation(handle, config, eager_attention.IMPLEMENTATION)
    if ours or eager:
        return "segment ids (packed and padded rows reach attention without a [T, T] mask)"
    named = [(getattr(c, "model_type", type(c).__name__), vars(c).get(_IMPLEMENTATION_KEY), id(c)) for c in configs]
    other = [
        f"{kind} has {implementation!r} attention" + (f": {eager_problems[key]}" if key in eager_problems else "")
        for kind, implementation, key in named
        if implementation not in (None, "sdpa")
    ]
    untested = [kind for kind, implementation, _ in named if implementation == "sdpa"]
    problems = other + ([f"{', '.join(untested)}: not among the families tested with segment ids"] if untested else [])
    return f"the model's own ({'; '.join(problems) or 'no attention implementation in its configs'})"
