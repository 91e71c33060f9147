"""transformers' RMSNorm as one op (``torch.ops.offload.rms_norm``), whose backward holds only the gradients
it returns: ``rms_norm``; and with the MLP after it, in shards of tokens: ``rms_norm_tiled_mlp``."""

from __future__ import annotations

import torch

from . import _require_tensor

__all__ = ["rms_norm", "rms_norm_tiled_mlp"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2, -1) + eps)).to(x.dtype)`` over ``x``'s last dimension, as transformers'
    ``LlamaRMSNorm`` (and the families that copy it) computes it: in float32 for bf16/fp16 ``x``, the normalized
    rows rounded to ``x``'s dtype before the weight's product. ``weight`` is ``[h]`` in ``x``'s dtype.

    Differentiable in ``x`` and ``weight`` (no double backward). Forward saves only its inputs; backward
    recomputes each row's scale and works in at most 32 chunks of rows (a number of kernel launches that does not
    grow with the tokens), so that beside its inputs it holds only the gradients it returns and a chunk's float32
    temporaries, where autograd through the eager module holds five ``x``-sized float32 tensors at once.
    """
    _require_tensor(x, "rms_norm", "x")
    _require_tensor(weight, "rms_norm", "weight")
    if x.is_nested:  # a jagged tensor's own rms_norm handler answers before the op's refusal (ops/common/op_rules.h)
        raise RuntimeError("rms_norm: x is a nested tensor; expected a dense (strided) tensor")
    return torch.ops.offload.rms_norm(x, weight, float(eps))


def rms_norm_tiled_mlp(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    activation: str = "silu",
    num_shards: int = 0,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """``tiled_mlp(rms_norm(x, norm_weight, norm_eps), w_gate, w_up, w_down, ...)`` with the norm computed shard by
    shard: forward saves ``x`` and the weights, not the norm's output, and backward takes the norm's gradient one
    shard at a time, so neither the norm's output nor its gradient ever exists as a ``[tokens, h]`` tensor. On the
    CPU the result is the two ops' bit for bit (the same rows' arithmetic), the gradients theirs up to the order in
    which the norm weight's gradient adds up; on CUDA close to theirs. Runs in its inputs' dtypes, under autocast
    too. Arguments as ``rms_norm`` and ``tiled_mlp`` take them.
    """
    for value, arg in ((x, "x"), (norm_weight, "norm_weight"), (w_gate, "w_gate"), (w_down, "w_down")):
        _require_tensor(value, "rms_norm_tiled_mlp", arg)
    return torch.ops.offload.rms_norm_tiled_mlp(
        x, norm_weight, float(norm_eps), w_gate, w_up, w_down, b_gate, b_up, b_down, activation, num_shards
    )
