"""Each layer's MLP in shards of tokens: through the tiled_mlp op, or its own forward through tiled_apply."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

from ..tiled_mlp import TiledMLP, _first_argument, _module_in_shards
from .experts import _experts_problem, _tile_experts
from .probes import _PROBE_ERRORS, _close, _finite, _probing, _unprobeable
from .recorded_blocks import tile_recorded_block

if TYPE_CHECKING:
    from .handle import OffloadHandle


def _recorded_outputs(model: nn.Module) -> dict[type, str]:
    """Module classes whose outputs transformers records during forward (``_can_record_outputs``), by what they are."""
    recorded = {}
    for module in model.modules():
        for key, specs in (getattr(type(module), "_can_record_outputs", None) or {}).items():
            for spec in specs if isinstance(specs, list) else [specs]:
                target = getattr(spec, "target_class", spec)
                if isinstance(target, type):
                    recorded[target] = key
    return recorded


def _op_computes(mlp: nn.Module, tiled: TiledMLP) -> bool:
    """Whether ``tiled`` computes what ``mlp``'s own forward does (in training mode, as apply is for training)."""
    extra = set(dict(mlp.named_children())) - set(tiled.layer_names) - {"act_fn", "activation_fn"}
    if extra or "forward" in vars(mlp) or mlp._forward_hooks or mlp._forward_pre_hooks:
        return False  # dropout, norms, hooks, accelerate's forward: all would be bypassed by the op
    try:
        with _probing(mlp, training=True) as (params, inputs):
            mine = {name: params[name] for name, _ in tiled.named_parameters()}
            for x in inputs.values():
                want = functional_call(mlp, params, (x,))
                if _finite(want) and not _close(functional_call(tiled, mine, (x,)), want):
                    return False
            return True
    except _PROBE_ERRORS:
        return False


def _row_wise_problem(mlp: nn.Module) -> str | None:
    """None when ``mlp`` maps [rows, h] to [rows, h_out] row by row (what tiled_apply needs); else why not."""
    try:
        with _probing(mlp, training=False) as (params, inputs):  # eval: dropout would make every run differ
            for x in inputs.values():
                whole = functional_call(mlp, params, (x,))
                if not isinstance(whole, torch.Tensor) or whole.shape[:2] != x.shape[:2]:
                    return "its output for a [batch, tokens, h] input is not one [batch, tokens, h_out] tensor"
                if not _finite(whole):
                    continue
                rows = x.reshape(6, -1)
                want = whole.reshape(6, *whole.shape[2:])
                halves = torch.cat(
                    [functional_call(mlp, params, (rows[:3],)), functional_call(mlp, params, (rows[3:],))]
                )
                if not (_close(functional_call(mlp, params, (rows,)), want) and _close(halves, want)):
                    return "its output for a token depends on the other tokens"
    except _PROBE_ERRORS as error:
        return f"its forward does not take [tokens, h] rows ({type(error).__name__}: {error})"
    return None


_STREAMED = "streamed: a mixture of experts whose saved tensors come back from the tier one at a time"


def _tile_dense_children(handle: OffloadHandle, name: str, mlp: nn.Module, num_shards: int) -> None:
    """The children of a mixture of experts that the tiled_mlp op computes exactly (a shared expert), through it."""
    for child_name, child in mlp.named_children():
        try:
            tiled = TiledMLP(child, num_shards)
        except ValueError:
            continue
        if _op_computes(child, tiled):
            handle._patch(f"{name}.{child_name}", mlp, child_name, tiled)


def _tile_mlp(
    handle: OffloadHandle,
    name: str,
    layer: nn.Module,
    attribute: str,
    num_shards: int,
    recorded: dict[type, str],
    streamed: bool,
) -> None:
    """The layer's MLP (its child ``attribute``, named ``name``) in shards of tokens, or why not in mlp_tiling;
    ``streamed``: what the layer saves goes to the offload tier, and backward does not recompute its MLP."""
    mlp = getattr(layer, attribute)
    recorded_keys = {key for module in mlp.modules() for cls, key in recorded.items() if isinstance(module, cls)}
    recorded_key = min(recorded_keys, default=None)
    problem = _unprobeable(mlp)
    if problem is None and recorded_key is not None:
        # A mixture of experts whose router logits the model records for the aux loss: its experts (and dense MLPs
        # beside them) go in shards, or, where they take no shards of tokens, the whole block with its logits whole.
        problem = _experts_problem(mlp)
        if problem is None and streamed:
            # Measured (BENCHMARKS.md, "Mixture of experts"): backward then takes the block's saved tensors back one
            # at a time, which holds less than a shard of its experts rebuilt whole.
            handle.mlp_tiling[name] = _STREAMED
            return
        if problem is None:
            _tile_experts(handle, name, mlp, num_shards)
            _tile_dense_children(handle, name, mlp, num_shards)
            handle.mlp_tiling[name] = "tiled_experts"
            return
        if tile_recorded_block(handle, name, mlp, recorded_keys, num_shards) is None:
            handle.mlp_tiling[name] = "tiled_block"
            return
        if streamed:
            handle.mlp_tiling[name] = _STREAMED
            return
        problem = f"the model records its {recorded_key}, and {problem}"
    if problem is not None:
        handle.mlp_tiling[name] = f"untiled: {problem}"
        return
    try:
        tiled = TiledMLP(mlp, num_shards)  # same Linear objects under the same names
    except ValueError:
        tiled = None  # LoRA-wrapped, quantized, Conv1D (GPT-2): the generic path
    if tiled is not None and _op_computes(mlp, tiled):
        handle._patch(name, layer, attribute, tiled)
        handle.mlp_tiling[name] = "tiled_mlp"
        return
    problem = _row_wise_problem(mlp)
    if problem is not None:
        handle.mlp_tiling[name] = f"untiled: {problem}"
        return
    original = mlp.forward
    input_name = next(iter(inspect.signature(original).parameters))

    @functools.wraps(original)
    def tiled_forward(*args, **kwargs):
        x, args, kwargs = _first_argument(input_name, args, kwargs)
        return _module_in_shards(lambda rows: original(rows, *args, **kwargs), mlp, x, num_shards)

    handle._patch(f"{name}.forward", mlp, "forward", tiled_forward)
    handle.mlp_tiling[name] = "tiled_apply"
