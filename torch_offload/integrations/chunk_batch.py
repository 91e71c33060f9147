"""How the chunk-recurrent step (chunk_recurrent.py) reads a batch: ``[rows, T]`` inputs as transformers reads them,
checked by name, laid end to end as one ``Batch``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..attention_block import attention_block_segment_ids

__all__ = ["Batch", "batch_of", "checked_rows", "chunk_bounds", "reach_of", "runs_of_real_tokens"]

cpu = torch.device("cpu")


@dataclass
class Batch:
    """A batch's rows laid end to end, as the step reads them: ``[tokens]`` ids, rotary positions and targets (the
    labels shifted within each row), what the summed loss is divided by, and which keys each query sees."""

    ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    count: Any
    ignore_index: int
    query_segments: torch.Tensor | None  # None: one causal sequence (chunk_attention.Segments)
    key_segments: torch.Tensor | None
    row_length: int
    # The place each token's attention chunk (Llama 4's chunked attention) is counted from, as transformers' masks
    # count it: a packed document's position, else the place in the row after its left padding.
    chunked_places: torch.Tensor


def batch_of(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: Any = None,
    packed: bool = True,
) -> Batch:
    """``[rows, T]`` inputs as transformers reads them: rows apart, padding (``attention_mask``; its real tokens
    contiguous in each row) and else packed documents (``position_ids`` restarting, where ``packed``: transformers
    reads them so only without a key/value cache); rotary positions ``position_ids``, else each row's 0..T-1; targets
    ``shift_labels``, else ``labels`` shifted by one within each row; the loss over ``num_items_in_batch``, else over
    the counted targets."""
    rows, length = input_ids.shape
    if attention_mask is not None:
        keys = attention_block_segment_ids(attention_mask=attention_mask)  # padding -1
    elif position_ids is not None and packed:
        keys = attention_block_segment_ids(position_ids=position_ids, batch=rows)
    else:
        keys = torch.zeros_like(input_ids)
    query_segments = key_segments = None
    if rows > 1 or bool((keys != keys[0, 0]).any()) or keys[0, 0] < 0:
        keys = torch.where(keys >= 0, keys + torch.arange(rows)[:, None] * (length + 1), -1)  # each row's own ids
        # Ids grow along a row: a pad sees the last segment before it (transformers' causal mask over real keys).
        query_segments, key_segments = keys.cummax(dim=1).values.reshape(-1), keys.reshape(-1)
    positions = torch.arange(length) if position_ids is None else position_ids
    chunked_places = torch.arange(length).expand(rows, length)
    if attention_mask is not None:
        chunked_places = chunked_places - (attention_mask.cumsum(1) == 0).sum(1, keepdim=True)
    elif position_ids is not None and packed and _restarts(position_ids):
        chunked_places = position_ids.expand(rows, length)
    targets = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    count = num_items_in_batch if num_items_in_batch is not None else (targets != ignore_index).sum()
    return Batch(
        input_ids.reshape(-1),
        positions.expand(rows, length).reshape(-1).clone(),  # backward reads them again: not the caller's
        targets.reshape(-1),
        count,
        ignore_index,
        query_segments,
        key_segments,
        length,
        chunked_places.reshape(-1).clone(),
    )


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether transformers reads packed documents off ``position_ids``: a step other than 1 along some row."""
    return bool((position_ids.diff(dim=-1) != 1).any())


def chunk_bounds(batch: Batch, chunk_tokens: int, within_rows: bool) -> list[tuple[int, int]]:
    """The step's chunks of ``batch``: ``chunk_tokens`` tokens each, the last shorter; ``within_rows``: cut at each
    row's end too, so that a chunk's tokens have consecutive places in their row."""
    tokens = len(batch.ids)
    starts = range(0, tokens, chunk_tokens)
    if within_rows:
        starts = sorted({*starts, *range(0, tokens, batch.row_length)})
    return [(start, end) for start, end in zip(starts, [*starts[1:], tokens])]


def reach_of(batch: Batch) -> int:
    """The most keys any query of ``batch`` sees (itself and those back to its segment's first token): a sliding
    window at least this long changes nothing."""
    if batch.query_segments is None:
        return len(batch.ids)
    positions = torch.arange(len(batch.ids))
    keys = batch.key_segments >= 0
    first = torch.full((int(batch.key_segments.max()) + 2,), len(batch.ids), dtype=torch.long)
    first.scatter_reduce_(0, batch.key_segments[keys], positions[keys], "amin")
    seeing = batch.query_segments >= 0
    if not bool(seeing.any()):
        return 0
    return int((positions[seeing] - first[batch.query_segments[seeing]]).max()) + 1


def checked_rows(name: str, value, optional: bool, input_ids, device: torch.device) -> torch.Tensor | None:
    """``value`` as ``[rows, T]`` (from ``[T]``) on the CPU, where the step keeps the batch (a chunk's share goes to
    the model's ``device`` as it runs), after checking it names what is wrong."""
    if value is None and optional:
        return None
    dtypes = (torch.int64, torch.int32, torch.bool) if name == "attention_mask" else (torch.int64,)
    if not isinstance(value, torch.Tensor) or value.dtype not in dtypes or value.device not in (cpu, device):
        kinds = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        on = "CPU" if device == cpu else f"CPU or {device}"
        raise TypeError(f"chunk_recurrent_loss: {name} must be an {kinds} {on} tensor")
    value = value.cpu()
    if value.dim() not in (1, 2) or value.shape[-1] == 0:
        raise ValueError(f"chunk_recurrent_loss: {name} must be [rows, T] or [T] with T > 0, got {list(value.shape)}")
    rows = value if value.dim() == 2 else value[None]
    shape = input_ids.shape if input_ids.dim() == 2 else (1, *input_ids.shape)
    if rows.shape != shape and not (name == "position_ids" and rows.shape == (1, shape[1])):
        raise ValueError(f"chunk_recurrent_loss: {name}: shape {list(value.shape)} is not input_ids' {list(shape)}")
    return rows


def runs_of_real_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """The runs of real tokens in each row of a ``[rows, T]`` mask."""
    real = attention_mask.bool()
    return (real & ~F.pad(real[:, :-1], (1, 0), value=False)).sum(1)
