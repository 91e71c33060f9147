"""Causal attention over chunks of tokens for the chunk-recurrent step (chunk_recurrent.py), within segments.

The step's tokens are one row, or a batch's rows laid end to end; ``Segments`` says which keys a query sees: the
keys of its own segment at or before it. Each run of a row's real tokens is a segment (a packed document, a padded
row's text, a whole row); padding is no one's key, and a pad query sees the segment before it in its row, or nothing
(output 0): what apply's segment ids give (``attention_block_segment_ids``), and SDPA for a query whose every key is
masked. A pair of chunks (queries, keys) is cut into blocks, one per segment in both, each a contiguous run of
queries against a contiguous run of keys: all of it before the queries (another chunk), or causal from the same first
token (the same chunk). Each block runs through PyTorch's CPU flash-attention kernel unmasked, so no mask is ever
built, and a pair with no block (documents apart) reads nothing.

Forward joins a chunk of queries' pairs by their log-sum-exps (an online softmax). Backward takes one chunk of
queries against every chunk of keys up to it, each block given the whole row's output and log-sum-exp, which makes
its gradients its exact share: the queries' gradient whole, the keys' and values' each pair's share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .chunk_file import return_freed_memory

__all__ = ["Heads", "Segments", "attend", "attend_backward"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class Heads:
    """What one attention call's heads need: the scores' scale and the query heads per key/value head."""

    scaling: float
    groups: int

    def by_head(self, keys: torch.Tensor, width: int) -> torch.Tensor:
        """Keys or values ``[kv heads, C, d]`` for every query head (transformers' repeat_kv), a batch of one, their
        last dimension zero-padded to ``width``: the flash kernel takes one head width, and zeros change no score
        (keys) and give outputs' columns that are cut off (values)."""
        kv_heads, length, dim = keys.shape
        expanded = keys[:, None].expand(kv_heads, self.groups, length, dim).reshape(1, -1, length, dim)
        return F.pad(expanded, (0, width - dim)) if width > dim else expanded

    def by_key_head(self, gradient: torch.Tensor, dim: int) -> torch.Tensor:
        """A gradient ``[1, heads, C, width]`` of by_head's output back to ``[kv heads, C, dim]``."""
        _, heads, length, _ = gradient.shape
        return gradient[0, :, :, :dim].reshape(heads // self.groups, self.groups, length, dim).sum(1)


def _runs(segments: torch.Tensor) -> dict[int, slice]:
    """Each segment's run of positions in one chunk (a segment's tokens are contiguous), the -1 runs left out."""
    values, counts = torch.unique_consecutive(segments, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return {v: slice(end - n, end) for v, n, end in zip(values.tolist(), counts.tolist(), ends) if v >= 0}


class Segments:
    """Which keys each query sees, as blocks of pairs of chunks.

    ``query_segments`` and ``key_segments`` (``[tokens]`` int64, or both None for one causal sequence) give each
    token the segment it sees as a query and the one it belongs to as a key, -1 for none. A segment's tokens are
    contiguous, and so are the queries that see it (its tokens, then the padding after them in their row)."""

    def __init__(self, bounds, query_segments: torch.Tensor | None = None, key_segments: torch.Tensor | None = None):
        self.bounds = bounds
        self._runs = None
        if query_segments is not None:
            self._runs = [(_runs(query_segments[start:end]), _runs(key_segments[start:end])) for start, end in bounds]

    def blocks(self, queries_chunk: int, keys_chunk: int) -> list[tuple[slice, slice, bool]]:
        """``(queries, keys, causal)`` within ``queries_chunk`` and ``keys_chunk`` (at or before it): the queries
        that see those keys, and whether the kernel's causal mask (aligned at their first token) applies."""
        diagonal = queries_chunk == keys_chunk
        if self._runs is None:
            return [(slice(None), slice(None), diagonal)]
        queries, keys = self._runs[queries_chunk][0], self._runs[keys_chunk][1]
        return [(rows, keys[segment], diagonal) for segment, rows in queries.items() if segment in keys]


def attend(heads: Heads, segments: Segments, chunk: int, q, keys_and_values):
    """Attention of one chunk of queries ``[heads, C, d]`` to the keys and values ``[kv heads, C', d]`` (``[.., dv]``)
    of every chunk up to it (``keys_and_values(chunk)``), block by block, the pairs joined by their log-sum-exps: the
    output ``[heads, C, dv]`` in the queries' dtype and the log-sum-exp (float32, float64 for float64) per head and
    query, -inf for a query that sees no key."""
    compute = torch.promote_types(q.dtype, torch.float32)
    value_dim = keys_and_values(chunk)[1].shape[-1]
    width = max(q.shape[-1], value_dim)
    query = F.pad(q.to(compute), (0, width - q.shape[-1]))[None]
    out = torch.zeros((1, q.shape[0], q.shape[1], value_dim), dtype=compute)
    log_sum_exp = torch.full(query.shape[:3], float("-inf"), dtype=compute)  # a query that sees no key: output 0
    for earlier in range(chunk + 1):
        blocks = segments.blocks(chunk, earlier)
        if not blocks:
            continue
        k, v = (heads.by_head(t.to(compute), width) for t in keys_and_values(earlier))
        if blocks[0][0] == slice(None):  # one sequence: the whole pair in one call
            pair_out, pair_log_sum_exp = _FLASH(query, k, v, 0.0, blocks[0][2], scale=heads.scaling)
        else:
            pair_out, pair_log_sum_exp = torch.zeros_like(query), torch.full_like(log_sum_exp, float("-inf"))
            for rows, keys, causal in blocks:
                pair_out[:, :, rows], pair_log_sum_exp[:, :, rows] = _FLASH(
                    query[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0, causal, scale=heads.scaling
                )
        joined = torch.logaddexp(log_sum_exp, pair_log_sum_exp)
        base = joined.masked_fill(joined == float("-inf"), 0.0)
        out.mul_(log_sum_exp.sub_(base).exp_()[..., None]).add_(
            pair_out[..., :value_dim].mul_(pair_log_sum_exp.sub_(base).exp_()[..., None])
        )
        log_sum_exp = joined
    return out[0].to(q.dtype), log_sum_exp[0]


def attend_backward(
    heads: Heads, segments: Segments, chunk: int, q, grad_out, out, log_sum_exp, keys_and_values, add_share
):
    """attend's gradients for one chunk of queries: the queries' gradient ``[heads, C, d]``, returned, and for each
    chunk of keys up to it that a block reads, its share of the keys' and values' gradients, handed to
    ``add_share(earlier, grad k, grad v)`` (``[kv heads, C', d]``, in the compute dtype). ``out`` and
    ``log_sum_exp`` are the whole row's (attend's), ``grad_out`` their output's gradient."""
    compute = torch.promote_types(q.dtype, torch.float32)
    value_dim = out.shape[-1]
    width = max(q.shape[-1], value_dim)
    query = F.pad(q.to(compute), (0, width - q.shape[-1]))[None]
    grad_out, out = (F.pad(t.to(compute), (0, width - value_dim))[None] for t in (grad_out, out))
    log_sum_exp = log_sum_exp[None]
    grad_q = torch.zeros_like(query)
    for earlier in range(chunk + 1):
        blocks = segments.blocks(chunk, earlier)
        if not blocks:
            continue
        k, v = keys_and_values(earlier)
        k_heads, v_heads = heads.by_head(k.to(compute), width), heads.by_head(v.to(compute), width)
        grad_k, grad_v = torch.zeros_like(k_heads), torch.zeros_like(v_heads)
        for rows, keys, causal in blocks:
            block_grad_q, block_grad_k, block_grad_v = _FLASH_BACKWARD(
                grad_out[:, :, rows],
                query[:, :, rows],
                k_heads[:, :, keys],
                v_heads[:, :, keys],
                out[:, :, rows],
                log_sum_exp[:, :, rows],
                0.0,
                causal,
                scale=heads.scaling,
            )
            grad_q[:, :, rows].add_(block_grad_q)  # in place through views: no copy back
            grad_k[:, :, keys].add_(block_grad_k)
            grad_v[:, :, keys].add_(block_grad_v)
        add_share(earlier, heads.by_key_head(grad_k, k.shape[-1]), heads.by_key_head(grad_v, v.shape[-1]))
        return_freed_memory()
    return grad_q[0, ..., : q.shape[-1]]
