"""One call for Hugging Face style causal LMs: ``torch_offload.apply(model)``.

Finds the decoder layers and their MLPs by structure (a ``ModuleList`` of layers that
each have an ``mlp``: Llama, Mistral, Qwen2/Qwen3, Gemma, Phi-3, GPT-2 and the
like), computes each MLP in shards of tokens, and runs each layer under offloaded
non-reentrant checkpointing. ``.remove()`` on the returned handle restores the model.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .activations import checkpoint as offloaded_checkpoint
from .activations import offload_activations
from .disk import disk_spill, disk_wait
from .tiled_mlp import TiledMLP, tiled_apply, tiled_mlp_num_shards

__all__ = ["apply", "OffloadHandle"]

_OFFLOAD_TIERS = ("cpu", "disk", None)


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and all(hasattr(m, "mlp") for m in module):
            return name, module
    raise ValueError(
        f"torch_offload.apply: found no decoder layers in {type(model).__name__}: looked for an nn.ModuleList "
        "whose every module has an `mlp` (model.model.layers in Llama/Mistral/Qwen/Gemma/Phi-3, "
        "model.transformer.h in GPT-2)"
    )


def _mlp_width(mlp: nn.Module) -> int:
    # The intermediate size, for the automatic shard count of tiled_apply.
    return max(max(p.shape) for p in mlp.parameters())


class OffloadHandle:
    """What ``apply`` changed; ``remove()`` puts the model back exactly as it was."""

    def __init__(self, layers: nn.ModuleList, context: offload_activations | None):
        self.layers = layers
        self.context = context
        self._undo: list[Callable[[], None]] = []
        self.tiled_mlps = 0  # MLPs computed by the tiled_mlp op
        self.tiled_applies = 0  # MLPs computed by the generic tiled_apply

    def stats(self) -> dict[str, int]:
        """The offload context's counters (empty without offloading)."""
        return self.context.stats() if self.context is not None else {}

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def _tile_mlp(handle: OffloadHandle, layer: nn.Module, num_shards: int) -> None:
    mlp = layer.mlp
    try:
        layer.mlp = TiledMLP(mlp, num_shards)  # same Linear objects under the same names
        handle.tiled_mlps += 1
        handle._undo.append(lambda: setattr(layer, "mlp", mlp))
        return
    except ValueError:
        pass  # LoRA-wrapped, quantized, fused gate_up_proj, Conv1D (GPT-2): the generic path
    original = mlp.forward

    def tiled_forward(x, *args, **kwargs):
        params = [p for p in mlp.parameters() if p.requires_grad]
        shards = num_shards or tiled_mlp_num_shards(x.numel() // x.shape[-1], _mlp_width(mlp), dtype=x.dtype)
        return tiled_apply(lambda rows: original(rows, *args, **kwargs), x, params, shards)

    mlp.forward = tiled_forward
    handle.tiled_applies += 1
    handle._undo.append(lambda: delattr(mlp, "forward"))


def _wrap_layer(handle: OffloadHandle, layer: nn.Module, use_checkpoint: bool, offload_layer: bool) -> None:
    original = layer.forward
    context = handle.context if offload_layer else None

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing is saved for backward
            return original(*args, **kwargs)
        if context is None:  # checkpointed, activations kept where they are
            return offloaded_checkpoint(original, *args, offload=False, **kwargs)
        with context:
            if use_checkpoint:
                return offloaded_checkpoint(original, *args, offload=True, **kwargs)
            return original(*args, **kwargs)

    layer.forward = forward
    handle._undo.append(lambda: delattr(layer, "forward"))


def apply(
    model: nn.Module,
    *,
    tiled_mlp: bool = True,
    checkpoint: bool = True,
    offload: str | None = "cpu",
    num_shards: int = 0,
    keep_last: int = 1,
    **offload_options,
) -> OffloadHandle:
    """Make ``model`` (a Hugging Face style causal LM) train with less memory, in place.

    - ``tiled_mlp``: every decoder layer's MLP runs in shards of tokens: through the
      ``tiled_mlp`` op (``TiledMLP``) for gate/up/down or fc1/fc2 ``nn.Linear`` MLPs,
      through ``tiled_apply`` for anything else (LoRA/PEFT-wrapped, quantized, fused
      gate_up_proj as in Phi-3, GPT-2's Conv1D). ``num_shards=0`` chooses per call.
    - ``checkpoint``: every decoder layer runs under non-reentrant checkpointing
      (only its inputs are saved; DDP-safe).
    - ``offload``: "cpu" sends saved activations of device tensors to host memory,
      "disk" sends every saved activation (CPU tensors included) to the disk tier;
      None keeps them in place. The last ``keep_last`` layers keep theirs on the
      device: backward needs them first.
    - ``offload_options`` go to ``offload_activations`` (``min_bytes``,
      ``max_host_bytes``, ``prefetch_bytes``, ``spill_directory``...).

    Returns a handle: ``handle.remove()`` restores the model, ``handle.stats()`` counts.
    """
    if offload not in _OFFLOAD_TIERS:
        raise ValueError(f"torch_offload.apply: offload must be one of {_OFFLOAD_TIERS}, got {offload!r}")
    if not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"torch_offload.apply: keep_last must be an int >= 0, got {keep_last!r}")
    if not isinstance(num_shards, int) or num_shards < 0:
        raise ValueError(f"torch_offload.apply: num_shards must be an int >= 0, got {num_shards!r}")
    _, layers = _find_layers(model)
    context = None
    if offload is not None:
        options = {"offload_cpu_tensors": offload == "disk", "module": model, **offload_options}
        context = offload_activations(tier=offload, **options)  # checks the directory at first use
        if offload == "disk":  # a spill directory that cannot be used fails here, not in the first step
            disk_wait(disk_spill(torch.zeros(1), directory=options.get("spill_directory"),
                                 allow_tmpfs=options.get("allow_tmpfs", False)))
    handle = OffloadHandle(layers, context)
    try:
        for index, layer in enumerate(layers):
            if tiled_mlp:
                _tile_mlp(handle, layer, num_shards)
            offload_layer = context is not None and index < len(layers) - keep_last
            if checkpoint or offload_layer:
                _wrap_layer(handle, layer, checkpoint, offload_layer)
    except BaseException:
        handle.remove()
        raise
    return handle
