"""apply()'s options: their checks, and what "auto" and True resolve to."""

from __future__ import annotations

import difflib
import inspect
import itertools
import os
import warnings
from typing import Any

import torch
from torch import nn

from .._options import check_bool, check_int
from ..activations import offload_activations
from ..disk import default_spill_directory, disk_spill, disk_wait, spill_directory_in_ram

_OFFLOAD_TIERS = ("auto", "cpu", "disk", None)
_CHECKPOINTS = ("layer", "attention")


def _on_accelerator(model: nn.Module) -> bool:
    return any(t.device.type not in ("cpu", "meta") for t in itertools.chain(model.parameters(), model.buffers()))


def _check_arguments(offload: Any, flags: dict[str, Any], keep_last: Any, num_shards: Any) -> None:
    """apply()'s first checks, in this order: the tier is a known one, the ``flags`` bools, the counts ints."""
    if offload not in _OFFLOAD_TIERS:
        raise ValueError(f"torch_offload.apply: offload must be one of {_OFFLOAD_TIERS}, got {offload!r}")
    for name, value in flags.items():
        check_bool(value, name, "torch_offload.apply")
    if keep_last is not None:
        check_int(keep_last, "keep_last", "torch_offload.apply")
    check_int(num_shards, "num_shards", "torch_offload.apply")


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


# The disk tier's read-ahead for a model in host memory (the store's own default, 64 MiB, serves a GPU's overlap).
HOST_MODEL_PREFETCH_BYTES = 16 << 20

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


def _resolve_keep_last(keep_last: int | None, recompute: str | None) -> int:
    if keep_last is not None:
        return keep_last
    # A last layer recomputed whole holds all of its activations at once: with attention-only recompute elsewhere that
    # is the step's peak (BENCHMARKS.md, "Long context"), so it goes through the same recompute as the others. With
    # whole layers recomputed anyway, keeping the last in place saves its round trip through the tier.
    return 0 if recompute == "attention" else 1


def _offload_context(
    model: nn.Module, offload: str | None, offload_options: dict[str, Any]
) -> offload_activations | None:
    """The offload_activations context of the resolved tier, None without one."""
    if offload is None:
        return None
    options = {"offload_cpu_tensors": offload == "disk", "module": model, **offload_options}
    if offload == "disk" and not _on_accelerator(model):
        # The CPU that computes also restores: a 16 MiB read-ahead hid the reads as well as the store's 64 MiB did
        # and took 30-45 MiB off the step's peak at 8K-16K tokens, and a tensor over it restored when asked for
        # took about one [T, h] tensor off the peak from 32K tokens in the same step time (BENCHMARKS.md, "Long
        # context").
        options.setdefault("prefetch_bytes", HOST_MODEL_PREFETCH_BYTES)
        options.setdefault("prefetch_over_budget", False)
    context = offload_activations(tier=offload, **options)  # checks the directory at first use
    if offload == "disk":  # a spill directory that cannot be used fails here, not in the first step
        disk_wait(
            disk_spill(
                torch.zeros(1),
                directory=options.get("spill_directory"),
                allow_tmpfs=options.get("allow_tmpfs", False),
            )
        )
    return context
