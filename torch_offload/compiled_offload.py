"""Offloading saved activations inside ``torch.compile``'d graphs.

dynamo cannot enter saved-tensor hooks inside a compiled region, but AOTAutograd inlines
the hooks active when compiled code is called if both are ``torch.fx.GraphModule``s
(torch/_functorch/_aot_autograd/graph_compile.py, ``maybe_inline_graph_saved_tensors_hooks``):
it traces the pack hook once per tensor the forward graph saves for backward (its
intermediates, by default), appends that to the forward graph, and the traced unpack hook
to the start of the backward graph. The hooks built here trace to the
``torch_offload::store_pack`` / ``store_unpack`` ops, which hand each tensor to an
``offload_activations`` store: the same tier, host budget, prefetch and counters as in eager.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.fx

from .activations import _saved_as_is, _unpack, offload_activations

__all__ = ["graph_hooks"]

_stores: weakref.WeakValueDictionary[int, offload_activations] = weakref.WeakValueDictionary()
_saved: dict[int, object] = {}  # ticket number -> the store's SavedActivation
_numbers = itertools.count()


@torch.library.custom_op("torch_offload::store_pack", mutates_args=())
def store_pack(tensor: torch.Tensor, store: int) -> torch.Tensor:
    """Hands ``tensor`` to the store ``store`` (an ``id`` of ``graph_hooks``); returns its ticket."""
    number = next(_numbers)
    # A copy: inductor reuses a dead tensor's buffer for later ones without bumping its version, so
    # the store would take the same storage and version for a different tensor (a false dedup hit)
    # and could find its bytes overwritten before they are written out.
    _saved[number] = _stores[store]._store_pack(tensor.clone())
    ticket = torch.tensor([number])
    weakref.finalize(ticket, _saved.pop, number, None)  # freed with the graph, backward or not
    return ticket


@store_pack.register_fake
def _(tensor, store):
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("torch_offload::store_unpack", mutates_args=())
def store_unpack(
    ticket: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The tensor ``store_pack`` took, as it was (``size``, ``stride``, ``dtype``, ``device`` are its)."""
    return _saved[int(ticket)].unpack()


@store_unpack.register_fake
def _(ticket, size, stride, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _hook(forward: Callable) -> torch.fx.GraphModule:
    # A GraphModule (what AOTAutograd inlines) whose forward is ours: AOTAutograd traces it per
    # tensor. Its graph only keys AOTAutograd's cache, which cannot know the store behind it: a
    # call of a Python function makes the cache step aside (autograd_cache.check_node_safe).
    graph = torch.fx.Graph()
    graph.output(graph.call_function(forward, (graph.placeholder("saved"),)))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    module.forward = forward
    return module


def _hint(size) -> int:
    return size.node.hint if isinstance(size, torch.SymInt) else size


def graph_hooks(context: offload_activations, offloads: Callable[[torch.fx.Node], bool]):
    """Pack and unpack hooks for ``torch.autograd.graph.saved_tensors_hooks`` around compiled calls.

    In compiled graphs a saved tensor goes to ``context``'s store when ``offloads(node)``
    (its node in the forward graph) and the store's own rules (``min_bytes``, CPU tensors)
    allow; called eagerly (outside compiled code) the hooks keep tensors as they are.
    """
    _stores[id(context)] = context

    def pack(tensor):
        # Imported here, not with the package: it imports dynamo, 1.3 s of every `import torch_offload` on 2 cores.
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

        traced = _get_saved_tensor_hook_context()  # set only while AOTAutograd inlines the hooks
        if traced is None:
            return _saved_as_is(tensor)
        nbytes = _hint(tensor.numel()) * tensor.element_size()  # decided once, for the shapes compiled
        if (
            (context._keep_cpu_tensors and tensor.device.type == "cpu")
            or nbytes < context._min_bytes
            or not offloads(traced["_node"])
        ):
            return tensor
        return (
            store_pack(tensor, id(context)),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
        )

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if len(packed) == 2:
            return _unpack(packed)
        return store_unpack(*packed)

    return _hook(pack), _hook(unpack)
