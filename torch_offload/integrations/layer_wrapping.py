"""Each decoder layer's new forward: checkpointed (whole, or its attention alone) and offloaded."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from .attention import _fuse_attention
from .checkpointing import _CacheArguments, _checkpoint_forward
from .compiled import _LAYER
from .layers import _attention_of

if TYPE_CHECKING:
    from .handle import OffloadHandle


def _wrap_layer(
    handle: OffloadHandle,
    index: int,
    name: str,
    layer: nn.Module,
    checkpoint: str | None,
    offload_layer: bool,
    fuse_attention: bool,
) -> None:
    context = handle.context if offload_layer else None
    original = layer.forward
    caches = _CacheArguments(original)
    if context is None:  # checkpointed, activations kept where they are
        handle.checkpointing[name] = "layer"
        if fuse_attention:
            _fuse_attention(handle, name, layer, checkpointed=False)
        checkpointed = _checkpoint_forward(handle, layer, offload=False)

        @functools.wraps(original)
        def checkpointed_without_cache(*args, **kwargs):
            if torch.is_grad_enabled() and layer.training:
                args, kwargs = caches.drop_empty(args, kwargs)
            return checkpointed(*args, **kwargs)

        handle._patch(f"{name}.forward", layer, "forward", checkpointed_without_cache)
        return
    attention = _attention_of(layer) if checkpoint == "attention" else None
    if attention is not None:
        # Only attention is recomputed in backward; everything else the layer saves goes to
        # the offload tier. Backward then holds one attention's activations, not a layer's.
        module = getattr(layer, attention)
        if fuse_attention:
            _fuse_attention(handle, name, layer, checkpointed=True)
        if handle.attention.get(f"{name}.{attention}") != "attention_block":
            handle._patch(
                f"{name}.{attention}.forward", module, "forward", _checkpoint_forward(handle, module, offload=True)
            )
        run = original
    else:
        if fuse_attention:
            _fuse_attention(handle, name, layer, checkpointed=False)
        run = _checkpoint_forward(handle, layer, offload=True) if checkpoint is not None else original
    handle.checkpointing[name] = "attention" if attention is not None else "layer" if checkpoint else "none"

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing is saved for backward
            return original(*args, **kwargs)
        if checkpoint is not None and layer.training:
            args, kwargs = caches.drop_empty(args, kwargs)
        if checkpoint is not None and caches.found(args, kwargs):  # see _CacheArguments
            return original(*args, **kwargs)
        if torch.compiler.is_compiling():
            # dynamo cannot enter the context: apply's graph hooks offload, by the layer marked on each node.
            with torch.fx.traceback.annotate({_LAYER: index}):
                return run(*args, **kwargs)
        with context:
            return run(*args, **kwargs)

    handle._patch(f"{name}.forward", layer, "forward", forward)
