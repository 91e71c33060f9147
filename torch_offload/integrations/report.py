"""What apply() did to each decoder layer, and why not more: ``handle.report()``, ``print(handle)`` and the
log line apply() writes. Read from the handle's records and the configs' current attention implementations,
so the report says what runs now."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from .. import eager_attention, masking
from .layers import _attention_of, _mlp_name

if TYPE_CHECKING:
    from .handle import OffloadHandle

_COLUMNS = ("mlp", "attention", "recompute", "saved")
_HEADINGS = {"layers": "layers", "mlp": "mlp", "attention": "attention", "recompute": "recomputed", "saved": "saved to"}


def _mlp(handle: OffloadHandle, name: str, layer: Any) -> tuple[str, str | None]:
    how = handle.mlp_tiling.get(f"{name}.{_mlp_name(layer)}")
    if how is None:
        return "own", "tiled_mlp=False" if not handle._options["tiled_mlp"] else "the layer has no mlp"
    if how.startswith(("untiled: ", "streamed: ")):
        return "own", how.split(": ", 1)[1]
    return how, None


def _attention(handle: OffloadHandle, name: str, layer: Any) -> tuple[str, str | None]:
    child = _attention_of(layer)
    how = None if child is None else handle.attention.get(f"{name}.{child}")
    if how in ("attention_block", "ulysses_attention"):
        return how, None
    if child is None:
        why = "no single attention module in the layer"
    elif how is not None:
        why = how.removeprefix("module: ")
    elif not handle._options["attention_block"]:
        why = "attention_block=False"
    else:
        why = "the layer is neither checkpointed nor offloaded"
    config = getattr(getattr(layer, child, None), "config", None) if child is not None else None
    if getattr(config, "_attn_implementation", None) in (masking.IMPLEMENTATION, eager_attention.IMPLEMENTATION):
        # The module's own forward, whose core attention takes segment ids: the segment_attention op.
        return "segment_attention", f"own forward ({why})"
    return "own", why


def _recompute_note(handle: OffloadHandle, recompute: str, attention: str) -> str | None:
    # A layer recomputed whole in a model with a tier keeps its attention's output (checkpointing.attention_once).
    if recompute == "layer" and attention == "attention_block" and handle.context is not None:
        return "not its attention forward: attention_block's output and log-sum-exps are kept from the forward"
    return None


def _saved(handle: OffloadHandle, index: int, recompute: str) -> tuple[str, str | None]:
    if index in handle._offloaded:
        return handle.offload, None
    if handle.context is not None:
        return "in place", f"keep_last={handle._options['keep_last']}: backward needs the last layers first"
    return ("in place", "offload=None") if recompute != "none" else ("in place", "neither checkpointed nor offloaded")


def _norms(handle: OffloadHandle) -> str:
    if not handle._options["rms_norm"]:
        return "the model's own (rms_norm=False)"
    if not handle.norms:
        return "the model's own (no RMSNorm found)"
    kept = {name: how.removeprefix("module: ") for name, how in handle.norms.items() if how != "rms_norm"}
    fused = f"{len(handle.norms) - len(kept)} of {len(handle.norms)} through rms_norm"
    return fused + "".join(f" ({name}: {why})" for name, why in list(kept.items())[:1])


def report(handle: OffloadHandle) -> dict[str, Any]:
    """The handle's report as data; ``format_report`` prints it."""
    rows = []
    if handle.route == "chunk-recurrent step":  # every layer alike: the model's own, run by the step chunk by chunk
        step = {"mlp": "own", "attention": "chunks", "recompute": "layer by chunk", "saved": "the step's file"}
        rows.append({"layers": list(range(len(handle.layers))), **step, "why": {}})
    for index, layer in enumerate(handle.layers if not rows else ()):
        name = f"{handle.layer_path}.{index}"
        recompute = handle.checkpointing.get(name, "none")
        cells = {"mlp": _mlp(handle, name, layer), "attention": _attention(handle, name, layer)}
        cells["recompute"] = (recompute, _recompute_note(handle, recompute, cells["attention"][0]))
        cells["saved"] = _saved(handle, index, recompute)
        row = {column: cells[column][0] for column in _COLUMNS}
        row["why"] = {column: cells[column][1] for column in _COLUMNS if cells[column][1] is not None}
        if rows and {k: v for k, v in rows[-1].items() if k != "layers"} == row:
            rows[-1]["layers"].append(index)
        else:
            rows.append({"layers": [index], **row})
    return {
        "model": handle._model_name,
        "layer_path": handle.layer_path,
        "layers": rows,
        "loss": handle.loss,
        "norms": _norms(handle) if not rows or handle.route != "chunk-recurrent step" else "the model's own",
        "masks": handle._masks,
        "layer_loop": handle.layer_loop,
        "route": handle.route,
        "chunk_recurrent": handle.chunk_recurrent,
        "sequence_parallel": handle.sequence_parallel,
        "removed": handle._removed,
    }


def _span(indices: list[int]) -> str:
    return str(indices[0]) if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"


def _layers_named(indices: list[int]) -> str:
    return f"{'layer' if len(indices) == 1 else 'layers'} {_span(indices)}"


def _heading(data: dict[str, Any]) -> str:
    count = sum(len(row["layers"]) for row in data["layers"])
    removed = " (removed: the model is as it was before apply)" if data["removed"] else ""
    return f"torch_offload.apply({data['model']}): {count} layer{'s' * (count != 1)} at {data['layer_path']}{removed}"


def _model_lines(data: dict[str, Any]) -> list[str]:
    if data["route"] == "chunk-recurrent step":
        return [
            "route: chunk-recurrent step (training calls with labels; any other call runs the model's own layers)",
            f"loss: {data['loss']}",
            f"chunk-recurrent step: {data['chunk_recurrent']}",
        ]
    lines = [
        "route: layers' path",
        f"loss: {data['loss']}",
        f"norms: {data['norms']}",
        f"masks: {data['masks']}",
        f"layer loop: {data['layer_loop']}",
        f"chunk-recurrent step: {data['chunk_recurrent']}",
    ]
    if data["sequence_parallel"] is not None:
        lines.append(f"sequence_parallel: group {data['sequence_parallel']}")
    return lines


def format_report(data: dict[str, Any]) -> str:
    """A table of the rows, each reason once as a numbered note below it, then the model's loss and masks."""
    reasons: dict[str, int] = {}
    table = [[_HEADINGS[column] for column in ("layers", *_COLUMNS)]]
    for row in data["layers"]:
        cells = [_span(row["layers"])]
        for column in _COLUMNS:
            why = row["why"].get(column)
            note = "" if why is None else f" [{reasons.setdefault(why, len(reasons) + 1)}]"
            cells.append(row[column] + note)
        table.append(cells)
    widths = [max(len(cells[i]) for cells in table) for i in range(len(table[0]))]
    lines = [_heading(data)]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip() for cells in table]
    lines += [f"  [{number}] {why}" for why, number in reasons.items()]
    return "\n".join(lines + _model_lines(data))


def summary_line(data: dict[str, Any]) -> str:
    """The report in one line, for apply()'s log."""
    rows = (
        f"{_layers_named(row['layers'])}: "
        + ", ".join(
            f"{column} {row[column]}" + (f" ({row['why'][column]})" if column in row["why"] else "")
            for column in _COLUMNS
        )
        for row in data["layers"]
    )
    return "; ".join(itertools.chain([_heading(data)], rows, _model_lines(data)))
