"""apply() for transformers' Trainer and every trainer built on it (TRL's SFTTrainer, ...) as a callback."""

from __future__ import annotations

from typing import Any

import transformers

from .integrations import OffloadHandle, apply, check_apply_option_names


class TorchOffloadCallback(transformers.TrainerCallback):
    """``Trainer(..., callbacks=[TorchOffloadCallback(**apply_options)])``: ``apply(model, **apply_options)``
    when training begins (after the trainer has placed the model, and after wrappers such as TRL's have
    patched it) and ``remove()`` when it ends, so the model the trainer returns is the one it was given.
    Unknown options are a TypeError here, at construction; options the model's configuration would
    ignore (e.g. ``min_bytes`` without a tier) are apply()'s ValueError when training begins."""

    def __init__(self, **apply_options: Any) -> None:
        check_apply_option_names(apply_options, "torch_offload.TorchOffloadCallback")
        self.apply_options = apply_options
        self.handle: OffloadHandle | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("torch_offload.TorchOffloadCallback: the trainer passed no model to on_train_begin")
        if self.handle is not None:  # a train() that raised never ended: the model is applied still
            return
        self.handle = apply(model, **self.apply_options)

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
