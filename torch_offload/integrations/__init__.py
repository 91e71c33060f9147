"""One call for Hugging Face style causal LMs: ``torch_offload.apply(model)``.

Finds the language model's decoder layers by structure (a ``ModuleList`` of layers that
each have an ``mlp``, looked for inside ``model.get_decoder()`` where the model has one,
so that a vision tower's blocks are not mistaken for them), computes each MLP in shards
of tokens where a probe shows that this leaves its output unchanged, and runs each layer
under offloaded non-reentrant checkpointing (with the disk tier, only its attention is
recomputed and the rest of what it saves goes to disk). ``.remove()`` on the returned
handle restores the model.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import functools
import inspect
import itertools
import os
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import masking, sequence_parallel
from .._options import check_bool, check_int
from ..activations import checkpoint as offloaded_checkpoint
from ..activations import offload_activations
from ..attention_block import attention_block as attention_block_op
from ..causal_lm_loss import fuse_causal_lm_loss
from ..compiled_offload import graph_hooks
from ..disk import default_spill_directory, disk_spill, disk_wait, spill_directory_in_ram
from ..masking import is_segment_ids
from ..tiled_mlp import TiledMLP, _first_argument, _is_plain_linear, _module_in_shards

__all__ = ["apply", "OffloadHandle"]

_OFFLOAD_TIERS = ("auto", "cpu", "disk", None)
_CHECKPOINTS = ("layer", "attention")
_ABSENT = object()
# Modules that live handles have patched, with those handles in the order they did: apply()
# on the same layers again is refused, since two stacked patches could not be undone in any
# order; a module above two applied stacks (its forward patched by each) has two handles.
_PATCHED: weakref.WeakKeyDictionary[nn.Module, list[OffloadHandle]] = weakref.WeakKeyDictionary()


def _layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and all(hasattr(m, "mlp") for m in module)
    ]


def _decoder(model: nn.Module) -> nn.Module | None:
    # transformers' get_decoder() names the language model of a VLM (model.language_model).
    get_decoder = getattr(model, "get_decoder", None)
    if not callable(get_decoder):
        return None
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # transformers raises for a few exotic models
        return None
    return decoder if isinstance(decoder, nn.Module) else None


def _find_layers(model: nn.Module, path: str | None) -> tuple[str, nn.ModuleList]:
    if path is not None:
        try:
            layers = model.get_submodule(path)
        except AttributeError as error:
            raise ValueError(f"torch_offload.apply: layers={path!r}: {error}") from None
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(
                f"torch_offload.apply: layers={path!r} is a {type(layers).__name__}, not a non-empty nn.ModuleList"
            )
        return path, layers
    found = _layer_lists(model)
    if not found:
        raise ValueError(
            f"torch_offload.apply: found no decoder layers in {type(model).__name__}: looked for an nn.ModuleList "
            "whose every module has an `mlp` (model.model.layers in Llama/Mistral/Qwen/Gemma/Phi-3, "
            "model.transformer.h in GPT-2); name them with layers='path.to.layers'"
        )
    decoder = _decoder(model)
    inside = found if decoder is None else [(n, m) for n, m in found if any(m is d for d in decoder.modules())]
    if len(inside) == 1:
        return inside[0]
    where = "" if decoder is None else f" (of which {len(inside)} inside its decoder {type(decoder).__name__})"
    raise ValueError(
        f"torch_offload.apply: cannot tell which of {[n for n, _ in found]}{where} are the decoder layers of "
        f"{type(model).__name__}; name them with layers='path.to.layers'"
    )


def _recorded_outputs(model: nn.Module) -> dict[type, str]:
    """Module classes whose outputs transformers records during forward (``_can_record_outputs``), by what they are."""
    recorded = {}
    for module in model.modules():
        for key, specs in (getattr(type(module), "_can_record_outputs", None) or {}).items():
            for spec in specs if isinstance(specs, list) else [specs]:
                target = getattr(spec, "target_class", spec)
                if isinstance(target, type):
                    recorded[target] = key
    return recorded


def _on_accelerator(model: nn.Module) -> bool:
    return any(t.device.type not in ("cpu", "meta") for t in itertools.chain(model.parameters(), model.buffers()))


# ---------------------------------------------------------------------------------------------
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


def _op_computes(mlp: nn.Module, tiled: TiledMLP) -> bool:
    """Whether ``tiled`` computes what ``mlp``'s own forward does (in training mode, as apply is for training)."""
    extra = set(dict(mlp.named_children())) - set(tiled.layer_names) - {"act_fn", "activation_fn"}
    if extra or "forward" in vars(mlp) or mlp._forward_hooks or mlp._forward_pre_hooks:
        return False  # dropout, norms, hooks, accelerate's forward: all would be bypassed by the op
    try:
        with _probing(mlp, training=True) as (params, inputs):
            mine = {name: params[name] for name, _ in tiled.named_parameters()}
            for x in inputs.values():
                want = functional_call(mlp, params, (x,))
                if _finite(want) and not _close(functional_call(tiled, mine, (x,)), want):
                    return False
            return True
    except _PROBE_ERRORS:
        return False


def _row_wise_problem(mlp: nn.Module) -> str | None:
    """None when ``mlp`` maps [rows, h] to [rows, h_out] row by row (what tiled_apply needs); else why not."""
    try:
        with _probing(mlp, training=False) as (params, inputs):  # eval: dropout would make every run differ
            for x in inputs.values():
                whole = functional_call(mlp, params, (x,))
                if not isinstance(whole, torch.Tensor) or whole.shape[:2] != x.shape[:2]:
                    return "its output for a [batch, tokens, h] input is not one [batch, tokens, h_out] tensor"
                if not _finite(whole):
                    continue
                rows = x.reshape(6, -1)
                want = whole.reshape(6, *whole.shape[2:])
                halves = torch.cat(
                    [functional_call(mlp, params, (rows[:3],)), functional_call(mlp, params, (rows[3:],))]
                )
                if not (_close(functional_call(mlp, params, (rows,)), want) and _close(halves, want)):
                    return "its output for a token depends on the other tokens"
    except _PROBE_ERRORS as error:
        return f"its forward does not take [tokens, h] rows ({type(error).__name__}: {error})"
    return None


def _put(store: dict, key: str, value: Any) -> None:
    """``store[key] = value``; no ``key`` in ``store`` when ``value`` is ``_ABSENT``."""
    if value is _ABSENT:
        store.pop(key, None)
    else:
        store[key] = value


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
      (its own forward in shards) or ``"untiled: <why>"``.
    - ``checkpointing``: for each layer, by name, what backward recomputes: ``"layer"``,
      ``"attention"`` (the rest of what it saves is offloaded) or ``"none"``.
    - ``attention``: for each layer's attention module, by name: ``"attention_block"`` (the op,
      where a call allows it; with ``sequence_parallel``, over the group), ``"ulysses_attention"``
      (with ``sequence_parallel``: the module's own forward, its core attention through that op) or
      ``"module: <why not>"``.
    - ``mask_fallbacks``: calls for which transformers built its dense ``[batch, 1, T, T]`` mask
      although the model's masks are apply's segment ids (``torch_offload.masking``), by reason.
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
        self.sequence_parallel: str | None = None  # the name of apply()'s sequence-parallel group
        self._sequence_parallel_ranks = 1
        self._patches: list[_Patch] = []
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

    def stats(self) -> dict[str, int]:
        """The offload context's counters (empty without offloading)."""
        return self.context.stats() if self.context is not None else {}

    def _patch(self, name: str, owner: nn.Module, key: str, value: Any) -> None:
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
        while self._attention_implementations:
            config, previous, _ = self._attention_implementations.pop()
            _put(vars(config), _IMPLEMENTATION_KEY, previous)
            masking.forget(config)


def _sequence_parallel_group(sequence_parallel: Any, loss: bool) -> Any:
    """apply()'s sequence-parallel ProcessGroup (given as one or as a 1-D DeviceMesh), or None."""
    if sequence_parallel is None:
        return None
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(sequence_parallel, DeviceMesh):
        if sequence_parallel.ndim != 1:
            raise ValueError(
                f"torch_offload.apply: sequence_parallel is a {sequence_parallel.ndim}-D DeviceMesh; "
                'pass its sequence dimension (e.g. mesh["sp"])'
            )
        sequence_parallel = sequence_parallel.get_group()
    if not isinstance(sequence_parallel, ProcessGroup):
        raise TypeError(
            "torch_offload.apply: sequence_parallel must be a torch.distributed ProcessGroup or "
            f"DeviceMesh, got {type(sequence_parallel).__name__}"
        )
    if not loss:
        raise ValueError(
            "torch_offload.apply: sequence_parallel needs loss=True: the model's own loss would be "
            "each rank's mean, not the whole batch's"
        )
    return sequence_parallel


# Rotary embeddings whose frequencies transformers picks from a call's largest position (dynamic_rope_update).
_ROPE_OF_THE_CALLS_POSITIONS = ("dynamic", "longrope")


def _attend_over_ranks(
    handle: OffloadHandle, model: nn.Module, names: list[str], layers: nn.ModuleList, group: Any
) -> None:
    """The model's attention over ``group``'s ranks: its attention implementation becomes
    sequence_parallel.IMPLEMENTATION (ulysses_attention for the modules' own forwards) and each attention
    module is told the group; modules already through attention_block run it with the group."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")}
    for config in configs.values():
        implementation = vars(config).get(_IMPLEMENTATION_KEY)
        if implementation is None:  # a composite config (a VLM's) whose parts have their own
            continue
        if implementation == "eager":
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__} has 'eager' attention, which "
                "gives a query with no key to attend (a left-padded row's pads) the mean of its whole row's "
                "values, later tokens included, where ulysses_attention gives 0 as SDPA does; load the model "
                "with attn_implementation='sdpa'"
            )
        if implementation != "sdpa" or getattr(config, "model_type", None) not in _SEGMENT_MASK_MODEL_TYPES:
            raise ValueError(
                f"torch_offload.apply: sequence_parallel supports the attention of "
                f"{', '.join(sorted(_SEGMENT_MASK_MODEL_TYPES))} models with 'sdpa' "
                f"attention; {type(config).__name__} has model_type "
                f"{getattr(config, 'model_type', None)!r} and attention {implementation!r}"
            )
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _ROPE_OF_THE_CALLS_POSITIONS:
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {type(config).__name__}'s rotary embedding "
                f"({rope.get('rope_type', rope.get('type'))!r}) scales with the largest position of a "
                "call, which differs between ranks"
            )
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int) and heads % group.size():
            raise ValueError(
                f"torch_offload.apply: sequence_parallel: {heads} attention heads cannot be split over "
                f"{group.size()} ranks; the heads must be a multiple of the number of ranks"
            )
    if handle.loss != "linear_cross_entropy":
        raise ValueError(
            f"torch_offload.apply: sequence_parallel needs the fused loss, and this model's is "
            f"{handle.loss!r}: its own would be each rank's mean, not the whole batch's"
        )
    sequence_parallel.register()
    for name, layer in zip(names, layers):
        attention = _attention_of(layer)
        if attention is None:
            raise ValueError(f"torch_offload.apply: sequence_parallel: {name} has no single attention module")
        handle._patch(
            f"{name}.{attention}.{sequence_parallel.GROUP_ATTRIBUTE}",
            getattr(layer, attention),
            sequence_parallel.GROUP_ATTRIBUTE,
            group.group_name,
        )
        if handle.attention.get(f"{name}.{attention}") != "attention_block":  # not the op with the group
            handle.attention[f"{name}.{attention}"] = "ulysses_attention"
    for config in configs.values():
        if vars(config).get(_IMPLEMENTATION_KEY) is not None:
            _set_implementation(handle, config, sequence_parallel.IMPLEMENTATION)


# Where a transformers config keeps its attention implementation (the `_attn_implementation` property's value).
_IMPLEMENTATION_KEY = "_attn_implementation_internal"


class _ImplementationBeforeCopies(str):
    """The attention implementation apply gives a config: the name of ours, which copies and pickles
    (``copy.deepcopy``, ``torch.save(model)``) turn back into the one the config had before apply, as
    they do the modules' patches (_StateBeforeApply): a copy loads where torch_offload is not imported
    and runs as the model did before apply."""

    def __new__(cls, ours: str, before: str):
        name = super().__new__(cls, ours)
        name.before = before
        return name

    def __reduce__(self):
        return str, (self.before,)


def _set_implementation(handle: OffloadHandle, config: Any, implementation: str) -> None:
    previous = vars(config)[_IMPLEMENTATION_KEY]
    before = getattr(previous, "before", previous)  # a second handle's: the config's own from before the first
    handle._attention_implementations.append((config, previous, implementation))
    vars(config)[_IMPLEMENTATION_KEY] = _ImplementationBeforeCopies(implementation, before)


# The families whose modelling code is tested to hand the mask to the attention untouched
# (test_real_batches.py): segment ids reach no other, since code that computes with a mask
# (adds it, indexes it as [batch, 1, T, T]) would misread them without a word.
_SEGMENT_MASK_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2"})


def _use_segment_masks(handle: OffloadHandle, model: nn.Module) -> None:
    """Every config of the model whose attention is SDPA gets masking.IMPLEMENTATION: packed and padded
    batches then reach attention modules as segment ids, not as a dense [batch, 1, T, T] mask."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():  # attention not through transformers' AttentionInterface
        return
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")}
    configs = [
        c
        for c in configs.values()
        if vars(c).get(_IMPLEMENTATION_KEY) == "sdpa" and getattr(c, "model_type", None) in _SEGMENT_MASK_MODEL_TYPES
    ]
    if configs:
        masking.register()
    for config in configs:
        _set_implementation(handle, config, masking.IMPLEMENTATION)


def _tile_mlp(handle: OffloadHandle, name: str, layer: nn.Module, num_shards: int, recorded: dict[type, str]) -> None:
    mlp = layer.mlp
    recorded_key = next(
        (key for module in mlp.modules() for cls, key in recorded.items() if isinstance(module, cls)), None
    )
    # A mixture of experts' router logits, recorded for the aux loss: shards would split them and detach them.
    problem = f"the model records its {recorded_key}" if recorded_key is not None else _unprobeable(mlp)
    if problem is not None:
        handle.mlp_tiling[name] = f"untiled: {problem}"
        return
    try:
        tiled = TiledMLP(mlp, num_shards)  # same Linear objects under the same names
    except ValueError:
        tiled = None  # LoRA-wrapped, quantized, fused gate_up_proj, Conv1D (GPT-2): the generic path
    if tiled is not None and _op_computes(mlp, tiled):
        handle._patch(name, layer, "mlp", tiled)
        handle.mlp_tiling[name] = "tiled_mlp"
        return
    problem = _row_wise_problem(mlp)
    if problem is not None:
        handle.mlp_tiling[name] = f"untiled: {problem}"
        return
    original = mlp.forward
    input_name = next(iter(inspect.signature(original).parameters))

    @functools.wraps(original)
    def tiled_forward(*args, **kwargs):
        x, args, kwargs = _first_argument(input_name, args, kwargs)
        return _module_in_shards(lambda rows: original(rows, *args, **kwargs), mlp, x, num_shards)

    handle._patch(f"{name}.forward", mlp, "forward", tiled_forward)
    handle.mlp_tiling[name] = "tiled_apply"


def _attention_of(layer: nn.Module) -> str | None:
    """The name of the layer's one attention child module (``self_attn``, ``attn``...), or None."""
    names = [name for name, child in layer.named_children() if type(child).__name__.endswith("Attention")]
    return names[0] if len(names) == 1 else None


# ---------------------------------------------------------------------------------------------
# attention_block: an attention module is handed to the op only when it is made of exactly the
# four nn.Linear projections, is causal, and its own forward gives the op's result on random
# weights at apply time (which rules out soft-capped scores, per-head norms, partial rotary
# embeddings...). At call time the op runs only where the module would compute plain causal
# attention with SDPA: no mask (no padding, no sliding window in reach), no cache, no dropout.

# The projections' layouts the op takes: separate q/k/v, or one fused qkv_proj whose rows
# are q, then k, then v (Phi-3). Weights are read at each call, so the op sees the current ones.
_SEPARATE = ("q_proj", "k_proj", "v_proj", "o_proj")
_FUSED = ("qkv_proj", "o_proj")
_ATTENTION_ARGUMENTS = ("hidden_states", "position_embeddings", "attention_mask")  # and a cache (_CACHE_ARGUMENTS)
# Other arguments transformers passes an attention module that do not change what SDPA computes
# without a mask (packed sequences' position_ids make transformers build one). Any other argument
# sends the call to the module's own forward. DataCollatorWithFlattening(return_flash_attn_kwargs=True)
# adds the documents' cumulative lengths for flash attention (and seq_idx) beside their position_ids: SDPA reads the
# documents from the mask (position_ids) alone, and so does the op.
_NEUTRAL_ARGUMENTS = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "num_items_in_batch",
        "shift_labels",
        "output_attentions",
        "output_hidden_states",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
    }
)


# The attention implementations whose masks the op computes: SDPA's (where there is no mask) and
# masking.IMPLEMENTATION's (no mask, or segment ids).
_CAUSAL_IMPLEMENTATIONS = ("sdpa", masking.IMPLEMENTATION)


# Config options known to change attention's arithmetic in a way the op does not compute: OLMo's
# clip_qkv clamps q, k and v; Gemma 2's attn_logit_softcapping caps the scores. Read at apply time and
# at each call (a config changed after apply).
_CONFIG_CHANGES_ATTENTION = ("clip_qkv", "attn_logit_softcapping")


def _config_change(config: Any) -> str | None:
    name = next((n for n in _CONFIG_CHANGES_ATTENTION if getattr(config, n, None) is not None), None)
    return None if name is None else f"config.{name} is {getattr(config, name)!r}, which the op does not compute"


def _projection_layout(attention: nn.Module) -> tuple[str, ...] | None:
    children = dict(attention.named_children())
    return next(
        (
            layout
            for layout in (_SEPARATE, _FUSED)
            if set(children) == set(layout) and all(type(children[n]) is nn.Linear for n in layout)
        ),
        None,
    )


def _op_weights(attention: nn.Module, layout: tuple[str, ...], weights: dict[str, torch.Tensor | None]) -> dict:
    """The op's w_q, w_k, w_v, w_o and biases from the projections' ``weights`` (``"q_proj.weight"``...)."""
    if layout == _SEPARATE:
        return {
            **{f"w_{n[0]}": weights[f"{n}.weight"] for n in _SEPARATE},
            **{f"b_{n[0]}": weights.get(f"{n}.bias") for n in _SEPARATE},
        }
    qkv, bias = weights["qkv_proj.weight"], weights.get("qkv_proj.bias")
    q_rows = attention.config.num_attention_heads * attention.head_dim
    sizes = [q_rows, (qkv.shape[0] - q_rows) // 2, (qkv.shape[0] - q_rows) // 2]
    split = dict(zip("qkv", qkv.split(sizes)))  # views: the gradients reach qkv_proj.weight
    split_bias = dict(zip("qkv", bias.split(sizes) if bias is not None else (None,) * 3))
    return {
        **{f"w_{n}": split[n] for n in "qkv"},
        **{f"b_{n}": split_bias[n] for n in "qkv"},
        "w_o": weights["o_proj.weight"],
        "b_o": weights.get("o_proj.bias"),
    }


def _attention_block_problem(attention: nn.Module) -> str | None:
    """None when ``attention`` computes what the attention_block op computes; else why not."""
    layout = _projection_layout(attention)
    if layout is None:
        return "it is not made of exactly the nn.Linear q_proj, k_proj, v_proj (or qkv_proj) and o_proj"
    if any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in attention.modules()):
        return "it or a projection has hooks or a forward of its own (the op would bypass them)"
    parameters = inspect.signature(attention.forward).parameters
    if any(name not in parameters for name in _ATTENTION_ARGUMENTS) or not any(
        name in parameters for name in _CACHE_ARGUMENTS
    ):
        return f"its forward does not take {', '.join(_ATTENTION_ARGUMENTS)} and a key/value cache"
    head_dim, scaling = getattr(attention, "head_dim", None), getattr(attention, "scaling", None)
    if not isinstance(head_dim, int) or not isinstance(scaling, float) or not getattr(attention, "is_causal", False):
        return "it has no int head_dim, float scaling and is_causal=True"
    config = getattr(attention, "config", None)
    if _config_change(config) is not None:
        return _config_change(config)
    if layout == _FUSED and not isinstance(getattr(config, "num_attention_heads", None), int):
        return "its qkv_proj cannot be split: no config.num_attention_heads"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":  # the op is causal SDPA: eager attention without a mask is not even causal
        return f"its attention implementation is {implementation!r}, not 'sdpa'"
    try:
        with _probing(attention, training=True) as (params, inputs):
            for scale, x in inputs.items():
                angles = torch.randn(1, x.shape[1], head_dim // 2).to(x.device, x.dtype).repeat(1, 1, 2)
                rotary = (angles.cos(), angles.sin())
                want = functional_call(
                    attention, params, (), {"hidden_states": x, "position_embeddings": rotary, "attention_mask": None}
                )
                want = want[0] if isinstance(want, tuple) else want
                if not _finite(want):
                    continue
                got = attention_block_op(
                    x, cos=rotary[0], sin=rotary[1], **_op_weights(attention, layout, params), scale=scaling
                )
                if not _close(got, want):
                    return (
                        "its forward computes something else than the op (a probe on random weights at input "
                        f"scale {scale:g} differs)"
                    )
    except _PROBE_ERRORS as error:
        return f"the op cannot compute it ({type(error).__name__}: {error})"
    return None


def _attention_block_forward(attention: nn.Module, fallback, group: str | None = None, ranks: int = 1):
    """``attention``'s forward through the op where the call allows, else ``fallback``; with ``group``
    (sequence parallelism, its ``ranks`` each holding a chunk of the rows), the op over that group."""
    layout = _projection_layout(attention)
    signature = inspect.signature(attention.forward)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    config = getattr(attention, "config", None)
    windows = [
        w
        for w in (getattr(attention, "sliding_window", None), getattr(config, "sliding_window", None))
        if w is not None
    ]

    @functools.wraps(attention.forward)
    def forward(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        x, rotary = call["hidden_states"], call.get("position_embeddings")
        others = {
            name: value for name, value in call.items() if name not in _ATTENTION_ARGUMENTS and name != var_keyword
        }
        others.update(call.get(var_keyword) or {})
        caches = [others.pop(name, None) for name in _CACHE_ARGUMENTS]
        cache = next((c for c in caches if c is not None), None)
        causal = others.pop("is_causal", None)  # transformers' SDPA: the call's, else the module's
        causal = getattr(attention, "is_causal", True) if causal is None else causal
        # Read at each call: a projection replaced or hooked since apply (a LoRA wrapper, FSDP2 on a
        # Linear) would be bypassed by the op.
        projections = [getattr(attention, name, None) for name in layout]
        if (
            cache is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        ):  # dynamo cannot trace warnings.warn
            warnings.warn(
                "torch_offload: attention_block is not used while the model fills a key/value cache "
                "(use_cache=True, transformers' default even in training): the attention modules run "
                "their own forward; pass use_cache=False or set model.config.use_cache = False",
                UserWarning,
                stacklevel=2,
            )
        mask = call.get("attention_mask")
        implementation = getattr(config, "_attn_implementation", None)
        if group is None:
            # SDPA's or ours: no mask then means causal, segment ids mean causal per segment
            segments = (
                mask
                if implementation == masking.IMPLEMENTATION and is_segment_ids(mask) and mask.shape == x.shape[:2]
                else None
            )
            ours = implementation in _CAUSAL_IMPLEMENTATIONS and (mask is None or segments is not None)
        else:  # sequence_parallel.mask's: this rank's real-token flags, or None (all real)
            ours = implementation == sequence_parallel.IMPLEMENTATION and (
                mask is None or (mask.dtype == torch.bool and mask.shape == x.shape[:2])
            )
        plain_causal = (
            torch.is_grad_enabled()  # inference keeps the module's own path
            and all(_is_plain_linear(p) for p in projections)
            and ours
            and causal is True
            and cache is None
            and all(value is None or name in _NEUTRAL_ARGUMENTS for name, value in others.items())
            and not (attention.training and getattr(attention, "attention_dropout", 0.0))
            and x.dim() == 3
            and (group is not None or all(x.shape[1] <= w for w in windows))  # the group's: from its segments
            and rotary is not None
            and not any(t.requires_grad for t in rotary)
            and rotary[0].shape[-1] == attention.head_dim  # a partial rotary embedding is not the op's
            # The op rotates in x's dtype; tables of a wider dtype (OLMo's float32 ones for a bfloat16
            # model) make the module rotate in theirs. Narrower ones are promoted exactly, as the module does.
            and all(torch.promote_types(t.dtype, x.dtype) == x.dtype for t in rotary)
            and _config_change(config) is None
        )
        if not plain_causal:
            return fallback(*args, **kwargs)
        if group is not None:
            segments = sequence_parallel.whole_rows_segment_ids(mask, others.get("position_ids"), x.shape[0], group)
            if any(sequence_parallel.window_problem(w, segments, ranks) for w in windows):
                return fallback(*args, **kwargs)  # which refuses it, naming the window
        weights = {
            f"{name}.{kind}": getattr(p, kind) for name, p in zip(layout, projections) for kind in ("weight", "bias")
        }
        out = attention_block_op(
            x,
            cos=rotary[0].to(x.dtype),
            sin=rotary[1].to(x.dtype),
            **_op_weights(attention, layout, weights),
            scale=attention.scaling,
            segment_ids=segments,
            group_name=group,
        )
        return out, None

    return forward


class _Recompute:
    """One checkpointed call's forward, with the attributes apply patched as that forward found them.

    Backward calls it again to recompute the call, which must compute what the forward did
    (torch.utils.checkpoint checks the tensors it saves). If those attributes changed in between
    (``handle.remove()``, a module replaced), what the forward found is put back for that call
    alone, and what is there now right after.
    """

    __slots__ = ("forward", "attributes", "found")

    def __init__(self, forward, patches: list[_Patch]):
        self.forward = forward
        self.attributes = list({(id(p.store), p.key): (p.store, p.key) for p in patches}.values())
        self.found = None

    def _current(self) -> list:
        return [store.get(key, _ABSENT) for store, key in self.attributes]

    def _set(self, values: list) -> None:
        for (store, key), value in zip(self.attributes, values):
            _put(store, key, value)

    def __call__(self, *args, **kwargs):
        now = self._current()
        if self.found is None:  # the forward
            self.found = now
        if all(a is b for a, b in zip(now, self.found)):
            return self.forward(*args, **kwargs)
        self._set(self.found)
        try:
            return self.forward(*args, **kwargs)
        finally:
            self._set(now)


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
                # apply's graph hooks offload in compiled graphs (see _offload_in_compiled_graphs).
                return offloaded_checkpoint(original, *args, offload=False, context_fn=_random_ops_saved, **kwargs)
            return offloaded_checkpoint(original, *args, offload=offload, **kwargs)
        return offloaded_checkpoint(_Recompute(original, handle._patches), *args, offload=offload, **kwargs)

    return forward


def _fuse_attention(handle: OffloadHandle, name: str, layer: nn.Module, checkpointed: bool) -> None:
    """The layer's attention through the attention_block op where it is proven to compute the same."""
    attention = _attention_of(layer)
    if attention is None:
        return
    module = getattr(layer, attention)
    problem = _attention_block_problem(module)
    handle.attention[f"{name}.{attention}"] = "attention_block" if problem is None else f"module: {problem}"
    if problem is not None:
        return
    # The op saves only its input and recomputes itself in backward: checkpointing it again
    # would compute its forward twice. Calls the op cannot take get the module's own path.
    fallback = _checkpoint_forward(handle, module, offload=True) if checkpointed else module.forward
    handle._patch(
        f"{name}.{attention}.forward",
        module,
        "forward",
        _attention_block_forward(module, fallback, handle.sequence_parallel, handle._sequence_parallel_ranks),
    )


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
            warnings.warn(
                "torch_offload.apply: checkpointed layers in training mode run with use_cache=False and no "
                "key/value cache (backward's recomputation would fill it a second time), as transformers' "
                "gradient checkpointing does; the model returns an empty cache",
                UserWarning,
                stacklevel=2,
            )
        return tuple(args), kwargs


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

    handle._patch("forward", model, "forward", forward)


def _resolve_offload(model: nn.Module, offload: str | None, options: dict[str, Any]) -> str | None:
    if offload == "auto":
        # On a CPU the disk tier with attention-only recompute measured both smaller and faster than
        # whole-layer checkpointing in place (BENCHMARKS.md, "apply()'s defaults"); a RAM file system
        # would hold the "disk" in the memory it is meant to free.
        if _on_accelerator(model):
            return "cpu"
        directory = options.get("spill_directory")
        if directory is None:
            directory = default_spill_directory()
            if not (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)):
                warnings.warn(
                    f"torch_offload.apply: offload='auto' keeps this CPU model's activations in memory: "
                    f"the default spill directory {directory!r} is not a writable directory (set "
                    "spill_directory or $TORCH_OFFLOAD_SPILL_DIR for the disk tier)",
                    UserWarning,
                    stacklevel=3,
                )
                return None
        return None if spill_directory_in_ram(directory) and not options.get("allow_tmpfs") else "disk"
    if offload == "cpu" and not _on_accelerator(model):
        warnings.warn(
            "torch_offload.apply: offload='cpu' moves nothing while the model is in host memory (its "
            "activations are already there), so this is plain checkpointing until it moves to a GPU; "
            "offload='disk' sends them to disk",
            UserWarning,
            stacklevel=3,
        )
    return offload


# What apply passes to offload_activations itself; every other keyword of it is an option of apply's.
_SET_BY_APPLY = frozenset({"tier", "module"})


def check_option_names(names: Any, caller: str, own: tuple[str, ...] = ()) -> None:
    """TypeError naming each of ``names`` that is neither in ``own`` nor an option of offload_activations
    that apply passes on (with the closest known name): a typo must never be dropped without a word."""
    known = [*own, *(name for name in inspect.signature(offload_activations).parameters if name not in _SET_BY_APPLY)]
    unknown = [name for name in names if name not in known]
    if unknown:
        hints = [
            f"{name!r}" + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(name, known, 1))
            for name in unknown
        ]
        raise TypeError(
            f"{caller}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
            f"apply's own options and those of offload_activations: {', '.join(sorted(known))}"
        )


def check_apply_option_names(names: Any, caller: str) -> None:
    """check_option_names against everything apply() takes by keyword, for callers that pass options on to it."""
    own = tuple(name for name in inspect.signature(apply).parameters if name not in ("model", "offload_options"))
    check_option_names(names, caller, own)


def _check_offload_options(
    options: dict[str, Any], offload: str | None, requested: str | None, on_accelerator: bool
) -> None:
    """A misspelt option, or one the chosen configuration would ignore, is an error: never silently dropped."""
    check_option_names(options, "torch_offload.apply")
    if offload is None and options:
        why = (
            "offload=None"
            if requested is None
            else "offload='auto', which is None for a model in host memory whose spill directory is in RAM "
            "(allow_tmpfs=True spills there all the same)"
        )
        raise ValueError(
            f"torch_offload.apply: {', '.join(map(repr, options))} would be ignored with {why}: "
            "without a tier nothing is offloaded (offload='disk' or 'cpu' uses them)"
        )
    disk_only = [name for name in ("spill_directory", "allow_tmpfs") if name in options]
    if offload == "cpu" and disk_only:
        raise ValueError(
            f"torch_offload.apply: {', '.join(map(repr, disk_only))} would be ignored with "
            "offload='cpu': only offload='disk' writes to disk"
        )
    if offload == "disk" and options.get("offload_cpu_tensors") is False and not on_accelerator:
        raise ValueError(
            "torch_offload.apply: offload='disk' with offload_cpu_tensors=False would move nothing: the model "
            "is in host memory, so every activation is a CPU tensor; leave offload_cpu_tensors unset"
        )


def _resolve_checkpoint(checkpoint: bool | str, offload: str | None) -> str | None:
    if not isinstance(checkpoint, (bool, str)):
        raise TypeError(
            f"torch_offload.apply: checkpoint must be True, False or one of {_CHECKPOINTS}, got {checkpoint!r}"
        )
    if checkpoint is True:
        return "attention" if offload == "disk" else "layer"
    if checkpoint is False:
        return None
    if checkpoint not in _CHECKPOINTS:
        raise ValueError(
            f"torch_offload.apply: checkpoint must be True, False or one of {_CHECKPOINTS}, got {checkpoint!r}"
        )
    if checkpoint == "attention" and offload is None:
        raise ValueError(
            "torch_offload.apply: checkpoint='attention' needs offload='cpu' or 'disk' (without a "
            "tier, what the rest of each layer saves stays in memory); use checkpoint='layer'"
        )
    return checkpoint


def apply(
    model: nn.Module,
    *,
    tiled_mlp: bool = True,
    checkpoint: bool | str = True,
    offload: str | None = "auto",
    num_shards: int = 0,
    keep_last: int = 1,
    layers: str | None = None,
    loss: bool = True,
    attention_block: bool = True,
    sequence_parallel: Any = None,
    **offload_options,
) -> OffloadHandle:
    """Make ``model`` (a Hugging Face style causal LM or VLM) train with less memory, in place.

    - ``layers``: the decoder layers' path (e.g. ``"model.layers"``); by default the
      ``nn.ModuleList`` whose every module has an ``mlp``, inside ``model.get_decoder()``
      where the model has one (the language model of a VLM). None found, or several:
      ValueError.
    - ``tiled_mlp``: every layer's MLP runs in shards of tokens where a probe at apply time
      (the module's own forward on random weights) shows the result is the same: through
      the ``tiled_mlp`` op (``TiledMLP``) for gate/up/down or fc1/fc2 ``nn.Linear`` MLPs
      that compute exactly the op's function, through ``tiled_apply`` around the module's
      own forward for other token-wise MLPs (LoRA/PEFT-wrapped, quantized, fused
      gate_up_proj as in Phi-3, GPT-2's Conv1D, Gemma3n's activation sparsity). MLPs that
      are not token-wise or whose outputs the model records (mixture-of-experts blocks and
      their router logits) stay as they are, with a warning. ``num_shards=0`` chooses per call.
    - ``checkpoint``: what backward recomputes (non-reentrant checkpointing, DDP-safe):
      ``"layer"``: each decoder layer, whose inputs alone are saved; ``"attention"``: each
      layer's attention module alone, while everything else the layer saves goes to the
      offload tier (needs one), so that backward holds one attention's activations instead
      of a whole layer's, at the cost of more bytes moved; True: ``"attention"`` with
      ``offload="disk"``, ``"layer"`` otherwise; False: none. A layer without exactly one
      attention child module (class name ending in ``Attention``) is checkpointed whole.
    - ``offload``: "cpu" sends saved activations of device tensors to host memory,
      "disk" sends every saved activation (CPU tensors included) to the disk tier,
      None keeps them in place; "auto" is "cpu" for a model on an accelerator and "disk"
      for a model in host memory (where "cpu" would move nothing), None there if the spill
      directory is on a RAM file system and ``allow_tmpfs`` is not set. The last ``keep_last``
      layers keep theirs on the device: backward needs them first.
    - ``loss``: a call with ``labels`` and gradients computes the loss with the
      ``linear_cross_entropy`` op from the final hidden states, never materializing the
      ``[tokens, vocab]`` logits (the output's ``logits`` is None then; calls without
      gradients, as evaluation, run the model's own head and loss); transformers' label shift, ``ignore_index``,
      ``num_items_in_batch``, tied embeddings and the logits' soft-capping or scaling are
      honoured, and a probe at apply time checks the loss against the model's own, on padded
      rows and with ``num_items_in_batch`` too (a model that does not match keeps its own, with
      a warning). Calls without labels are unchanged.
    - ``attention_block``: in every layer apply checkpoints or offloads, the attention module
      runs through the ``attention_block`` op (one group of heads at a time; backward saves
      only the module's input and recomputes each group) where a probe at apply time shows
      the module computes exactly that (the four ``nn.Linear`` projections with rotary
      embeddings and causal attention, as Llama, Mistral and Qwen2; no config option the op
      lacks, as ``clip_qkv``; probes at input scales 1, 16 and 256), and where a call is plain
      causal SDPA attention (no mask, no key/value cache, no dropout, no argument that
      changes attention); other calls and
      modules keep their own forward (``handle.attention`` says which modules and why; a call
      with a cache warns). In a layer checkpointed whole this adds one attention forward to
      backward. With it, a model of a tested family (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3,
      GPT-2) whose attention implementation is ``"sdpa"`` gets
      ``torch_offload.masking``'s, so that packed documents (``position_ids`` restarting) and
      padded rows (``attention_mask``) reach the attention as segment ids, never as a dense
      ``[batch, 1, T, T]`` mask, eager and under ``torch.compile``: the op takes them, and
      modules it does not replace run the ``segment_attention`` op. Masks it cannot describe (a
      sliding window within reach, overlays, a cache) are built dense as before and counted in
      ``handle.mask_fallbacks`` (uncounted under compile).
    - ``sequence_parallel``: a ``torch.distributed`` ProcessGroup (or a 1-D DeviceMesh, or a
      mesh's dimension ``mesh["sp"]``) whose ranks each hold a contiguous chunk of every row's
      tokens, as ``torch_offload.shard_batch(batch, group)`` gives them; call the model with
      that batch. Attention runs over the whole rows for a share of the heads between two
      all-to-alls, within the whole rows' documents and padding: modules ``attention_block``
      computes run it with the group (one head group at a time, recomputed in backward), the
      others keep their own forwards (projections, norms, rotary embedding with the whole rows'
      ``position_ids``) with their core attention through the ``ulysses_attention`` op
      (``handle.attention`` says which). The fused loss
      is the whole batch's on every rank (``num_items_in_batch``, else the group's count of
      labelled tokens), and after backward the ranks' gradients add up to one process's on the
      whole batch. Needs a model of a tested family with ``"sdpa"`` attention (``"eager"`` gives a query
      with no key to attend, as a left-padded row's pads, another output than SDPA), its
      loss fused, query heads a multiple of the ranks; no cache, attention dropout, sliding
      window shorter than the rows or rotary embedding scaled by a call's largest position
      ("dynamic", "longrope"). Calls with labels compute the fused loss under ``no_grad`` too
      (no logits in evaluation).
    - A checkpointed call never carries a key/value cache (backward's recomputation would
      fill it a second time): in training mode a layer handed an empty cache runs without
      it (``use_cache=False``, with a warning), as transformers' gradient checkpointing
      does, and the model returns an empty cache; a call whose cache holds tokens, or in
      eval mode, runs the layer un-checkpointed. Calls without gradients fill it as usual.
    - ``torch.compile(model, fullgraph=True)`` afterwards traces in one graph: each layer is
      a checkpoint in the graph and, with offloading, the compiled graphs hand the saved
      activations the offloaded layers use to the same store (``torch_offload::store_pack``
      and ``store_unpack`` nodes). Compile the model itself, not a function that calls it.
    - ``offload_options`` go to ``offload_activations`` (``min_bytes``,
      ``max_host_bytes``, ``prefetch_bytes``, ``spill_directory``...). An unknown one is a
      TypeError naming it; one the configuration would ignore (any of them without a tier,
      ``spill_directory`` or ``allow_tmpfs`` with ``offload="cpu"``) is a ValueError.

    Every forward apply installs presents the original's signature (``functools.wraps``), which
    ``generate()`` and Trainer read.

    Returns a handle (see ``OffloadHandle``): ``handle.remove()`` restores the model,
    ``handle.stats()`` counts. Applying twice to the same layers is refused.
    """
    if offload not in _OFFLOAD_TIERS:
        raise ValueError(f"torch_offload.apply: offload must be one of {_OFFLOAD_TIERS}, got {offload!r}")
    for name, value in (("tiled_mlp", tiled_mlp), ("loss", loss), ("attention_block", attention_block)):
        check_bool(value, name, "torch_offload.apply")
    check_int(keep_last, "keep_last", "torch_offload.apply")
    check_int(num_shards, "num_shards", "torch_offload.apply")
    layer_path, layer_list = _find_layers(model, layers)
    names = [f"{layer_path}.{index}" for index in range(len(layer_list))]
    for name, layer in zip(names, layer_list):
        if layer in _PATCHED or getattr(layer, "mlp", None) in _PATCHED:
            raise ValueError(
                f"torch_offload.apply: {name} is already changed by an earlier apply(); "
                "call that handle's remove() first"
            )
    group = _sequence_parallel_group(sequence_parallel, loss)
    requested, offload = offload, _resolve_offload(model, offload, offload_options)
    _check_offload_options(offload_options, offload, requested, _on_accelerator(model))
    recompute = _resolve_checkpoint(checkpoint, offload)
    context = None
    if offload is not None:
        options = {"offload_cpu_tensors": offload == "disk", "module": model, **offload_options}
        context = offload_activations(tier=offload, **options)  # checks the directory at first use
        if offload == "disk":  # a spill directory that cannot be used fails here, not in the first step
            disk_wait(
                disk_spill(
                    torch.zeros(1),
                    directory=options.get("spill_directory"),
                    allow_tmpfs=options.get("allow_tmpfs", False),
                )
            )
    handle = OffloadHandle(layer_path, layer_list, offload, context)
    if group is not None:
        handle.sequence_parallel, handle._sequence_parallel_ranks = group.group_name, group.size()
    try:
        recorded = _recorded_outputs(model) if tiled_mlp else {}
        for index, (name, layer) in enumerate(zip(names, layer_list)):
            if tiled_mlp and hasattr(layer, "mlp"):
                _tile_mlp(handle, f"{name}.mlp", layer, num_shards, recorded)
            offload_layer = context is not None and index < len(layer_list) - keep_last
            if recompute or offload_layer:
                _wrap_layer(handle, index, name, layer, recompute, offload_layer, attention_block)
        if attention_block and group is None:
            _use_segment_masks(handle, model)
        if loss:
            handle.loss = fuse_causal_lm_loss(handle, model, handle.sequence_parallel)
        if group is not None:
            _attend_over_ranks(handle, model, names, layer_list, group)
        if context is not None:
            _offload_in_compiled_graphs(handle, model, set(range(len(layer_list) - keep_last)))
        if not handle._patches:
            raise ValueError(
                f"torch_offload.apply: nothing to change in {layer_path} with tiled_mlp={tiled_mlp}, "
                f"checkpoint={checkpoint}, offload={offload!r}, keep_last={keep_last}"
                + (f" (MLPs: {sorted(set(handle.mlp_tiling.values()))})" if handle.mlp_tiling else "")
            )
    except BaseException:
        handle.remove()
        raise
    if handle.loss.startswith("unfused"):
        warnings.warn(
            f"torch_offload.apply: the loss stays the model's own ({handle.loss.removeprefix('unfused: ')})",
            UserWarning,
            stacklevel=2,
        )
    untiled = {name: how for name, how in handle.mlp_tiling.items() if how.startswith("untiled")}
    if untiled:
        first, how = next(iter(untiled.items()))
        warnings.warn(
            f"torch_offload.apply: {len(untiled)} of {len(handle.mlp_tiling)} MLPs stay untiled "
            f"({first}: {how.removeprefix('untiled: ')}); see handle.mlp_tiling",
            UserWarning,
            stacklevel=2,
        )
    return handle
