"""The probes that prove a module's own forward computes what apply would replace it with."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

# What apply proves before it replaces a forward (docs/apply.md: "What apply() checks"):
# - Structure decides what it can: the exact module types the op reads (plain nn.Linear
#   projections, a known activation), no hooks or instance forwards, and every config option
#   known to change the arithmetic (clip_qkv, attention soft-capping...) that the op lacks.
# - A probe decides the rest: the module's own forward, run at apply time on random weights
#   (so that zero-initialized or trained weights cannot hide a difference), must give what
#   the op gives, at each of several input scales on its own, so that a clamp, a cap or a
#   threshold that only large activations reach shows. A scale at which the module's own
#   output is not finite (float16 overflow) proves nothing and is skipped.

_PROBE_RTOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # relative L2 error; 1e-4 in float32/float64
# Inputs of O(1), O(16) and O(256) per element: weights are scaled so that each projection keeps its input's
# scale, so a clamp or a cap below ~100x the typical activation is reached.
_PROBE_SCALES = (1.0, 16.0, 256.0)
_PROBE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, AttributeError)  # a forward that cannot run on it


def _input_width(mlp: nn.Module) -> int | None:
    for module in mlp.modules():
        width = getattr(module, "in_features", None)  # nn.Linear and the LoRA / quantized linears
        if width is None:
            width = getattr(module, "nx", None)  # transformers' Conv1D (GPT-2)
        if width is None and module is not mlp:  # the MLP's own hidden_dim may be its width (XLM's)
            width = getattr(module, "hidden_dim", None)  # transformers' mixture-of-experts routers and experts
        if isinstance(width, int):
            return width
    return None


def _unprobeable(mlp: nn.Module) -> str | None:
    floating = [p for p in mlp.parameters() if p.is_floating_point()]
    if not floating or _input_width(mlp) is None:
        return "apply cannot tell its weights' dtype and its input width to probe it"
    if any(p.is_meta for p in floating):
        return "its weights are on the meta device, so apply cannot probe it"
    return None


@contextlib.contextmanager
def _probing(mlp: nn.Module, training: bool):
    """Random weights and random [2, 3, h] inputs for ``mlp``, one per probe scale; its modes and the
    random state are put back."""
    like = next(p for p in mlp.parameters() if p.is_floating_point())
    width = _input_width(mlp)
    modes = [(m, m.training) for m in mlp.modules()]
    with torch.random.fork_rng(devices=[like.device] if like.device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(0)
        params = {
            name: torch.randn_like(p) / (p.shape[-1] if p.dim() else 1) ** 0.5  # a layer keeps x's scale
            for name, p in mlp.named_parameters()
            if p.is_floating_point()
        }
        x = torch.randn(2, 3, width)
        mlp.train(training)
        try:
            yield params, {scale: (x * scale).to(like.device, like.dtype) for scale in _PROBE_SCALES}
        finally:
            for module, mode in modes:
                module.training = mode


def _finite(output: Any) -> bool:
    return isinstance(output, torch.Tensor) and bool(output.isfinite().all())


def _close(got: Any, want: torch.Tensor) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    rtol = _PROBE_RTOL.get(want.dtype, 1e-4)
    return bool((got.float() - want.float()).norm() <= rtol * want.float().norm())
