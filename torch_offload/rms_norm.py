"""transformers' RMSNorm as one op (``torch.ops.offload.rms_norm``), whose backward holds only the gradients
it returns: ``rms_norm``."""

from __future__ import annotations

import torch

from . import _require_tensor

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2, -1) + eps)).to(x.dtype)`` over ``x``'s last dimension, as transformers'
    ``LlamaRMSNorm`` (and the families that copy it) computes it: in float32 for bf16/fp16 ``x``, the normalized
    rows rounded to ``x``'s dtype before the weight's product. ``weight`` is ``[h]`` in ``x``'s dtype.

    Differentiable in ``x`` and ``weight`` (no double backward). Forward saves only its inputs; backward
    recomputes each row's scale and works in chunks of rows (4 MiB of float32), so that beside its inputs it
    holds only the gradients it returns, where autograd through the eager module holds five ``x``-sized
    float32 tensors at once.
    """
    _require_tensor(x, "rms_norm", "x")
    _require_tensor(weight, "rms_norm", "weight")
    if x.is_nested:  # a jagged tensor's own rms_norm handler answers before the op's refusal (registration/layouts)
        raise RuntimeError("rms_norm: x is a nested tensor; expected a dense (strided) tensor")
    return torch.ops.offload.rms_norm(x, weight, float(eps))
