"""apply()'s plan: the one route a model's calls take, decided from the model, its device and apply's options before
anything is installed.

- The chunk-recurrent step (chunk_recurrent_route.py): on a CPU, with apply's options as their defaults there (the
  disk tier, attention alone recomputed, no layer kept, no sequence parallelism, the loss fused; no option only the
  layers' path reads given otherwise, nor an offload option but the spill directory's), for a model the step takes
  and whose probe passes. apply then installs the fused loss and the step's forward, nothing on the
  layers; calls the step does not take run the model's own layers with the fused loss.
- The layers' path: everything else (each layer's MLP tiled, its attention through attention_block, checkpointed
  and offloaded; the masks, the norms, apply's loop over the layers, the fused loss), as each part's probe allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .chunk_recurrent_route import step_route

__all__ = ["LAYERS", "STEP", "Plan", "plan_route"]

STEP = "chunk-recurrent step"
_STEP_OPTIONS = frozenset({"spill_directory", "allow_tmpfs"})  # the offload options the step reads
LAYERS = "layers' path"


@dataclass(frozen=True)
class Plan:
    """The route apply installs; ``why``: why it is not the step ("" where it is); with the step, ``owner``: the
    causal LM whose forward takes it (the model, or the one a PEFT model wraps), ``output_type``: its output class,
    which the step's forward builds."""

    route: str
    why: str = ""
    owner: nn.Module | None = None
    output_type: type | None = None


def plan_route(
    model: nn.Module,
    *,
    chunk_recurrent: bool,
    loss: bool,
    sequence_parallel: bool,
    offload: str | None,
    recompute: str | None,
    keep_last: int,
    layers: str | None,
    layer_path: str,
    layers_path_options: dict[str, Any],
    offload_options: dict[str, Any],
) -> Plan:
    """The route for ``model`` under apply's resolved options (see the module's docstring); ``layers_path_options``:
    the options only the layers' path reads (tiled_mlp, attention_block, rms_norm, num_shards), as given."""
    defaults = {"tiled_mlp": True, "attention_block": True, "rms_norm": True, "num_shards": 0}
    given = [f"{name}={value!r}" for name, value in layers_path_options.items() if value != defaults[name]]
    given += [f"{name}=..." for name in offload_options if name not in _STEP_OPTIONS]
    asked = [
        (not chunk_recurrent, "chunk_recurrent=False"),
        (sequence_parallel, "sequence parallelism"),
        (not loss, "loss=False (the step computes the fused loss)"),
        (offload != "disk", f"offload={offload!r} (the step keeps its chunks where the disk tier would)"),
        (recompute != "attention" or keep_last, "checkpoint or keep_last asked for the layers' path"),
        (layers not in (None, layer_path), f"layers={layers!r}, not the decoder layers the step runs"),
        (bool(given), f"{', '.join(given)}: options of the layers' path"),
    ]
    why = next((why for asked_for, why in asked if asked_for), None)
    if why is not None:
        return Plan(LAYERS, why)
    problem, owner, output_type = step_route(model, offload_options)
    return Plan(LAYERS, problem) if problem is not None else Plan(STEP, owner=owner, output_type=output_type)
