"""Sequence parallelism: attention over a sequence split across the ranks of a process group (Ulysses).

Each rank holds a contiguous chunk of every row's tokens. ``ulysses_attention`` exchanges q, k and v
with one all-to-all each so that every rank holds all of the tokens for a share of the heads, runs
``segment_attention`` there (causal within the segments of the whole rows), and sends the outputs back
with one more all-to-all: the ``offload::ulysses_attention`` op, a C++ composite of torch.distributed's
functional collectives (Gloo on CPUs, NCCL on GPUs) and ``segment_attention``, differentiable and traced
by dynamo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from .attention_block import attention_block_segment_ids

IGNORE_INDEX = -100
# What shard_batch splits along the tokens, and the value it pads each with (position_ids: 0, 1, ...).
_SEQUENCE_KEYS = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": None}

__all__ = ["group_name", "shard_batch", "ulysses_attention"]

# The transformers attention implementation apply(model, sequence_parallel=group) gives a model, and the
# attribute of each attention module that names its group.
IMPLEMENTATION = "torch_offload_ulysses"
GROUP_ATTRIBUTE = "torch_offload_sequence_parallel_group"
# Set on the attention modules of a model with eager attention: their left-padded rows are refused.
EAGER_ATTRIBUTE = "torch_offload_sequence_parallel_eager"
# Set on the attention modules of a model whose masks do not read position_ids (GPT-OSS's): to it, a row
# without padding is one sequence, packed documents or not.
ONE_SEQUENCE_PER_ROW_ATTRIBUTE = "torch_offload_sequence_parallel_one_sequence_per_row"


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name torch.distributed registered ``group`` under (the default group's for None)."""
    return (group if group is not None else dist.group.WORLD).group_name


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_ids: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a sequence split over ``group``'s ranks, each rank holding a contiguous chunk:
    the ``offload::ulysses_attention`` op.

    ``query`` ``[batch, heads, tokens / ranks, head_dim]`` and ``key``, ``value`` ``[batch, kv_heads,
    tokens / ranks, head_dim]`` (value's head_dim may differ: multi-head latent attention) are this rank's
    chunk (rank r holds tokens ``[r * tokens / ranks, (r + 1) * tokens / ranks)`` of every row);
    ``segment_ids`` ``[batch, tokens]`` describe the whole rows as ``attention_block``'s do (so packed
    documents may cross ranks). Returns this rank's chunk of the output, ``[batch, heads, tokens / ranks,
    value_head_dim]``: what ``segment_attention`` gives on the whole rows, sliced. ``heads`` must be a
    multiple of the number of ranks (else a ValueError naming both); key/value heads that are not are
    repeated to the query heads (grouped-query attention with fewer key/value heads than ranks).
    ``softcap``, ``sinks`` ``[heads]`` and ``window`` are ``segment_attention``'s; each rank attends its
    share of the heads over the whole rows, so a window is exact, with those heads' sinks as the group's first
    rank holds them (that rank gets the whole sinks gradient, the others zero: summed over the ranks, the whole
    one). ``group``: a ProcessGroup, its name, or
    None for the default group. Differentiable; every rank must call it with the same shapes.
    """
    name = group if isinstance(group, str) else group_name(group)
    # The score mods' arguments only where given, as segment_attention passes them.
    mods = (softcap, sinks, window) if any(m is not None for m in (softcap, sinks, window)) else ()
    return torch.ops.offload.ulysses_attention(query, key, value, segment_ids, name, scale, *mods)


def shard_batch(batch: dict, group: dist.ProcessGroup | None = None) -> dict:
    """This rank's part of a whole batch, for a model whose sequence is split over ``group``'s ranks.

    ``batch`` is what a collator gives a causal LM: ``input_ids`` ``[batch, T]`` and any of ``labels``,
    ``attention_mask``, ``position_ids`` (``[1 or batch, T]``), ``num_items_in_batch``; every rank passes
    the same batch. T is padded to a multiple of the ranks N (input ids and the mask with 0, labels with
    -100, positions 0, 1, ...: a document of its own, within the model's position table), so the padding
    comes after every real token and no real token sees it.
    Rank r gets tokens ``[r * T / N, (r + 1) * T / N)`` of each of them, with:

    - ``shift_labels``: the labels shifted by one token over the whole rows, so a chunk's last token is
      labelled with the next rank's first token (transformers' causal-LM loss takes them instead of
      shifting ``labels`` itself, which is also kept, for the model to compute a loss at all);
    - ``position_ids``: the whole rows' positions (0..T-1 if the batch has none), so the rotary embedding
      sees global positions and packed documents stay packed across ranks;
    - ``num_items_in_batch``: the number of labelled tokens of the whole batch (if the batch does not give
      one already, e.g. counted over accumulation steps; one given must count the whole, unsharded batch
      once, not a sum over the sequence ranks): the normalisation of the whole batch's loss, which
      apply(model, sequence_parallel=group) returns on every rank.
    Other entries are passed on as they are; another tensor shaped like the tokens (``inputs_embeds``) is
    refused by name, as it would go unsplit.
    """
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("shard_batch: this process is not a rank of the group")
    return _shard(batch, rank, dist.get_world_size(group))


def _shard(batch: dict, rank: int, ranks: int) -> dict:
    if "input_ids" not in batch:
        raise ValueError("shard_batch: the batch has no input_ids; expected a causal LM batch (input_ids [batch, T])")
    if "shift_labels" in batch:
        raise ValueError(
            "shard_batch: the batch has shift_labels; pass labels, which shard_batch shifts over the whole rows"
        )
    tokens = batch["input_ids"].shape[-1]
    for name, value in batch.items():
        if (
            name not in _SEQUENCE_KEYS
            and isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and (value.shape[1] == tokens)
        ):
            raise ValueError(
                f"shard_batch: {name} has shape {list(value.shape)}, one entry per token, and is not "
                f"one shard_batch splits ({', '.join(_SEQUENCE_KEYS)})"
            )
        if name in _SEQUENCE_KEYS and (not isinstance(value, torch.Tensor) or value.shape[-1] != tokens):
            raise ValueError(
                f"shard_batch: {name} has shape {list(getattr(value, 'shape', []))}; expected "
                f"[batch, {tokens}] like input_ids"
            )
    padding = -tokens % ranks
    local = (tokens + padding) // ranks
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(tokens, device=batch["input_ids"].device)[None]
    if "labels" in batch:
        labels = batch["labels"]
        out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1 + padding), value=IGNORE_INDEX)
        if "num_items_in_batch" not in batch:
            out["num_items_in_batch"] = (labels[:, 1:] != IGNORE_INDEX).sum()
    for name in (*_SEQUENCE_KEYS, "shift_labels"):
        if name not in out:
            continue
        value = out[name]
        if name == "position_ids":
            value = torch.cat([value, torch.arange(padding, device=value.device).expand(value.shape[0], -1)], dim=1)
        elif name != "shift_labels":
            value = torch.nn.functional.pad(value, (0, padding), value=_SEQUENCE_KEYS[name])
        out[name] = value[:, rank * local : (rank + 1) * local].contiguous()  # transformers views them flat
    return out


def _gathered(t: torch.Tensor, group: str) -> torch.Tensor:
    """[rows, tokens / ranks] on each rank -> [rows, tokens], the ranks' chunks in rank order."""
    # [tokens, rows]: dim 0 is the one torch 2.11 gathers under torch.compile (all_gather_single is newer)
    return funcol.all_gather_tensor(t.t().contiguous(), 0, group).t()


def group_sum(t: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of ``t`` over the group's ranks, not differentiable."""
    return funcol.all_reduce(t.detach(), "sum", group)


def global_loss(local: torch.Tensor, group: str) -> torch.Tensor:
    """The ranks' losses added up, with the gradient of this rank's own: every rank returns the whole
    batch's loss, and after backward the ranks' gradients add up to the whole batch's."""
    return local + (group_sum(local, group) - local.detach())


def whole_rows_segment_ids(
    real: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int, group: str
) -> torch.Tensor:
    """The whole rows' segment ids from this rank's part of a call: from the gathered real-token flags
    (``mask``'s result) where the batch has an attention_mask, else from the gathered position_ids (packed
    documents restarting), as transformers reads a batch."""
    if real is not None:
        return attention_block_segment_ids(attention_mask=_gathered(real.to(torch.int32), group))
    if position_ids is None:
        raise ValueError(
            "torch_offload sequence parallelism: the attention got no position_ids; call the model "
            "with shard_batch's position_ids"
        )
    return attention_block_segment_ids(position_ids=_gathered(position_ids, group), batch=batch)


def farthest_reach(segment_ids: torch.Tensor, ranks: int) -> int:
    """The most keys any token attends to in the whole rows: a real token, the earlier tokens of its own
    sequence (a run of equal non-negative ids) and itself; padding (negative ids), all of the nearest
    sequence before it. The last ``ranks - 1`` tokens of a row, where padding there may be shard_batch's
    own (tokens the rows do not have, which no token attends to and whose labels are ignored), are left out."""
    tokens = segment_ids.shape[1]
    index = torch.arange(tokens, device=segment_ids.device).expand_as(segment_ids)
    real = segment_ids >= 0
    starts = real.clone()
    starts[:, 1:] &= segment_ids[:, 1:] != segment_ids[:, :-1]
    start_of_sequence = torch.where(starts, index, -1).cummax(dim=1).values  # padding: its nearest sequence's
    reach = torch.where(start_of_sequence >= 0, index - start_of_sequence + 1, 0)
    reach[:, tokens - (ranks - 1) :] *= real[:, tokens - (ranks - 1) :]
    return int(reach.max()) if reach.numel() else 0


def window_problem(window: int | None, segment_ids: torch.Tensor, ranks: int) -> str | None:
    """Why sliding-window attention is not computed for these whole rows, or None where no token would
    attend past the window (read from the rows' sequences only where the rows are longer than it)."""
    if not isinstance(window, int) or window >= segment_ids.shape[1]:
        return None
    reach = farthest_reach(segment_ids, ranks)
    if reach <= window:
        return None
    return (
        f"torch_offload sequence parallelism: a sliding window ({window} tokens) shorter than a sequence of "
        f"the whole rows (a token attends to {reach}) is not supported"
    )


def every_query_has_a_key(segment_ids: torch.Tensor) -> torch.Tensor:
    """The ids, checked (in the graph under torch.compile) to start no row with padding: eager attention gives a
    left-padded row's padding, whose queries see no key, the mean of the row's values, later tokens included,
    where ulysses_attention gives 0, as SDPA does."""
    return torch.ops.offload._assert_all(
        segment_ids,
        segment_ids[:, :1] >= 0,
        "torch_offload sequence parallelism: a left-padded row in a model with 'eager' attention, which gives its "
        "padding (queries that see no key) the mean of the row's values; ulysses_attention gives them 0, as SDPA "
        "does: pad on the right",
    )


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    config=None,
    **kwargs,
):
    """The mask function registered for IMPLEMENTATION: this rank's [batch, tokens / ranks] real-token
    flags (or None: all real); the attention function gathers the whole rows' segments itself (and
    checks sliding windows against the whole rows, which this rank's part does not know)."""
    if q_length != kv_length or not isinstance(q_offset, int) or q_offset or kv_offset:
        raise NotImplementedError(
            "torch_offload sequence parallelism: a key/value cache (queries offset from keys) "
            "is not supported; call the model with use_cache=False"
        )
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
):
    """The attention function registered for IMPLEMENTATION: ulysses_attention over the module's group,
    with the whole rows' segment ids: from the gathered real-token flags where the batch has an
    attention_mask, else from the gathered position_ids (packed documents restarting), as transformers
    reads a batch."""
    group = getattr(module, GROUP_ATTRIBUTE, None)
    if group is None:
        raise RuntimeError(
            f"torch_offload sequence parallelism: {type(module).__name__} has no process group; "
            "its model's attention implementation is set by apply(model, sequence_parallel=group)"
        )
    if kwargs.get("dropout", 0.0):
        raise NotImplementedError("torch_offload sequence parallelism: attention dropout is not supported")
    real = attention_mask
    if real is None and getattr(module, ONE_SEQUENCE_PER_ROW_ATTRIBUTE, False):
        real = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
    segment_ids = whole_rows_segment_ids(real, kwargs.get("position_ids"), query.shape[0], group)
    if getattr(module, EAGER_ATTRIBUTE, False):
        segment_ids = every_query_has_a_key(segment_ids)
    # Gemma 2's soft-capped scores, GPT-OSS's sinks (s_aux) and a layer's sliding window, as its mask has it.
    mods = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"), window=kwargs.get("sliding_window"))
    out = ulysses_attention(query, key, value, segment_ids, group, scale=kwargs.get("scaling"), **mods)
    return out.transpose(1, 2).contiguous(), None  # [B, T, heads, D], as SDPA's function returns it


def register() -> None:
    """Registers IMPLEMENTATION with transformers (registering again changes nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, mask)
