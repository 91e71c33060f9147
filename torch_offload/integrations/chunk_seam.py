"""Where the chunk-recurrent step (chunk_recurrent.py) meets the model's own modules: an attention implementation,
registered with transformers (its ``AttentionInterface`` and ``AttentionMaskInterface``), that every family's
attention module calls with its own queries, keys and values, after its own projections, norms and rotary
embedding. While the step runs, the model's configs name it (``running``), and the seam attends a chunk of queries
to every chunk of keys and values up to it (chunk_attention.py), keeping what backward reads in the step's file.

Its mask function builds no mask: the step knows the batch's documents and rows (``Segments``), and it reads only
how far transformers' mask lets a query reach: a sliding window, which the seam computes with the scores the
attention module passes on (soft-capped, with sinks), or Llama 4's attention chunks, which cut the segments. The
seam refuses by name (``Unsupported``) whatever else would change attention (dropout, a call that is not causal, an
argument it does not know), so that a probe or a call fails loudly rather than differ.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

from .. import masking
from .chunk_attention import Heads, attend, attend_backward

__all__ = ["IMPLEMENTATION", "Unsupported", "running"]

IMPLEMENTATION = "torch_offload_chunks"
# What transformers' attention modules pass their attention function beside q, k, v and the mask, which changes
# nothing here: the call's own arguments handed down (positions, cache flags), and flash kernels' options.
_HARMLESS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "is_causal", "target_dtype"})

_current = threading.local()  # the running step's seam on this thread


class Unsupported(RuntimeError):
    """What a call of the seam asks for that the step does not compute."""


class Reach:
    """The mask function's answer where transformers composed a reach: ``kind`` "a sliding window" or "an attention
    chunk" (masking._describe), of ``size`` tokens."""

    def __init__(self, kind: str, size: int):
        self.kind, self.size = kind, size


class StepAttention:
    """The seam's state in one step: its file, the batch's segments, the most keys a query sees (``reach``), each
    attention module's layer, and the chunk and pass (forward, or backward's recomputation) now running.

    A layer may attend with the very keys and values an earlier layer passed (Gemma 3n's layers past its sharing
    point, handed them by the decoder): forward finds it by identity (``shares``), keeps them once, under the earlier
    layer, and backward adds the later layer's share of their gradients to the earlier one's."""

    def __init__(self, store, segments, reach: int, layer_of: dict[int, int]):
        self.store, self.segments, self.reach, self.layer_of = store, segments, reach, layer_of
        self.chunk, self.backward = 0, False
        self.called: set[int] = set()  # layers whose attention ran in the current pass of the current chunk
        self.shares: dict[int, int] = {}  # layer: the earlier layer whose keys and values it attends with
        self._passed: dict[int, tuple] = {}  # this pass: layer -> weak references to the keys and values it passed
        self._handing_on: dict[int, set] = {}  # layer: the (mapping, key) entries it sets to its keys and values

    def start(self, chunk: int, backward: bool) -> None:
        self.chunk, self.backward, self.called, self._passed = chunk, backward, set(), {}

    def keys_of(self, layer: int, key, value) -> int:
        """The layer whose keys and values ``layer`` attends with: in forward, an earlier layer that passed these very
        tensors in this chunk's pass, else itself, the same in every chunk; in backward, forward's."""
        if self.backward:
            return self.shares.get(layer, layer)
        source = next((i for i, (k, v) in self._passed.items() if k() is key and v() is value), layer)
        self._passed[layer] = (weakref.ref(key), weakref.ref(value))
        if self.chunk == 0 and source != layer:
            self.shares[layer] = source
        if self.shares.get(layer, layer) != source:
            raise Unsupported(f"layer {layer} attends with another layer's keys and values in some chunks only")
        return source

    def hand_on(self, layer: int, name: str, key, value) -> None:
        """Forward: ``layer`` set ``name[key]`` (a mapping the decoder hands every layer) to ``value`` for the layers
        after it. Backward recomputes one layer at a time, and can set again only the keys and values its attention
        passed (handed_on)."""
        k, v = self._passed.get(layer, (lambda: None, lambda: None))
        if not (isinstance(value, tuple) and len(value) == 2 and k() is value[0] and v() is value[1]):
            raise Unsupported(
                f"layer {layer} hands {name}[{key!r}] on to the layers after it, which the step, recomputing one "
                "layer at a time, cannot hand on again"
            )
        self._handing_on.setdefault(layer, set()).add((name, key))

    def handed_on(self, layer: int) -> list:
        """Backward: what ``layer`` handed on in forward, (name, key, its keys and values of this chunk), again."""
        if layer not in self._handing_on:
            return []
        keys_and_values = tuple(t[None] for t in self.keys_and_values(layer)(self.chunk))
        return [(name, key, keys_and_values) for name, key in sorted(self._handing_on[layer], key=repr)]

    def finish(self, layers: int) -> None:
        """Every layer's attention ran through the seam in this chunk's pass (not, say, a forward of its own)."""
        missed = sorted(set(range(layers)) - self.called)
        if missed:
            raise Unsupported(f"layer {missed[0]}'s attention did not call the attention implementation")

    def keys_and_values(self, layer: int):
        return lambda chunk: (self.store.read(("k", layer, chunk)), self.store.read(("v", layer, chunk)))

    def read_ahead(self, layer: int):
        """The disk tier starts reading a chunk's keys and values while the chunk before is computed with."""

        def read_ahead(chunk):
            self.store.prefetch(("k", layer, chunk))
            self.store.prefetch(("v", layer, chunk))

        return read_ahead

    def forward(self, layer: int, keys_layer: int, heads: Heads, q, k, v):
        """One chunk's attention output ``[heads, C, dv]``, its keys and values (those of ``keys_layer``, kept once),
        output and log-sum-exp kept."""
        self.store.settle()  # the layer before's writes: what is being written stays a layer's
        if keys_layer == layer:
            self.store.write(("k", layer, self.chunk), k)
            self.store.write(("v", layer, self.chunk), v)
        earlier = self.keys_and_values(keys_layer)

        def keys_and_values(chunk):  # this chunk's are at hand (another layer's too: the very tensors it passed)
            return (k, v) if chunk == self.chunk else earlier(chunk)

        out, log_sum_exp = attend(heads, self.segments, self.chunk, q, keys_and_values, self.read_ahead(keys_layer))
        self.store.write(("out", layer, self.chunk), out)
        self.store.write(("lse", layer, self.chunk), log_sum_exp)
        return out


@contextlib.contextmanager
def running(step: StepAttention, configs: list):
    """``configs`` name the seam while the step runs (the model's own implementation back after, whatever
    happens)."""
    register()
    before = [(config, vars(config).get(_KEY)) for config in configs]
    previous, _current.step = getattr(_current, "step", None), step
    try:
        for config, _ in before:
            vars(config)[_KEY] = IMPLEMENTATION
        yield step
    finally:
        _current.step = previous
        for config, implementation in before:
            vars(config)[_KEY] = implementation


_KEY = "_attn_implementation_internal"  # where a transformers config keeps its attention implementation


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs) -> tuple[Any, None]:
    """The attention function of IMPLEMENTATION: ``[1, heads, C, d]`` queries (keys and values ``[1, kv heads, C,
    d]``) of the running chunk, as transformers' attention modules pass them; ``[1, C, heads, dv]`` back."""
    step = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError(f"torch_offload: the attention implementation {IMPLEMENTATION!r} runs inside the step only")
    layer = step.layer_of.get(id(module))
    if layer is None:
        raise Unsupported(f"{type(module).__name__} is not one of the layers' attention modules the step found")
    heads = _heads(module, query, key, value, attention_mask, dropout, scaling, step.reach, kwargs)
    if layer in step.called:
        raise Unsupported(f"layer {layer}'s attention ran twice in one chunk's pass")
    step.called.add(layer)
    keys_layer = step.keys_of(layer, key, value)
    q, k, v = query[0], key[0], value[0]
    if step.backward:
        out = _ChunkAttention.apply(step, (layer, keys_layer), heads, q, k, v, heads.sinks)
    else:
        out = step.forward(layer, keys_layer, heads, q, k, v)
    return out.transpose(0, 1)[None], None


def _heads(module, query, key, value, mask, dropout, scaling, reach, kwargs) -> Heads:
    """The call's Heads with its score mods (a window at least ``reach`` keys long changes nothing: none), or
    Unsupported naming what the step does not compute."""
    if dropout:
        raise Unsupported(f"attention dropout ({dropout}) in training: backward's recomputation would draw others")
    kwargs = dict(kwargs)
    window, softcap, sinks = kwargs.pop("sliding_window", None), kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
    for name, given in kwargs.items():
        if given is not None and not (name in _HARMLESS and not (name == "is_causal" and given is False)):
            raise Unsupported(f"its attention passes {name}={_shown(given)}, which the step does not compute")
    if not getattr(module, "is_causal", True):
        raise Unsupported(f"{type(module).__name__} is not causal")
    if mask is not None and not isinstance(mask, Reach):
        raise Unsupported(f"its mask is a {type(mask).__name__}, which the step does not compute")
    attention_chunk = mask.size if isinstance(mask, Reach) and mask.kind == "an attention chunk" else None
    if isinstance(mask, Reach) and mask.kind == "a sliding window":
        if window is not None and window != mask.size:
            raise Unsupported(f"its attention passes sliding_window={window} where its mask's window is {mask.size}")
        window = mask.size
    if query.shape[0] != 1 or query.shape[1] % key.shape[1] or key.shape[:3] != value.shape[:3]:
        raise Unsupported(f"queries {list(query.shape)}, keys {list(key.shape)}, values {list(value.shape)}")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise Unsupported(f"its sinks are {list(sinks.shape)}, not one per head")
    return Heads(
        query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        query.shape[1] // key.shape[1],
        softcap=float(softcap) if softcap else None,
        window=window if window is not None and window < reach else None,
        sinks=sinks,
        attention_chunk=attention_chunk,
    )


def _shown(value) -> str:
    return f"<{type(value).__name__}>" if isinstance(value, torch.Tensor) else repr(value)


class _ChunkAttention(torch.autograd.Function):
    """A chunk's attention in backward's recomputation: its output as forward kept it; its gradient the queries'
    whole, and the keys' and values' with every later chunk's share (added into the file as those chunks ran, since
    backward runs the chunks last to first); this chunk's shares of earlier chunks' go into the file."""

    @staticmethod
    def forward(ctx, step, layers, heads, q, k, v, sinks):
        ctx.step, (ctx.layer, ctx.keys_layer), ctx.heads, ctx.chunk = step, layers, heads, step.chunk
        out = step.store.read(("out", ctx.layer, step.chunk))  # in q's dtype (StepAttention.forward's)
        ctx.save_for_backward(q, k, v, out)  # backward's, not read again
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        step, layer, keys_layer, chunk, store = ctx.step, ctx.layer, ctx.keys_layer, ctx.chunk, ctx.step.store
        store.settle()
        q, k, v, out = ctx.saved_tensors
        earlier = step.keys_and_values(keys_layer)

        def keys_and_values(keys_chunk):  # another layer's: as forward kept them, whatever the recomputation got
            return (k, v) if keys_chunk == chunk and keys_layer == layer else earlier(keys_chunk)

        log_sum_exp = store.read(("lse", layer, chunk))
        own = {}

        def add_share(keys_chunk, share_k, share_v):
            if keys_chunk == chunk and keys_layer == layer:
                own.update(k=share_k, v=share_v)
            else:  # an earlier chunk's, or an earlier layer's keys and values, whose backward comes later
                _add_into(store, ("grad k", keys_layer, keys_chunk), share_k)
                _add_into(store, ("grad v", keys_layer, keys_chunk), share_v)

        grad_q, grad_sinks = attend_backward(
            ctx.heads,
            step.segments,
            chunk,
            q,
            grad_out,
            out,
            log_sum_exp,
            keys_and_values,
            add_share,
            step.read_ahead(keys_layer),
        )
        grads = [None, None]  # another layer's keys and values: their gradient is all in the file
        if keys_layer == layer:
            grads = []
            for name, tensor in (("k", k), ("v", v)):
                total = own.get(name, grad_q.new_zeros(tensor.shape))
                if store.has((f"grad {name}", layer, chunk)):  # the later chunks' (and later layers') shares
                    total = total + store.pop((f"grad {name}", layer, chunk))
                grads.append(total.to(tensor.dtype))
        sinks = ctx.heads.sinks
        grad_sinks = None if grad_sinks is None or not ctx.needs_input_grad[6] else grad_sinks.to(sinks.dtype)
        return None, None, None, grad_q.to(q.dtype), *grads, grad_sinks


def _add_into(store, key, share) -> None:
    store.write(key, store.pop(key) + share if store.has(key) else share)


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, **kwargs):
    """The mask function of IMPLEMENTATION: None for plain causal attention (the step's segments do the rest), the
    Reach of a sliding window or attention chunks, which the seam checks."""
    try:
        reach, _ = masking._describe(mask_function, masking._FACTORIES)
    except masking._Unknown:
        raise Unsupported(
            "its mask is one transformers composed from other parts (overlays, bidirectional blocks)"
        ) from None
    return None if reach is None else Reach(reach[0], reach[1])


def register() -> None:
    """Registers IMPLEMENTATION with transformers (registering again changes nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not masking._FACTORIES:
        masking._FACTORIES.update(masking._find_factories())
    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, mask)
