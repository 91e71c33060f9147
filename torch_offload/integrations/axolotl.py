"""apply() for axolotl: ``plugins: [torch_offload.integrations.axolotl.TorchOffloadPlugin]`` in the config, with
apply's options under one key, e.g. ``torch_offload: {offload: disk}`` (none: apply's defaults)."""

from __future__ import annotations

from typing import Any

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, field_validator

from ..trainer_callback import TorchOffloadCallback
from . import check_apply_option_names


class TorchOffloadArgs(BaseModel):
    """The config's ``torch_offload:`` key: apply()'s keyword options (the model is axolotl's)."""

    torch_offload: dict[str, Any] | None = None

    @field_validator("torch_offload")
    @classmethod
    def _known_options(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        if options is not None:
            try:
                check_apply_option_names(options, "torch_offload (axolotl config)")
            except TypeError as error:  # pydantic reports a ValueError as the config's validation error
                raise ValueError(str(error)) from None
        return options


class TorchOffloadPlugin(BasePlugin):
    """Gives axolotl's trainer ``TorchOffloadCallback(**cfg.torch_offload)``: apply() when training begins and
    remove() when it ends, before axolotl saves the model. Not in ``post_model_load``: with mixed precision the
    trainer then wraps the model's forward in accelerate's autocast, and remove() would refuse to undo apply's
    forward from under that wrapper."""

    def get_input_args(self) -> str:
        return f"{__name__}.TorchOffloadArgs"

    def add_callbacks_pre_trainer(self, cfg, model) -> list[TorchOffloadCallback]:
        return [TorchOffloadCallback(**(cfg.torch_offload or {}))]
