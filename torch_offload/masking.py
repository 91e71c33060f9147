"""Packed and padded batches without a [T, T] mask: an attention implementation for transformers.

transformers turns packed ``position_ids`` (documents restarting at 0) and a 2-D ``attention_mask``
into a dense ``[batch, 1, T, T]`` mask for SDPA. ``apply()`` switches a model of a tested family
(the families whose ``masks`` is ``"sdpa"`` in torch_offload.families) whose attention implementation is ``"sdpa"`` to
``IMPLEMENTATION``, registered here with transformers' ``AttentionMaskInterface`` and
``AttentionInterface``:

- its mask function reads the mask transformers asks for (the mask function it composed from its
  own factories: causal, packed, sliding window) and, where that mask is causal attention within
  runs of tokens (packed documents, the real tokens of a row and its padding), returns the
  ``[batch, T]`` segment ids of ``attention_block`` instead, or ``None`` for plain causal attention;
  a sliding window shorter than the rows of an unpadded batch gets the ids too, where the family's
  attention passes the window on (``passes_window``). Anything else (such a window with
  padding, overlays such as bidirectional image tokens, a cache's offsets, real tokens with holes)
  gets transformers' own dense SDPA mask, and is counted.
  Under torch.compile, where the factories' closures cannot be read, it evaluates the mask function
  instead (_compiled_segments): the same segment ids, with traceable ops.
- its attention function (segment_sdpa.attention) takes either: segment ids go to the ``segment_attention``
  op, anything else to transformers' SDPA function unchanged.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from .attention_block import attention_block_segment_ids
from .families import family_of

IMPLEMENTATION = "torch_offload_sdpa"

# Why calls got transformers' dense mask, per config (apply() reads and clears its model's).
_FALLBACKS: dict[int, collections.Counter] = {}


def config_window(config: Any) -> int | None:
    """The config's sliding window, unless it says windows are off (Qwen2-MoE keeps a size beside
    use_sliding_window=False)."""
    return getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None


def config_chunk(config: Any) -> int | None:
    """The config's attention chunk (Llama 4's chunked layers: a query sees its own chunk of the row only)."""
    return getattr(config, "attention_chunk_size", None)


def is_segment_ids(mask: Any) -> bool:
    """Whether an attention module's ``attention_mask`` is this implementation's segment ids."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and not mask.is_floating_point()
        and (mask.dtype != torch.bool)
    )


def fallbacks(config: Any) -> collections.Counter:
    """The dense masks built for ``config``'s model so far, by reason."""
    return _FALLBACKS.setdefault(id(config), collections.Counter())


def forget(config: Any) -> None:
    _FALLBACKS.pop(id(config), None)


def _cells(function) -> dict[str, Any]:
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in function.__closure__ or ())))


class _Unknown(Exception):
    pass


# The code objects of transformers' mask factories' closures, to recognise what they composed; filled
# by register(), before any mask is asked for (a plain dict: dynamo reads it, it would not trust a cache).
_FACTORIES: dict[str, Any] = {}


def _find_factories() -> dict[str, Any]:
    from transformers import masking_utils as mu

    # transformers 5.16 (axolotl 0.19 pins it) has no remap: it puts the packed factory on the
    # plain mask function, which within one document is the same mask.
    remap = getattr(mu, "remap_positions_for_packed_sequence", None)
    return {
        "and": mu.and_masks(mu.causal_mask_function).__code__,
        "window": mu.sliding_window_overlay(1).__code__,
        "chunk": mu.chunked_overlay(1, None).__code__,
        "remap": None if remap is None else remap(mu.causal_mask_function, None).__code__,
        "packed": mu.packed_sequence_mask_function(None).__code__,
        "causal": mu.causal_mask_function,
    }


def _describe(mask_function, factories) -> tuple[tuple[str, int] | None, torch.Tensor | None]:
    """(how far a query reaches: ("a sliding window", size), ("an attention chunk", size[, the positions its
    boundaries count: the documents' position_ids where transformers remaps them]) or None; packed-sequence
    ids or None) of a mask function transformers composed from causal, sliding-window, chunked and
    packed-sequence factories; _Unknown for anything else. A row no longer than its reach is causal within it: a
    chunk's boundaries are counted from a row's first real token (left padding), so its real tokens are in one."""
    if mask_function is factories["causal"]:
        return None, None
    if getattr(mask_function, "__code__", None) is not factories["and"]:
        raise _Unknown
    parts = _cells(mask_function)["mask_functions"]
    if len(parts) == 2 and parts[1] is factories["causal"] and parts[0].__code__ is factories["window"]:
        return ("a sliding window", _cells(parts[0])["sliding_window"]), None
    if len(parts) == 2 and parts[1] is factories["causal"] and parts[0].__code__ is factories["chunk"]:
        return ("an attention chunk", _cells(parts[0])["chunk_size"]), None
    if len(parts) == 2 and parts[1].__code__ is factories["packed"]:
        # Remapped positions (5.24) give a document the causal and window mask it has unremapped (5.16): the
        # differences of positions within a document are the same.
        remapped = factories["remap"] is not None and parts[0].__code__ is factories["remap"]
        reach, inner_packed = _describe(_cells(parts[0])["mask_function"] if remapped else parts[0], factories)
        if inner_packed is not None:
            raise _Unknown
        if remapped and reach is not None and reach[0] == "an attention chunk":
            # Chunks count positions, and remapped ones are each document's own (position_ids).
            reach = (*reach, _cells(parts[0])["position_ids"])
        return reach, _cells(parts[1])["packed_sequence_mask"]
    raise _Unknown


def _real_tokens_are_contiguous(mask: torch.Tensor) -> torch.Tensor:
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    return (starts.sum(1) <= 1).all()


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    config: Any = None,
    **kwargs,
):
    """The mask function registered for IMPLEMENTATION: segment ids, None, or SDPA's dense mask."""
    from transformers.masking_utils import sdpa_mask  # a submodule: dynamo 2.11 cannot import from the lazy package

    arguments = dict(q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function)
    arguments.update(attention_mask=attention_mask, use_vmap=use_vmap, config=config)
    return _segments_or(sdpa_mask, False, batch_size, q_length, kv_length, **arguments, **kwargs)


def eager_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    config: Any = None,
    **kwargs,
):
    """The mask function registered for eager_attention.IMPLEMENTATION: segment ids, None, or eager attention's
    dense (additive) mask. Left padding gets the dense mask: eager attention gives a query that sees no key
    (padding before a row's first real token) the mean of the row's values where segment_attention gives 0."""
    from transformers.masking_utils import eager_mask as dense_mask

    arguments = dict(q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function)
    arguments.update(attention_mask=attention_mask, use_vmap=use_vmap, config=config)
    return _segments_or(dense_mask, True, batch_size, q_length, kv_length, **arguments, **kwargs)


def _segments_or(
    dense_mask,
    eager: bool,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    mask_function,
    attention_mask: torch.Tensor | None,
    use_vmap: bool,
    config: Any,
    **kwargs,
):
    """Segment ids, None (plain causal), or dense_mask's mask where the ids cannot describe the mask
    transformers composed (counted by reason)."""
    dense = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        config=config,
        **kwargs,
    )
    if torch.compiler.is_compiling():
        if eager and attention_mask is not None:  # left padding shows only at run time: eager's dense mask
            return dense_mask(**dense)
        segments = _compiled_segments(
            batch_size,
            q_length,
            kv_length,
            q_offset,
            kv_offset,
            mask_function,
            attention_mask,
            use_vmap,
            config,
            kwargs.get("device"),
        )
        return dense_mask(**dense) if segments is _DENSE else segments
    reason = None
    padded = attention_mask is not None and not bool(attention_mask[:, -kv_length:].all())
    windows_pass = not padded and getattr(family_of(config), "passes_window", False)
    try:
        reach, packed = _describe(mask_function, _FACTORIES)
        if reach is not None and reach[0] == "a sliding window" and _read_by_no_layer(config):
            reach = None  # Qwen2-MoE's, built beside the causal mask with windows off: what it is does not matter
    except _Unknown:
        reason = "a mask transformers composed from other parts (overlays, bidirectional blocks)"
    else:
        if use_vmap:
            reason = "a custom mask function"
        elif q_length != kv_length or not isinstance(q_offset, int) or q_offset or kv_offset:
            reason = "a key/value cache (queries offset from keys)"
        elif reach is not None and q_length > reach[1] and not _reach_as_ids(reach, padded, windows_pass):
            reason = f"{reach[0]} ({reach[1]} tokens) shorter than the sequence ({q_length})"
        elif attention_mask is not None and not _real_tokens_are_contiguous(attention_mask[:, -kv_length:]):
            reason = "an attention_mask whose real tokens are not contiguous in a row"
        elif eager and attention_mask is not None and not bool(attention_mask[:, -kv_length:][:, 0].all()):
            reason = "left padding (eager attention gives a query that sees no key the mean of the row's values)"
    if reason is None:
        if reach is not None and q_length > reach[1]:  # ids, never None (a window: the attention function's)
            ids = packed if packed is not None else torch.zeros(batch_size, q_length, dtype=torch.long)
            if reach[0] == "an attention chunk":
                ids = _split_at_chunks(ids, *reach[1:])
            return ids.to(kwargs.get("device", ids.device))
        if packed is not None:
            return packed
        if padded:
            return attention_block_segment_ids(attention_mask=attention_mask[:, -kv_length:])
        return None
    fallbacks(config)[reason] += 1
    return dense_mask(**dense)


_DENSE = object()


def _read_by_no_layer(config: Any) -> bool:
    """Whether a sliding-window mask is read by no layer: the config says windows are off, and its layer_types
    have no sliding layer (the modelling code picks each layer's mask by its type)."""
    layer_types = getattr(config, "layer_types", None)
    return config_window(config) is None and layer_types is not None and "sliding_attention" not in layer_types


def _reach_as_ids(reach: tuple[str, int], padded: bool, windows_pass: bool) -> bool:
    """Whether segment ids describe a reach shorter than the row: a window the layer's attention passes to the
    attention function (which applies it as a band), or, in a row without padding, attention chunks (transformers
    counts a chunk's boundaries from the first real token: in an unpadded row, from the row's start)."""
    return (reach[0] == "a sliding window" and windows_pass) or (reach[0] == "an attention chunk" and not padded)


def _split_at_chunks(ids: torch.Tensor, chunk: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Segment ids (no padding) with a new segment where a chunk starts (its boundaries counted in ``positions``,
    [batch, T], else in the row): a query then sees the earlier tokens of its document within its chunk, as
    transformers' chunked mask has it."""
    positions = torch.arange(ids.shape[1], device=ids.device) if positions is None else positions.to(ids.device)
    chunk_starts = torch.nn.functional.pad(positions[..., 1:] // chunk != positions[..., :-1] // chunk, (1, 0))
    starts = torch.nn.functional.pad(ids[:, 1:] != ids[:, :-1], (1, 0), value=True) | chunk_starts
    return starts.long().cumsum(dim=1)


def _compiled_segments(
    batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, use_vmap, config, device
):
    """mask()'s answer under torch.compile, where dynamo cannot read a nested function's closure: the
    factories' cells are out of reach, their code objects are not. The families apply() switches
    (``masks`` "sdpa" in torch_offload.families) compose only causal, their config's sliding window and,
    with no attention_mask, the packed-sequence mask (under compile transformers always composes it
    when it has position_ids: it cannot check for a single sequence), and Llama 4's attention chunks, which
    mask() reads. So the mask
    function is evaluated instead, one key back from each query (mask_function(b, 0, i, i - 1)): false
    exactly where a document starts. Decided on static facts only (no graph break): a window shorter
    than the row (its layer or not: the config's window is all that is known), a chunk shorter than a row of an
    attention_mask, overlays (use_vmap) and
    a bidirectional config get _DENSE. What only the data shows is a runtime error: padding with holes,
    which segment ids cannot describe, and a query that sees the key after it (a composition this does
    not know, e.g. a bidirectional block)."""
    factories = _FACTORIES
    window, chunk = config_window(config), config_chunk(config)
    if (
        use_vmap
        or q_length != kv_length
        or not isinstance(q_offset, int)
        or q_offset
        or kv_offset
        or not getattr(config, "is_causal", True)
        or (window is not None and q_length > window)
        # Without an attention_mask, the mask function read below ends a segment where a chunk starts too.
        or (chunk is not None and q_length > chunk and attention_mask is not None)
        or (
            mask_function is not factories["causal"]
            and getattr(mask_function, "__code__", None) is not factories["and"]
        )
    ):
        return _DENSE
    rows = torch.arange(batch_size, device=device)[:, None]
    queries = torch.arange(1, q_length, device=device)[None, :]
    head = torch.zeros((), dtype=torch.long, device=device)
    sees_later = mask_function(rows, head, queries - 1, queries).any()
    if attention_mask is not None:
        real = attention_mask[:, -kv_length:]
        segment_ids = torch.ops.offload._assert_all(
            attention_block_segment_ids(attention_mask=real),
            _real_tokens_are_contiguous(real),
            "torch_offload: under torch.compile an attention_mask's real tokens must be contiguous "
            "in each row (padding only before or after them); this batch has a hole",
        )
    else:
        follows = mask_function(rows, head, queries, queries - 1)
        starts = torch.nn.functional.pad(~follows.expand(batch_size, q_length - 1), (1, 0), value=False)
        segment_ids = starts.long().cumsum(dim=1)
    # A pure op that returns the ids, so the check stays in the graph: torch 2.11's partitioner refuses
    # torch._assert_async in a graph with activation checkpointing.
    return torch.ops.offload._assert_all(
        segment_ids,
        ~sees_later,
        "torch_offload: under torch.compile the mask transformers composed lets a query see a later "
        "key, which segment ids cannot describe",
    )


def register() -> None:
    """Registers IMPLEMENTATION with transformers (once; registering again changes nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .segment_sdpa import attention  # which reads is_segment_ids from here

    if not _FACTORIES:
        _FACTORIES.update(_find_factories())
    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, mask)
