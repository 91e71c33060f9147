"""apply() for transformers' Trainer and every trainer built on it (TRL's SFTTrainer, ...) as a callback."""

from __future__ import annotations

import weakref
from typing import Any

import transformers
from torch import nn

from . import trl_distillation, trl_fused_head
from .integrations import OffloadHandle, apply, check_apply_option_names

_CALLER = "torch_offload.TorchOffloadCallback"

# model -> the callback whose apply() is on it, until that callback's on_train_end. A train() that raised never
# gets there: the next callback on the model removes that apply() rather than have apply() refuse the model.
_APPLIED_BY: weakref.WeakKeyDictionary[nn.Module, TorchOffloadCallback] = weakref.WeakKeyDictionary()


class TorchOffloadCallback(transformers.TrainerCallback):
    """``Trainer(..., callbacks=[TorchOffloadCallback(**apply_options)])``: ``apply(model, **apply_options)``
    when training begins (after the trainer has placed the model, and after wrappers such as TRL's have
    patched it) and ``remove()`` when it ends, so the model the trainer returns is the one it was given.
    Unknown options are a TypeError here, at construction; options the model's configuration would
    ignore (e.g. ``min_bytes`` without a tier) are apply()'s ValueError when training begins.

    Under TRL 1.16's trainers (GRPO, DPO, SFT, ...), whose fused LM head scores the tokens, in float32 or under
    bf16/fp16 mixed precision (found through accelerate's wrappers), its calls go through the
    ``token_logprobs`` op while training (``callback.fused_head.calls`` counts them; torch_offload/trl_fused_head.py).
    Under an RL trainer of an older TRL (1.9), which scores tokens from the whole logits, a warning says so.
    Under TRL 1.16's DistillationTrainer its divergence between the student's and the teacher's heads goes through
    the ``token_divergence`` op (``callback.divergence.calls`` counts the calls; torch_offload/trl_distillation.py).
    Under any of them, whose calls carry no labels, apply() takes the layers' path (``chunk_recurrent=False``
    unless given).

    ``sequence_parallel`` is a ValueError here: a Trainer hands every rank whole batches, never
    ``torch_offload.shard_batch``'s share of their tokens.

    A ``train()`` that raises (Ctrl-C, out of memory, a failing step) never reaches on_train_end: the model
    stays applied, its handle on ``callback.handle``, until ``callback.handle.remove()``, or until a trainer
    is built or a ``train()`` begins with a TorchOffloadCallback on that model (or with this callback, on any
    model), which removes it first and applies afresh with its own options.
    """

    def __init__(self, **apply_options: Any) -> None:
        check_apply_option_names(apply_options, _CALLER)
        if apply_options.get("sequence_parallel") is not None:
            raise ValueError(
                f"{_CALLER}: sequence_parallel cannot work under a Trainer, which feeds every rank whole batches "
                "rather than torch_offload.shard_batch(batch, group)'s share of their tokens; call "
                "torch_offload.apply(model, sequence_parallel=group) yourself and train on shard_batch's "
                "batches from your own loop"
            )
        self.apply_options = apply_options
        self.handle: OffloadHandle | None = None
        self._model: weakref.ref[nn.Module] | None = None  # the model self.handle is on
        self.fused_head: trl_fused_head.TokenLogprobsHead | None = None
        self.divergence: trl_distillation.TokenDivergenceHead | None = None
        self._undo_fused_head = self._undo_divergence = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        # Before the trainer wraps the model's forward (TRL's fused LM head now, accelerate's autocast in train()):
        # remove() cannot undo apply's from under a later wrapper.
        if model is not None:
            self._remove_stale(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError(f"{_CALLER}: the trainer passed no model to on_train_begin")
        self._remove_stale(model)
        options = dict(self.apply_options)
        if trl_fused_head.scores_tokens(model, args) or trl_distillation.distills(args):
            # Its calls carry no labels, so the step would leave them unoffloaded: the layers' path takes them.
            options.setdefault("chunk_recurrent", False)
        self.fused_head, self._undo_fused_head = trl_fused_head.install(model, _CALLER, args)
        self.divergence, self._undo_divergence = trl_distillation.install(_CALLER, args)
        try:
            self.handle = apply(model, **options)
        except BaseException:
            self._remove()
            raise
        self._model = weakref.ref(model)
        _APPLIED_BY[model] = self

    def on_train_end(self, args, state, control, **kwargs):
        self._remove()

    def _remove_stale(self, model: nn.Module) -> None:
        """Removes what a train() that raised left applied: this callback's, on any model, and another's on
        ``model``."""
        for stale in (self, _APPLIED_BY.get(model)):
            if stale is None:
                continue
            try:
                stale._remove()
            except RuntimeError as error:
                raise RuntimeError(
                    f"{_CALLER}: a TorchOffloadCallback whose train() raised left its model applied, and that "
                    f"cannot be removed now ({error}); next time call that callback's handle.remove() before "
                    "training the model again"
                ) from error

    def _remove(self) -> None:
        for undo in ("_undo_fused_head", "_undo_divergence"):
            if getattr(self, undo) is not None:
                getattr(self, undo)()
                setattr(self, undo, None)  # fused_head and divergence stay, with their counts of calls
        if self.handle is None:
            return
        self.handle.remove()
        model = self._model()
        if model is not None:  # else collected, and gone from _APPLIED_BY with it
            del _APPLIED_BY[model]
        self.handle = self._model = None
