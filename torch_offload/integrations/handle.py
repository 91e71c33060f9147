"""The handle apply() returns, and the patches it undoes: every attribute apply sets is a _Patch."""

from __future__ import annotations

import collections
import functools
import inspect
import types
import weakref
from typing import Any

import torch
from torch import nn

from .. import masking
from ..activations import offload_activations
from .implementations import _IMPLEMENTATION_KEY
from .report import format_report, report

_ABSENT = object()
# Modules that live handles have patched, with those handles in the order they did: apply()
# on the same layers again is refused, since two stacked patches could not be undone in any
# order; a module above two applied stacks (its forward patched by each) has two handles.
_PATCHED: weakref.WeakKeyDictionary[nn.Module, list[OffloadHandle]] = weakref.WeakKeyDictionary()


def _refuse_patched(names: list[str], layers: nn.ModuleList) -> None:
    """ValueError naming the first of ``layers`` of which an earlier apply() changed the layer or a module in it
    (its MLP, its attention, a mixture's experts)."""
    for name, layer in zip(names, layers):
        if any(module in _PATCHED for module in layer.modules()):
            raise ValueError(
                f"torch_offload.apply: {name} is already changed by an earlier apply(); "
                "call that handle's remove() first"
            )


def _put(store: dict, key: str, value: Any) -> None:
    """``store[key] = value``; no ``key`` in ``store`` when ``value`` is ``_ABSENT``."""
    if value is _ABSENT:
        store.pop(key, None)
    else:
        store[key] = value


def bound_forward(owner: nn.Module, forward, dynamo_skips: bool = False) -> types.MethodType:
    """``forward`` (a closure that takes the call's arguments) bound to ``owner`` as its class's forward is, with
    that signature: code that patches ``module.forward.__func__`` after apply (TRL 1.9's SFTTrainer) finds one.
    ``dynamo_skips``: ``forward`` is ``torch._dynamo.disable(recursive=False)``'d, and so is the method."""

    @functools.wraps(forward, updated=())  # not forward's attributes: torch._dynamo.disable's are its own
    def method(self, *args, **kwargs):
        return forward(*args, **kwargs)

    # A forward that wraps a bound one (functools.wraps) has that method's signature, without self; inspect would
    # give it self where the method's function carries a __signature__ (ours below, TRL's), so it asks the method.
    signature = inspect.signature(inspect.unwrap(forward, stop=lambda f: isinstance(f, types.MethodType)))
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    if dynamo_skips:
        method = torch._dynamo.disable(method, recursive=False)
    return types.MethodType(method, owner)


def _unless_its_class_changed(owner: nn.Module, forward, class_forward):
    """``forward``, or, once ``owner``'s class's forward is no longer ``class_forward`` (the module's own before
    apply, patched since by a library or a user), that new forward: what plain PyTorch would run, where apply's was
    proven against the old one. ``class_forward`` None: the module had a forward of its own, which apply's calls."""
    if class_forward is None:
        return forward

    @functools.wraps(forward)
    def unless_changed(*args, **kwargs):
        current = type(owner).forward
        if current is not class_forward:
            return current(owner, *args, **kwargs)
        return forward(*args, **kwargs)

    return unless_changed


class _Patch:
    """One attribute of one module set by apply: ``store`` is the module's ``__dict__`` or ``_modules``."""

    def __init__(self, name: str, owner: nn.Module, store: dict, key: str, value: Any):
        self.name, self.owner, self.store, self.key, self.value = name, owner, store, key, value
        self.previous = store.get(key, _ABSENT)  # e.g. the forward accelerate's hooks installed
        store[key] = value

    def intact(self) -> bool:
        return self.store.get(self.key, _ABSENT) is self.value

    def undo(self) -> None:
        _put(self.store, self.key, self.previous)


class _StateBeforeApply:
    """An applied module's ``__getstate__``: its state with apply's patches undone.

    ``copy.deepcopy``, ``copy.copy`` and pickling (``torch.save(model)``) get the state
    through it, so a copy is the module as it was before apply (its own forward, its own
    MLP): patched forwards are closures over the original modules, and a copy running them
    would compute with, and train, the original's parameters. The module itself stays applied.
    A ``__getstate__`` the module had as an attribute of its own (``own``) still makes the
    state, and ``remove()`` puts it back.
    """

    def __init__(self, owner: nn.Module):
        self.owner_ref = weakref.ref(owner)
        self.own = vars(owner).get("__getstate__", _ABSENT)

    def __call__(self) -> Any:
        owner = self.owner_ref()
        state = type(owner).__getstate__(owner) if self.own is _ABSENT else self.own()
        if not isinstance(state, dict):  # a format of the module's own: apply cannot find its patches there
            return state
        state = dict(state)
        if state.get("__getstate__", _ABSENT) is self:
            _put(state, "__getstate__", self.own)
        if "_modules" in state:
            state["_modules"] = dict(state["_modules"])
        patches = [patch for handle in _PATCHED[owner] for patch in handle._patches]
        for patch in reversed(patches):
            where = state.get("_modules", {}) if patch.store is owner._modules else state
            if patch.owner is owner and where.get(patch.key, _ABSENT) is patch.value:  # not replaced since
                _put(where, patch.key, patch.previous)
        return state


class OffloadHandle:
    """What ``apply`` changed; ``remove()`` puts the model back exactly as it was.

    - ``layer_path``, ``layers``: the decoder layers found (e.g. ``"model.language_model.layers"``).
    - ``offload``: the tier the layers' saved activations go to ("cpu", "disk" or None).
    - ``loss``: ``"linear_cross_entropy"`` when a call with labels computes the loss with that op
      (no logits), ``"unfused: <why>"`` when the model keeps its own, ``"no output layer: ..."``
      for a model that has no LM head, ``"off"`` with ``loss=False``.
    - ``mlp_tiling``: for each layer's MLP, by name: ``"tiled_mlp"`` (the op), ``"tiled_apply"``
      (its own forward in shards), ``"tiled_experts"`` (a mixture of experts: its experts in shards),
      ``"tiled_block"`` (a mixture of experts whose experts take no shards: the whole block in shards of
      tokens, its router logits returned whole),
      ``"streamed: <why>"`` (a mixture of experts in a layer whose saved tensors go to the tier and are not
      recomputed: backward takes them back one at a time, which holds less) or ``"untiled: <why>"``.
    - ``checkpointing``: for each layer, by name, what backward recomputes: ``"layer"``,
      ``"attention"`` (the rest of what it saves is offloaded) or ``"none"``.
    - ``attention``: for each layer's attention module, by name: ``"attention_block"`` (the op,
      where a call allows it; with ``sequence_parallel``, over the group), ``"ulysses_attention"``
      (with ``sequence_parallel``: the module's own forward, its core attention through that op) or
      ``"module: <why not>"``.
    - ``norms``: each RMSNorm apply found (each layer's, the one after the layers), by name: ``"rms_norm"``
      (the op) or ``"module: <why not>"``.
    - ``layer_loop``: ``"apply's"`` where apply runs the loop over the decoder layers (layer_loop.py), else
      ``"the model's own: <why>"``.
    - ``route``: the one route apply installed (plan.py): ``"chunk-recurrent step"`` (the fused loss and the step's
      forward, nothing on the layers) or ``"layers' path"`` (everything above and below).
    - ``chunk_recurrent``: ``"on"`` where training calls with labels run the chunk-recurrent step
      (chunk_recurrent_route.py), else ``"off: <why>"``; ``chunk_recurrent_calls`` counts the calls it ran.
    - ``mask_fallbacks``: calls for which transformers built its dense ``[batch, 1, T, T]`` mask
      although the model's masks are apply's segment ids (``torch_offload.masking``), by reason.

    ``print(handle)`` shows it all per decoder layer (identical neighbours in one row), with the reason
    for each part left as the model had it; ``handle.report()`` returns the same as data.
    """

    def __init__(
        self, layer_path: str, layers: nn.ModuleList, offload: str | None, context: offload_activations | None
    ):
        self.layer_path = layer_path
        self.layers = layers
        self.offload = offload
        self.context = context
        self.mlp_tiling: dict[str, str] = {}
        self.checkpointing: dict[str, str] = {}
        self.attention: dict[str, str] = {}
        self.loss = "off"
        self.norms: dict[str, str] = {}
        self.sequence_parallel: str | None = None  # the name of apply()'s sequence-parallel group
        self.layer_loop = "the model's own"  # or "apply's" (layer_loop.py), or "the model's own: <why>"
        self.route = "layers' path"  # or "chunk-recurrent step" (plan.py)
        self.chunk_recurrent = "off"  # or "on" (chunk_recurrent_route.py), or "off: <why>"
        self.chunk_recurrent_calls = 0  # training calls the chunk-recurrent step ran
        self._sequence_parallel_ranks = 1
        # For the report: the model's class, apply's options, the offloaded layers' indices, what the masks are.
        self._model_name = ""
        self._options: dict[str, Any] = {}
        self._offloaded: set[int] = set()
        self._masks = "the model's own"
        self._removed = False  # remove() ran: the report says so
        self._patches: list[_Patch] = []
        # Each module whose forward apply patched: its class's forward where that was the module's before apply.
        self._class_forwards: dict[nn.Module, Any] = {}
        # (config, its attention implementation before, the one apply set)
        self._attention_implementations: list[tuple[Any, Any, str]] = []

    @property
    def tiled_mlps(self) -> int:
        """MLPs computed by the tiled_mlp op."""
        return sum(how == "tiled_mlp" for how in self.mlp_tiling.values())

    @property
    def attention_blocks(self) -> int:
        """Attention modules computed by the attention_block op."""
        return sum(how == "attention_block" for how in self.attention.values())

    @property
    def tiled_applies(self) -> int:
        """MLPs computed by the generic tiled_apply."""
        return sum(how == "tiled_apply" for how in self.mlp_tiling.values())

    @property
    def mask_fallbacks(self) -> dict[str, int]:
        counts = collections.Counter()
        for config, _, _ in self._attention_implementations:
            counts.update(masking.fallbacks(config))
        return dict(counts)

    def report(self) -> dict[str, Any]:
        """What each decoder layer got, as ``print(handle)`` shows it: ``"layers"`` is a list of rows, one per
        run of identical layers, each with its layer indices, ``"mlp"``, ``"attention"``, ``"recompute"``,
        ``"saved"`` and ``"why"`` (by column, the reason a part is left as the model had it); beside it the
        model's ``"loss"``, ``"masks"`` and ``"sequence_parallel"``."""
        return report(self)

    def __str__(self) -> str:
        return format_report(self.report())

    def stats(self) -> dict[str, int]:
        """The offload context's counters (empty without offloading)."""
        return self.context.stats() if self.context is not None else {}

    def _patch(self, name: str, owner: nn.Module, key: str, value: Any) -> None:
        if key == "forward" and not isinstance(value, types.MethodType):
            before = self._class_forwards.setdefault(owner, None if "forward" in vars(owner) else type(owner).forward)
            value = bound_forward(owner, _unless_its_class_changed(owner, value, before))
        store = owner._modules if key in owner._modules else vars(owner)
        self._patches.append(_Patch(name, owner, store, key, value))
        if owner not in _PATCHED:
            vars(owner)["__getstate__"] = _StateBeforeApply(owner)
            _PATCHED[owner] = []
        if self not in _PATCHED[owner]:
            _PATCHED[owner].append(self)

    def _undo_last_patch(self) -> None:
        patch = self._patches.pop()
        patch.undo()
        if not any(p.owner is patch.owner for p in self._patches):
            _PATCHED[patch.owner].remove(self)
            if not _PATCHED[patch.owner]:
                del _PATCHED[patch.owner]
                ours = vars(patch.owner).get("__getstate__")
                if isinstance(ours, _StateBeforeApply):  # not replaced since
                    _put(vars(patch.owner), "__getstate__", ours.own)

    def remove(self) -> None:
        """Restores every attribute apply set; refuses, changing nothing, if one was replaced since.

        A backward still to come recomputes with apply's forwards all the same (``_Recompute``)."""
        replaced = [
            p.name
            for i, p in enumerate(self._patches)
            if not p.intact()
            and not any(
                q.store is p.store and q.key == p.key and q.previous is p.value  # wrapped by apply
                for q in self._patches[i + 1 :]
            )
        ]
        replaced += [
            f"{type(config).__name__}._attn_implementation"
            for config, _, ours in self._attention_implementations
            if vars(config).get(_IMPLEMENTATION_KEY) != ours
        ]
        if replaced:
            raise RuntimeError(
                f"torch_offload: handle.remove(): {', '.join(replaced)} changed after apply() "
                "(another wrapper?); undo that change first"
            )
        while self._patches:
            self._undo_last_patch()
        self._removed = True
        while self._attention_implementations:
            config, previous, _ = self._attention_implementations.pop()
            _put(vars(config), _IMPLEMENTATION_KEY, previous)
            masking.forget(config)
