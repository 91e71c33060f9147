"""A decoder layer's RMSNorm and the tiled MLP it feeds through one op, ``rms_norm_tiled_mlp``: the norm's output
is then neither saved for backward nor its gradient ever whole, one hidden vector per token less at an applied
step's peak (the MLP's backward: BENCHMARKS.md, "Live tensors at the peak") and one less written per layer.

The pairing is decided per call, from the tensors, not from the layer's code: a norm apply put through the
rms_norm op marks its output with where it came from, and the MLP, given exactly that output, unchanged since,
computes the same rows from the norm's input instead. The output's own graph stays as it was, so whatever else
reads it still gets its gradient through rms_norm; the two gradients add up in the norm's input, as they would.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..tiled_mlp import TiledMLP, _first_argument

if TYPE_CHECKING:
    from .handle import OffloadHandle

_MARK = "_torch_offload_normed_from"


def mark_normed(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Records on ``y`` that it is ``rms_norm(x, weight, eps)`` as of now (the tensors' versions)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or type(y) is not torch.Tensor:
        # Without grad nothing is saved to spare; compiled graphs keep the two ops (a Python attribute on a
        # traced tensor is not part of the graph).
        return
    # A weak reference: the mark must not keep the norm's input alive after the layer drops it.
    setattr(y, _MARK, (weakref.ref(x), x._version, y._version, weight, weight._version, eps))


def _normed_from(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(x, weight, eps) when ``y`` is still ``rms_norm(x, weight, eps)`` and the op may compute it again from x
    (no tensor changed in place since, no autocast, which would run the MLP in another dtype than the norm)."""
    mark = getattr(y, _MARK, None)
    if mark is None:
        return None
    x_ref, x_version, y_version, weight, weight_version, eps = mark
    x = x_ref()
    if (
        x is None
        or (x._version, y._version, weight._version) != (x_version, y_version, weight_version)
        or torch.is_autocast_enabled(x.device.type)
    ):
        return None
    return x, weight, eps


def _forward_taking_norm(mlp: TiledMLP):
    original = mlp.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        x, rest, rest_kwargs = _first_argument(mlp.input_name, args, kwargs)
        source = None if rest or rest_kwargs or torch.compiler.is_compiling() else _normed_from(x)
        if source is None:
            return original(*args, **kwargs)
        return mlp.forward_after_norm(*source)

    return forward


def pair_norms_with_mlps(handle: OffloadHandle, model: nn.Module) -> None:
    """Each MLP the tiled_mlp op computes takes its norm along when given a marked norm output."""
    for name, how in handle.mlp_tiling.items():
        mlp = model.get_submodule(name)
        if how == "tiled_mlp" and isinstance(mlp, TiledMLP):
            handle._patch(f"{name}.forward", mlp, "forward", _forward_taking_norm(mlp))
