"""A block whose outputs the model records (a mixture of experts returning its router logits) in shards of tokens.

Where a mixture's experts cannot run in shards of their own (Llama 4's take every expert's rows one after the
other: ``[experts x tokens, h]``), the whole block can, when each token's output and router logits depend on that
token's row alone. The shards run through tiled_apply's autograd function, as one tensor: each shard's outputs
concatenated along their last dimension (in their promoted dtype, so the casts back are exact), split again after.
So the recorded outputs come back whole, with their gradient, and the auxiliary loss computed from them is the
model's; backward recomputes a shard at a time, and the layer saves the block's input alone. transformers records
them with forward hooks on modules inside the block (Llama 4's router), which would record each shard's: while the
shards run, those hooks see a collector of their own, and the real one gets the whole outputs they recorded, each
found among the block's outputs (a probe checks that each is one).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call

from ..tiled_mlp import _first_argument, _module_in_shards
from .experts import _MIN_SHARD_ROWS, _SHARD_BYTES
from .probes import _PROBE_ERRORS, _close, _finite, _probing

if TYPE_CHECKING:
    from .handle import OffloadHandle


def _collector_variable() -> Any:
    """transformers' context variable of the outputs being recorded (5.16 to 5.24), or None."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector if hasattr(_active_collector, "get") and hasattr(_active_collector, "reset") else None


@contextlib.contextmanager
def _recording_into(variable: Any, collected: dict | None):
    token = variable.set(collected)
    try:
        yield collected
    finally:
        variable.reset(token)


def _recorded_indices(collected: dict, outputs: tuple) -> dict[str, list[int]] | None:
    """For each key, the indices among ``outputs`` of what the hooks recorded, or None if one is not an output."""
    indices = {}
    for key, tensors in collected.items():
        found = [next((i for i, out in enumerate(outputs) if out is t), None) for t in tensors]
        if None in found:
            return None
        indices[key] = found
    return indices


def _shard_count(x: torch.Tensor, block: nn.Module) -> int:
    """Shards of at most _SHARD_BYTES of the block's work (as a tiled experts module's): a row's activations taken
    as one element per row of each weight over h (a mixture whose experts all see every token, Llama 4's, counts
    them all), and two of width h."""
    h, rows = x.shape[-1], x.numel() // x.shape[-1]
    row_bytes = (sum(p.numel() for p in block.parameters()) // h + 2 * h) * x.element_size()
    budget = _SHARD_BYTES["cpu" if x.device.type == "cpu" else "accelerator"]
    return max(1, -(-rows // max(_MIN_SHARD_ROWS, budget // row_bytes)))


def _outputs_of(block: nn.Module, params: dict, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    out = functional_call(block, params, (x,))
    if not isinstance(out, tuple) or not out or not all(isinstance(t, torch.Tensor) for t in out):
        return None
    return out


def _block_problem(block: nn.Module, keys: set[str]) -> tuple[str | None, list[bool]]:
    """(None, for each output whether the block flattens [batch, tokens] to rows) when the block maps rows to a
    tuple of row tensors, token by token, and what the model records inside it (``keys``) is among them (probed
    on random weights); else (why not, [])."""
    variable = _collector_variable()
    if variable is None:
        return "apply cannot find transformers' recorder of outputs", []
    flattened = []
    try:
        with _probing(block, training=False) as (params, inputs):  # eval: dropout would make every run differ
            for x in inputs.values():
                with _recording_into(variable, {key: [] for key in keys}) as collected:
                    outputs = _outputs_of(block, params, x)
                if outputs is None or _recorded_indices(collected, outputs) is None:
                    return f"what the model records inside it ({', '.join(sorted(keys))}) is not its output", []
                whole = _outputs_of(block, params, x)
                rows = x.reshape(6, -1)
                flat = _outputs_of(block, params, rows)
                if whole is None or flat is None or len(whole) != len(flat):
                    return "its output is not a tuple of tensors", []
                if any(t.dim() != 2 or t.shape[0] != 6 for t in flat):
                    return "its outputs for [tokens, h] rows are not [tokens, width] each", []
                flattened = [t.shape[:2] != x.shape[:2] for t in whole]
                if any(t.shape[0] != 6 for t, f in zip(whole, flattened) if f):
                    return "its outputs for [batch, tokens, h] are neither that shape nor rows", []
                halves = [_outputs_of(block, params, part) for part in (rows[:3], rows[3:])]
                for i, want in enumerate(flat):
                    if not _finite(want):
                        continue
                    if not _close(torch.cat([halves[0][i], halves[1][i]]), want) or not _close(
                        whole[i].reshape(6, -1), want
                    ):
                        return "its outputs for a token depend on the other tokens", []
    except _PROBE_ERRORS as error:
        return f"its forward does not take [tokens, h] rows ({type(error).__name__}: {error})", []
    return None, flattened


def tile_recorded_block(
    handle: OffloadHandle, name: str, block: nn.Module, keys: set[str], num_shards: int
) -> str | None:
    """``block``'s forward in shards of tokens, its outputs and what the model records inside it (``keys``) whole
    (None), or why not."""
    problem, flattened = _block_problem(block, keys)
    if problem is not None:
        return problem
    original = block.forward
    input_name = next(iter(inspect.signature(original).parameters))
    variable = _collector_variable()

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        # Without gradients nothing is saved; under torch.compile tiled_apply's autograd function cannot be traced.
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        x, args, kwargs = _first_argument(input_name, args, kwargs)
        collected = variable.get()
        recording = [key for key in keys if collected is not None and key in collected]
        layout, indices = [], {}  # each output's (width, dtype), and where the recorded ones are, from a shard

        def joined(rows: torch.Tensor) -> torch.Tensor:
            with _recording_into(variable, {key: [] for key in recording}) as shard_records:
                outputs = original(rows, *args, **kwargs)
            layout[:] = [(t.shape[-1], t.dtype) for t in outputs]
            found = _recorded_indices(shard_records, outputs)
            if found is None:
                raise RuntimeError(f"torch_offload: {name} recorded a tensor that is not its output in shards")
            indices.update(found)
            common = functools.reduce(torch.promote_types, [t.dtype for t in outputs])
            return torch.cat([t.to(common) for t in outputs], dim=-1)

        shards = num_shards or _shard_count(x, block)
        parts = _module_in_shards(joined, block, x, shards).split([w for w, _ in layout], dim=-1)
        outputs = tuple(
            (part.reshape(-1, width) if flat else part).to(dtype)
            for part, (width, dtype), flat in zip(parts, layout, flattened)
        )
        for key in recording:
            collected[key].extend(outputs[i] for i in indices[key])
        return outputs

    handle._patch(f"{name}.forward", block, "forward", forward)
    return None
