"""The decoder layers' RMSNorms, and the one after them, through the rms_norm op where a probe proves the module
computes exactly that: autograd through transformers' eager RMSNorm holds five [tokens, h] float32 gradients at once,
the peak of an applied step (BENCHMARKS.md, "Live tensors at the peak")."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

from ..rms_norm import rms_norm
from .probes import _PROBE_ERRORS, _PROBE_SCALES

if TYPE_CHECKING:
    from .handle import OffloadHandle

_EPS_NAMES = ("variance_epsilon", "eps")  # LlamaRMSNorm's and its copies'; Qwen3-Next's, T5's and others'


def _eps_name(norm: nn.Module) -> str | None:
    return next((name for name in _EPS_NAMES if isinstance(getattr(norm, name, None), float)), None)


def _is_candidate(norm: nn.Module) -> bool:
    """A module shaped as an RMSNorm: one 1-D ``weight``, no children, a float epsilon (a LayerNorm has a bias)."""
    parameters = dict(norm.named_parameters())
    weight = parameters.get("weight")
    return (
        len(parameters) == 1
        and weight is not None
        and weight.dim() == 1
        and weight.is_floating_point()
        and not any(True for _ in norm.children())
        and _eps_name(norm) is not None
    )


def _norm_problem(norm: nn.Module) -> str | None:
    """None when ``norm``'s own forward gives what the op gives, bit for bit, on random weights and inputs at the
    probe's scales (training mode); else why not."""
    if "forward" in vars(norm) or norm._forward_hooks or norm._forward_pre_hooks:
        return "it has a forward of its own or hooks, which the op would bypass"
    weight = norm.weight
    if weight.is_meta:
        return "its weight is on the meta device, so apply cannot probe it"
    eps = getattr(norm, _eps_name(norm))
    training = norm.training
    with torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(0)
        params = {"weight": 1 + 0.5 * torch.randn(weight.shape).to(weight.device, weight.dtype)}
        x = torch.randn(2, 3, weight.shape[0])
        norm.train(True)
        try:
            for scale in _PROBE_SCALES:
                inputs = (x * scale).to(weight.device, weight.dtype)
                want = functional_call(norm, params, (inputs,))
                if not torch.equal(rms_norm(inputs, params["weight"], eps), want):
                    return f"its output differs from rms_norm's (eps={eps}) on a probe input"
        except _PROBE_ERRORS as error:
            return f"its forward cannot be probed ({type(error).__name__}: {error})"
        finally:
            norm.train(training)
    return None


def _fuse_norm(handle: OffloadHandle, name: str, norm: nn.Module) -> None:
    problem = _norm_problem(norm)
    if problem is not None:
        handle.norms[name] = f"module: {problem}"
        return
    original, eps_name = norm.forward, _eps_name(norm)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(x, torch.Tensor) or x.dtype != norm.weight.dtype:
            return original(*args, **kwargs)  # another call than the probe's (a bf16 x against float32 weights)
        return rms_norm(x, norm.weight, getattr(norm, eps_name))

    handle._patch(f"{name}.forward", norm, "forward", forward)
    handle.norms[name] = "rms_norm"


def fuse_norms(handle: OffloadHandle, model: nn.Module, names: list[str], layers: nn.ModuleList) -> None:
    """Each layer's RMSNorm children, and those beside the layers (the final norm), through the op where it computes
    them; ``handle.norms`` says which, and why not the others."""
    for name, layer in zip(names, layers):
        for child_name, child in layer.named_children():
            if _is_candidate(child):
                _fuse_norm(handle, f"{name}.{child_name}", child)
    owner_path = handle.layer_path.rpartition(".")[0]
    owner = model.get_submodule(owner_path)
    for child_name, child in owner.named_children():
        if child is not layers and _is_candidate(child):
            _fuse_norm(handle, f"{owner_path}.{child_name}" if owner_path else child_name, child)
