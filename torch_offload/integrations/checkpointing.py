"""A module's forward under offloaded non-reentrant checkpointing, and the key/value caches it must not carry."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..activations import checkpoint as offloaded_checkpoint
from ..activations import offload_activations, restore_kept
from .compiled import _random_ops_saved
from .handle import _ABSENT, _Patch, _put

if TYPE_CHECKING:
    from .handle import OffloadHandle


# The names a decoder layer's or attention module's key/value cache goes by (transformers from 5.24,
# 5.0-5.23 and 4.x, older 4.x, GPT-2 before 4.5x).
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


class _CacheArguments:
    """The key/value cache arguments of calls to one forward, by keyword or by position.

    A checkpointed call must not carry a cache: backward's recomputation would append its
    keys and values a second time (a cache of twice the sequence, or a size mismatch when
    the recomputed attention masks with it). Such calls run un-checkpointed; a training
    layer's call with an empty cache runs without it instead, as transformers' own gradient
    checkpointing does (``drop_empty``).
    """

    def __init__(self, forward):
        positional = [
            p.name
            for p in inspect.signature(forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.where = {name: positional.index(name) for name in _CACHE_ARGUMENTS if name in positional}

    def _present(self, args: tuple, kwargs: dict) -> list[tuple[str | int, Any]]:
        found = [(name, kwargs[name]) for name in _CACHE_ARGUMENTS if kwargs.get(name) is not None]
        found += [(i, args[i]) for i in self.where.values() if i < len(args) and args[i] is not None]
        return found

    def found(self, args: tuple, kwargs: dict) -> bool:
        return bool(self._present(args, kwargs))

    def drop_empty(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        present = self._present(args, kwargs)
        if not present or not all(
            callable(getattr(cache, "get_seq_length", None)) and cache.get_seq_length() == 0 for _, cache in present
        ):
            return args, kwargs  # a cache that holds tokens (a continuation) is kept: the call is not checkpointed
        args, kwargs = list(args), dict(kwargs, use_cache=False) if "use_cache" in kwargs else dict(kwargs)
        for where, _ in present:
            (args if isinstance(where, int) else kwargs)[where] = None
        if not torch.compiler.is_compiling():  # dynamo cannot trace warnings.warn
            warn_empty_cache_dropped(stacklevel=3)
        return tuple(args), kwargs


def warn_empty_cache_dropped(stacklevel: int) -> None:
    """What a training call that asks for a key/value cache is told: the checkpointed layers run without it."""
    warnings.warn(
        "torch_offload.apply: checkpointed layers in training mode run with use_cache=False and no "
        "key/value cache (backward's recomputation would fill it a second time), as transformers' "
        "gradient checkpointing does; the model returns an empty cache",
        UserWarning,
        stacklevel=stacklevel,
    )


_running = threading.local()  # the checkpointed calls whose forward or recompute runs now, innermost last


class _Recompute:
    """One checkpointed call's forward, with the attributes apply patched as that forward found them.

    Backward calls it again to recompute the call, which must compute what the forward did
    (torch.utils.checkpoint checks the tensors it saves). If those attributes changed in between
    (``handle.remove()``, a module replaced), what the forward found is put back for that call
    alone, and what is there now right after.

    With a ``keeper`` (the offload tier of apply's layers), what its attention forwards computed
    (``attention_once``) is kept through that tier for the recompute, which runs none of them again: in layers kept
    on the device too, whose inputs stay there.
    """

    __slots__ = ("forward", "attributes", "found", "keeper", "kept", "taken")

    def __init__(self, forward, patches: list[_Patch], keeper: offload_activations | None = None):
        self.forward = forward
        self.attributes = list({(id(p.store), p.key): (p.store, p.key) for p in patches}.values())
        self.found = None
        self.keeper = keeper
        self.kept = [] if keeper is not None else None
        self.taken = None  # in a recompute: how many kept results it has taken

    @contextlib.contextmanager
    def _running(self):
        stack = _running.__dict__.setdefault("calls", [])
        stack.append(self)
        try:
            yield
        finally:
            stack.pop()

    def attention(self, attend):
        """attend()'s tensors: computed and kept in the forward, the kept ones in a recompute, in call order."""
        if self.taken is None:
            tensors = attend()
            self.kept.append([self.keeper.keep(t) for t in tensors])
            return tensors
        if self.taken == len(self.kept):
            raise RuntimeError(
                "torch_offload: backward's recomputation of a checkpointed layer ran more attention calls than its "
                "forward did (the layer computed something else the second time)"
            )
        self.taken += 1
        return tuple(restore_kept(t) for t in self.kept[self.taken - 1])

    def _current(self) -> list:
        return [store.get(key, _ABSENT) for store, key in self.attributes]

    def _set(self, values: list) -> None:
        for (store, key), value in zip(self.attributes, values):
            _put(store, key, value)

    def __call__(self, *args, **kwargs):
        now = self._current()
        if self.found is None:  # the forward
            self.found = now
            with self._running():
                return self.forward(*args, **kwargs)
        # Backward's recomputation, named in a profile (bench/gpu_llama.py --profile splits a step's time by it).
        with torch.profiler.record_function("torch_offload.recompute"), self._running():
            self.taken = 0
            if all(a is b for a, b in zip(now, self.found)):
                return self.forward(*args, **kwargs)
            self._set(self.found)
            try:
                return self.forward(*args, **kwargs)
            finally:
                self._set(now)


def attention_once(attend):
    """attend()'s tensors (an attention's output and log-sum-exps) for the innermost checkpointed call running now:
    computed in its forward and kept through its offload tier, then handed back to its recompute, so that backward
    runs no attention forward again. None outside such a call (attend() is not called): the caller recomputes."""
    if torch.compiler.is_compiling():  # the compiled backward recomputes from its own graph
        return None
    calls = getattr(_running, "calls", None)
    call = calls[-1] if calls else None
    return None if call is None or call.kept is None else call.attention(attend)


def _checkpoint_forward(handle: OffloadHandle, module: nn.Module, offload: bool):
    original = module.forward
    caches = _CacheArguments(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing is saved for backward
            return original(*args, **kwargs)
        if caches.found(args, kwargs):  # recomputation would fill the cache a second time
            return original(*args, **kwargs)
        if torch.compiler.is_compiling():  # the compiled backward recomputes from its own graph
            if handle.context is not None:
                # apply's graph hooks offload in compiled graphs (see compiled._offload_in_compiled_graphs).
                return offloaded_checkpoint(original, *args, offload=False, context_fn=_random_ops_saved, **kwargs)
            return offloaded_checkpoint(original, *args, offload=offload, **kwargs)
        return offloaded_checkpoint(
            # Without a tier, keeping every layer's attention output would double what the checkpoints hold.
            _Recompute(original, handle._patches, keeper=handle.context),
            *args,
            offload=offload,
            **kwargs,
        )

    return forward
