"""The attention implementations apply gives the model's configs (segment-id masks, attention over ranks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .. import masking

if TYPE_CHECKING:
    from .handle import OffloadHandle


# Where a transformers config keeps its attention implementation (the `_attn_implementation` property's value).
_IMPLEMENTATION_KEY = "_attn_implementation_internal"


class _ImplementationBeforeCopies(str):
    """The attention implementation apply gives a config: the name of ours, which copies and pickles
    (``copy.deepcopy``, ``torch.save(model)``) turn back into the one the config had before apply, as
    they do the modules' patches (_StateBeforeApply): a copy loads where torch_offload is not imported
    and runs as the model did before apply."""

    def __new__(cls, ours: str, before: str):
        name = super().__new__(cls, ours)
        name.before = before
        return name

    def __reduce__(self):
        return str, (self.before,)


def _set_implementation(handle: OffloadHandle, config: Any, implementation: str) -> None:
    previous = vars(config)[_IMPLEMENTATION_KEY]
    before = getattr(previous, "before", previous)  # a second handle's: the config's own from before the first
    handle._attention_implementations.append((config, previous, implementation))
    vars(config)[_IMPLEMENTATION_KEY] = _ImplementationBeforeCopies(implementation, before)


def _configs(model: nn.Module) -> list[Any]:
    """The model's configs (a VLM has several), each once."""
    return list(
        {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")}.values()
    )


# The families whose modelling code is tested to hand the mask to the attention untouched
# (test_real_batches.py): segment ids reach no other, since code that computes with a mask
# (adds it, indexes it as [batch, 1, T, T]) would misread them without a word. Not Qwen2-MoE: it
# builds a sliding-window mask beside the causal one at every call, used by no layer when
# use_sliding_window is off, which segment ids cannot describe (dense, [T, T]).
_SEGMENT_MASK_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "qwen3_moe", "mixtral"}
)


def _use_segment_masks(handle: OffloadHandle, model: nn.Module) -> str:
    """Every config of the model whose attention is SDPA gets masking.IMPLEMENTATION: packed and padded
    batches then reach attention modules as segment ids, not as a dense [batch, 1, T, T] mask. Returns
    what the model's masks are, for the handle's report."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():  # attention not through transformers' AttentionInterface
        return "the model's own (its attention does not go through transformers' attention functions)"
    configs = _configs(model)
    ours = [
        c
        for c in configs
        if vars(c).get(_IMPLEMENTATION_KEY) == "sdpa" and getattr(c, "model_type", None) in _SEGMENT_MASK_MODEL_TYPES
    ]
    if ours:
        masking.register()
    for config in ours:
        _set_implementation(handle, config, masking.IMPLEMENTATION)
    if ours:
        return "segment ids (packed and padded rows reach attention without a [T, T] mask)"
    named = [(getattr(c, "model_type", type(c).__name__), vars(c).get(_IMPLEMENTATION_KEY)) for c in configs]
    other = [
        f"{kind} has {implementation!r} attention"
        for kind, implementation in named
        if implementation not in (None, "sdpa")
    ]
    untested = [kind for kind, implementation in named if implementation == "sdpa"]
    problems = other + ([f"{', '.join(untested)}: not among the families tested with segment ids"] if untested else [])
    return f"the model's own ({'; '.join(problems) or 'no attention implementation in its configs'})"
