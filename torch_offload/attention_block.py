"""A decoder layer's attention, from its normalized input to its output projection, computed
one group of heads at a time: ``attention_block`` (the ``torch.ops.offload.attention_block`` op)."""

from __future__ import annotations

import torch

from . import _require_tensor

__all__ = ["attention_block", "attention_block_attend", "attention_block_segment_ids", "segment_attention"]


def attention_block(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    w_o: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    b_q: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    b_o: torch.Tensor | None = None,
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
    group_name: str | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    attention: torch.Tensor | None = None,
    logsumexp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal self-attention with rotary embeddings and its projections, as Llama's (differentiable).

    With ``x`` ``[batch, tokens, h]``, ``cos`` and ``sin`` ``[1 or batch, tokens, head_dim]``
    (transformers' rotary tables), ``w_q`` ``[heads * head_dim, h]``, ``w_k`` and ``w_v``
    ``[kv_heads * head_dim, h]`` (grouped-query attention when ``kv_heads < heads``) and
    ``w_o`` ``[out_features, heads * head_dim]``: ``q = rope(x @ w_q.T + b_q)``,
    ``k = rope(x @ w_k.T + b_k)``, ``v = x @ w_v.T + b_v``, per head
    ``softmax(q @ k.T * scale, causal) @ v``, and the heads' outputs through ``w_o`` and
    ``b_o``. ``rope`` is transformers' ``apply_rotary_pos_emb`` (rotate_half); ``scale``
    defaults to ``head_dim ** -0.5``.

    ``q_norm`` and ``k_norm`` ``[head_dim]`` (Qwen3's per-head norms): each head's q (k) before the
    rotary embedding goes through an RMSNorm over its ``head_dim`` values with that weight and
    ``norm_eps``, as transformers' ``Qwen3RMSNorm`` computes it (in float32 for bf16/fp16, rounded to
    ``x``'s dtype, then times the weight); they get gradients. ``[heads * head_dim]`` and
    ``[kv_heads * head_dim]`` (OLMo 2's): the RMSNorm runs over each token's whole q (k) projection,
    as ``Olmo2RMSNorm`` computes it (in float32 for bf16/fp16, times the weight, rounded once).

    It runs one group of heads at a time (as many as fit in 16 MiB of per-group tensors),
    so one group's q, k, v and attention output exist at once; backward saves only the
    inputs and recomputes each group. ``cos`` and ``sin`` get no gradient (an error if
    they require one).

    ``segment_ids`` ``[batch, tokens]`` (int64 or int32) cuts the rows into causal segments:
    each maximal run of non-negative equal ids in a row is one sequence (a packed document, a
    row's real tokens), and its tokens attend to the earlier tokens of their own run only. Tokens
    with a negative id (padding) are no one's keys; they attend to all of the nearest sequence
    before them in their row, or, with none, to nothing (output 0, as SDPA gives a query whose
    every key is masked). That is transformers' packed-sequence mask, and its padding mask where
    a row's real tokens are contiguous, for every token. No ``[tokens, tokens]`` mask is made:
    each run is its own attention call.
    ``attention_block_segment_ids(position_ids=..., attention_mask=...)`` makes them.

    ``group_name`` (sequence parallelism: a torch.distributed group's ``group_name``): ``x``, ``cos``
    and ``sin`` are this rank's contiguous chunk of the rows and ``segment_ids`` the whole rows';
    each head group's q, k and v go to the whole rows for a share of its heads by an all-to-all,
    and its attention output comes back by another (as ``ulysses_attention``), in forward and in
    backward's recompute. ``heads`` must be a multiple of the ranks. Every rank calls it alike.

    ``attention`` and ``logsumexp``: ``attention_block_attend``'s outputs for the same arguments. The op then
    computes the output projection alone (one GEMM over every head), saves them with its inputs, and its backward
    hands them to the attention kernels' backward: no attention forward runs again. They get no gradient.
    """
    for value, arg in ((x, "x"), (w_q, "w_q"), (w_k, "w_k"), (w_v, "w_v"), (w_o, "w_o"), (cos, "cos"), (sin, "sin")):
        _require_tensor(value, "attention_block", arg)
    # The norms' arguments only where there are norms: under torch.compile(dynamic=True) before torch 2.15, a float
    # reaching a checkpoint's subgraph as a graph input trips pytorch/pytorch#193194 (test_compile's GPT-2).
    saved = (attention, logsumexp) if attention is not None or logsumexp is not None else ()
    norms = (q_norm, k_norm, norm_eps) if q_norm is not None or k_norm is not None or saved else ()
    return torch.ops.offload.attention_block(
        x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale, segment_ids, group_name, *norms, *saved
    )


def attention_block_attend(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    b_q: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
    group_name: str | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_block``'s forward up to its output projection, for a step that runs each attention forward
    once (the ``torch.ops.offload.attention_block_attend`` op; not differentiable).

    Takes ``attention_block``'s arguments but ``w_o`` and ``b_o``; returns ``(attention, logsumexp)``:
    ``attention`` ``[batch, tokens, heads * head_dim]`` in ``x``'s dtype, every head's output as ``w_o`` takes
    it, and ``logsumexp`` ``[heads / ranks, batch, tokens * ranks]`` (float32, float64 for float64 ``x``), each
    query's log-sum-exp over its keys (with ``group_name``, over the whole rows for the heads this rank attended,
    head group by head group; 0 for padding that sees no key). Passed to ``attention_block`` with the same
    arguments on the same device (the head groups depend on both), they make its forward the output projection
    alone and its backward recompute no attention forward.
    """
    for value, arg in ((x, "x"), (w_q, "w_q"), (w_k, "w_k"), (w_v, "w_v"), (cos, "cos"), (sin, "sin")):
        _require_tensor(value, "attention_block_attend", arg)
    return torch.ops.offload.attention_block_attend(
        x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v, scale, segment_ids, group_name, q_norm, k_norm, norm_eps
    )


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``attention_block``'s attention alone, for attention modules whose projections it does not replace
    (differentiable; the ``torch.ops.offload.segment_attention`` op).

    ``query`` and ``key`` ``[batch, heads, tokens, head_dim]`` (key/value heads repeated to the query's),
    ``value`` ``[batch, heads, tokens, value_head_dim]`` (multi-head latent attention's is narrower than its
    query's; the kernels then get the narrower side padded with zeros), ``segment_ids`` ``[batch, tokens]`` as
    ``attention_block``'s: each query attends causally within its sequence, padding to the nearest sequence
    before it. One attention call per segment, no ``[tokens, tokens]`` mask; backward saves only the inputs
    and recomputes. ``scale`` defaults to ``head_dim ** -0.5``. Returns ``[batch, heads, tokens,
    value_head_dim]``.

    ``softcap`` caps the scores to ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2's
    ``attn_logit_softcapping``). ``sinks`` ``[heads]`` (GPT-OSS's learned sinks) are one more logit per head in
    each query's softmax, with no value: they only take weight from the keys; they get a gradient. ``window`` (a
    sliding window, as transformers' ``sliding_window``) lets a sequence's token see only the ``window - 1`` tokens
    before it; padding that would see its sequence past the window is refused. Any of them runs
    the attention in ATen, a chunk of queries at a time (PyTorch's fused kernels compute neither): each chunk's
    scores ``[chunk, keys]`` are written out within 32 MiB, in float32 for bf16/fp16.
    """
    for t, arg in ((query, "query"), (key, "key"), (value, "value"), (segment_ids, "segment_ids")):
        _require_tensor(t, "segment_attention", arg)
    # The score mods' arguments only where given (see attention_block's norms: pytorch/pytorch#193194).
    mods = (softcap, sinks, window) if any(m is not None for m in (softcap, sinks, window)) else ()
    return torch.ops.offload.segment_attention(query, key, value, segment_ids, scale, *mods)


def attention_block_segment_ids(
    *, position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, batch: int | None = None
) -> torch.Tensor | None:
    """``attention_block``'s ``segment_ids`` ``[batch, tokens]`` for a batch as transformers sees it.

    With a 2-D ``attention_mask`` (1 for real tokens, 0 for padding): padding gets id -1 and each
    run of real tokens an id of its own, so a row's real tokens are one causal sequence when they
    are contiguous, as transformers' mask has them; where they are not (holes), a real token sees
    only its own run, unlike transformers (apply() checks this and builds its dense mask then).
    transformers ignores ``position_ids`` for packing when a mask is given, and so does this.
    Otherwise with ``position_ids`` (``[1 or batch, tokens]``): a new segment wherever a position
    is not the previous one plus 1 (packed documents restarting at 0), as transformers'
    ``find_packed_sequence_indices``. ``None`` when neither is given. Tensor ops only (no data-
    dependent shapes), so it traces under ``torch.compile``.
    """
    if attention_mask is not None:
        real = attention_mask.bool()
        starts = torch.cat([real[:, :1], real[:, 1:] & ~real[:, :-1]], dim=1)
        return torch.where(real, starts.cumsum(dim=1), -1)
    if position_ids is None:
        return None
    if batch is not None:
        position_ids = position_ids.expand(batch, -1)
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).cumsum(dim=1)
