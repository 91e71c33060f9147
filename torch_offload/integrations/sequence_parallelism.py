"""apply(sequence_parallel=...): the group, and the model's attention over its ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .. import sequence_parallel
from .implementations import _IMPLEMENTATION_KEY, _configs, _set_implementation
from .layers import _attention_of

if TYPE_CHECKING:
    from .handle import OffloadHandle

# The families tested over ranks (test_sequence_parallel.py); mixtures of experts, whose masks are segment ids
# too, are not yet.
_SEQUENCE_PARALLEL_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "olmo2", "granite", "smollm3", "cohere", "glm4"}
)


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


def _attend_over_ranks(
    handle: OffloadHandle, model: nn.Module, names: list[str], layers: nn.ModuleList, group: Any
) -> None:
    """The model's attention over ``group``'s ranks: its attention implementation becomes
    sequence_parallel.IMPLEMENTATION (ulysses_attention for the modules' own forwards) and each attention
    module is told the group; modules already through attention_block run it with the group."""
    configs = _configs(model)
    for config in configs:
        implementation = vars(config).get(_IMPLEMENTATION_KEY)
        if implementation is None:  # a composite config (a VLM's) whose parts have their own
            continue
        if implementation == "eager":
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__} has 'eager' attention, which "
                "gives a query with no key to attend (a left-padded row's pads) the mean of its whole row's "
                "values, later tokens included, where ulysses_attention gives 0 as SDPA does; load the model "
                "with attn_implementation='sdpa'"
            )
        if implementation != "sdpa" or getattr(config, "model_type", None) not in _SEQUENCE_PARALLEL_MODEL_TYPES:
            raise ValueError(
                f"torch_offload.apply: sequence_parallel supports the attention of "
                f"{', '.join(sorted(_SEQUENCE_PARALLEL_MODEL_TYPES))} models with 'sdpa' "
                f"attention; {type(config).__name__} has model_type "
                f"{getattr(config, 'model_type', None)!r} and attention {implementation!r}"
            )
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _ROPE_OF_THE_CALLS_POSITIONS:
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__}'s rotary embedding "
                f"({rope.get('rope_type', rope.get('type'))!r}) scales with the largest position of a "
                "call, which differs between ranks"
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
        handle._patch(
            f"{name}.{attention}.{sequence_parallel.GROUP_ATTRIBUTE}",
            getattr(layer, attention),
            sequence_parallel.GROUP_ATTRIBUTE,
            group.group_name,
        )
        if handle.attention.get(f"{name}.{attention}") != "attention_block":  # not the op with the group
            handle.attention[f"{name}.{attention}"] = "ulysses_attention"
    for config in configs:
        if vars(config).get(_IMPLEMENTATION_KEY) is not None:
            _set_implementation(handle, config, sequence_parallel.IMPLEMENTATION)
