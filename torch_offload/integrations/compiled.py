"""Offloading under torch.compile: graph saved-tensor hooks by layer, and the random ops checkpoints save."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..compiled_offload import graph_hooks
from .handle import OffloadHandle, bound_forward

_LAYER = "torch_offload_layer"  # the index of the decoder layer a compiled graph's node belongs to


def _save_random_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # A recomputed random op makes AOTAutograd save its random state, which it cannot pass through
    # graph saved-tensor hooks (partitioners.functionalize_rng_ops names the backward's input
    # rng_state_output_N, and maybe_inline_graph_saved_tensors_hooks looks it up by the forward's name).
    # Saved instead, their outputs go through the hooks like the layer's inputs.
    if torch.Tag.nondeterministic_seeded in op.tags:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_random_ops_saved = functools.partial(create_selective_checkpoint_contexts, _save_random_ops)


def _offload_in_compiled_graphs(handle: OffloadHandle, model: nn.Module, offloaded: set[int]) -> None:
    """Under torch.compile, the saved activations of the ``offloaded`` layers go to the handle's store.

    The model's forward enters graph saved-tensor hooks (see compiled_offload) and is left to
    eager (dynamo compiles what it calls), since hooks must be entered outside compiled code.
    Called eagerly, the hooks keep every tensor as it is, and the layers' own contexts offload.
    """

    def offloads(node: torch.fx.Node) -> bool:
        # As in eager, where the layer that saves a tensor (uses it) decides, not the one that made it.
        return any(user.meta.get("custom", {}).get(_LAYER) in offloaded for user in node.users)

    pack, unpack = graph_hooks(handle.context, offloads)
    original = model.forward

    @torch._dynamo.disable(recursive=False)
    @functools.wraps(original)
    def forward(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return original(*args, **kwargs)

    handle._patch("forward", model, "forward", bound_forward(model, forward, dynamo_skips=True))
