"""apply(sequence_parallel=...): the group, and the model's attention over its ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .. import eager_attention, masking, sequence_parallel
from ..families import FAMILIES, family_of
from .implementations import _IMPLEMENTATION_KEY, _configs, _eager_attention_module, _set_implementation, masks_of
from .layers import _attention_of

if TYPE_CHECKING:
    from .handle import OffloadHandle


def _sequence_parallel_group(sequence_parallel: Any, loss: bool) -> Any:
    """apply()'s sequence-parallel ProcessGroup (given as one or as a 1-D DeviceMesh), or None."""
    if sequence_parallel is None:
        return None
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(sequence_parallel, DeviceMesh):
        if sequence_parallel.ndim != 1:
            raise ValueError(
                f"torch_offload.apply: sequence_parallel is a {sequence_parallel.ndim}-D DeviceMesh; "
                'pass its sequence dimension (e.g. mesh["sp"])'
            )
        sequence_parallel = sequence_parallel.get_group()
    if not isinstance(sequence_parallel, ProcessGroup):
        raise TypeError(
            "torch_offload.apply: sequence_parallel must be a torch.distributed ProcessGroup or "
            f"DeviceMesh, got {type(sequence_parallel).__name__}"
        )
    if not loss:
        raise ValueError(
            "torch_offload.apply: sequence_parallel needs loss=True: the model's own loss would be "
            "each rank's mean, not the whole batch's"
        )
    return sequence_parallel


# Rotary embeddings whose frequencies transformers picks from a call's largest position (dynamic_rope_update).
_ROPE_OF_THE_CALLS_POSITIONS = ("dynamic", "longrope")


def rope_of_the_calls_positions(config: Any) -> str | None:
    """The config's rotary embedding type where its frequencies depend on a call's largest position, else None."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    return rope_type if rope_type in _ROPE_OF_THE_CALLS_POSITIONS else None


def _attend_over_ranks(
    handle: OffloadHandle, model: nn.Module, names: list[str], layers: nn.ModuleList, group: Any
) -> None:
    """The model's attention over ``group``'s ranks: its attention implementation becomes
    sequence_parallel.IMPLEMENTATION (ulysses_attention for the modules' own forwards) and each attention
    module is told the group; modules already through attention_block run it with the group."""
    configs = _configs(model)
    eager_configs = set()
    for config in configs:
        implementation = vars(config).get(_IMPLEMENTATION_KEY)
        if implementation is None:  # a composite config (a VLM's) whose parts have their own
            continue
        family = family_of(config)
        if implementation == "eager" and masks_of(config) == "eager":
            module = _eager_attention_module(model, config)
            problem = "no attention module found" if module is None else eager_attention.probe_problem(module)
            if problem is not None:
                raise ValueError(
                    f"torch_offload.apply: sequence_parallel: {type(config).__name__}'s eager attention: {problem}"
                )
            eager_configs.add(id(config))  # its left-padded rows are refused at the call (every_query_has_a_key)
        elif implementation == "eager":
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__} has 'eager' attention, which "
                "gives a query with no key to attend (a left-padded row's pads) the mean of its whole row's "
                "values, later tokens included, where ulysses_attention gives 0 as SDPA does; load the model "
                "with attn_implementation='sdpa'"
            )
        elif implementation != "sdpa" or not (family is not None and family.sequence_parallel):
            over_ranks = sorted(name for name, row in FAMILIES.items() if row.sequence_parallel)
            raise ValueError(
                f"torch_offload.apply: sequence_parallel supports the attention of "
                f"{', '.join(over_ranks)} models with 'sdpa' "
                f"attention; {type(config).__name__} has model_type "
                f"{getattr(config, 'model_type', None)!r} and attention {implementation!r}"
            )
        rope_type = rope_of_the_calls_positions(config)
        if rope_type is not None:
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__}'s rotary embedding "
                f"({rope_type!r}) scales with the largest position of a call, which differs between ranks"
            )
        if getattr(config, "output_router_logits", False):
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__} has output_router_logits=True: "
                "the mixture of experts' auxiliary loss would be over each rank's tokens, not the whole batch's; "
                "set config.output_router_logits = False"
            )
        if masking.config_window(config) is not None and not (family is not None and family.passes_window):
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__}'s attention modules do not pass "
                "their sliding window to the attention function, so ulysses_attention would not compute it"
            )
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int) and heads % group.size():
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {heads} attention heads cannot be split over "
                f"{group.size()} ranks; the heads must be a multiple of the number of ranks"
            )
    if handle.loss != "linear_cross_entropy":
        raise ValueError(
            f"torch_offload.apply: sequence_parallel needs the fused loss, and this model's is "
            f"{handle.loss!r}: its own would be each rank's mean, not the whole batch's"
        )
    sequence_parallel.register()
    for name, layer in zip(names, layers):
        attention = _attention_of(layer)
        if attention is None:
            raise ValueError(f"torch_offload.apply: sequence_parallel: {name} has no single attention module")
        module = getattr(layer, attention)
        handle._patch(
            f"{name}.{attention}.{sequence_parallel.GROUP_ATTRIBUTE}",
            module,
            sequence_parallel.GROUP_ATTRIBUTE,
            group.group_name,
        )
        config = getattr(module, "config", None)
        if id(config) in eager_configs:
            handle._patch(
                f"{name}.{attention}.{sequence_parallel.EAGER_ATTRIBUTE}",
                module,
                sequence_parallel.EAGER_ATTRIBUTE,
                True,
            )
        if not getattr(family_of(config), "packs_documents", True):
            one_sequence = sequence_parallel.ONE_SEQUENCE_PER_ROW_ATTRIBUTE
            handle._patch(f"{name}.{attention}.{one_sequence}", module, one_sequence, True)
        if handle.attention.get(f"{name}.{attention}") != "attention_block":  # not the op with the group
            handle.attention[f"{name}.{attention}"] = "ulysses_attention"
    for config in configs:
        if vars(config).get(_IMPLEMENTATION_KEY) is not None:
            _set_implementation(handle, config, sequence_parallel.IMPLEMENTATION)
