"""Causal attention over chunks of tokens for the chunk-recurrent step (chunk_recurrent.py), within segments.

The step's tokens are one row, or a batch's rows laid end to end; ``Segments`` says which keys a query sees: the
keys of its own segment at or before it. Each run of a row's real tokens is a segment (a packed document, a padded
row's text, a whole row); padding is no one's key, and a pad query sees the segment before it in its row, or nothing
(output 0): what apply's segment ids give (``attention_block_segment_ids``), and SDPA for a query whose every key is
masked. A pair of chunks (queries, keys) is cut into blocks, one per segment in both, each a contiguous run of
queries against a contiguous run of keys: all of it before the queries (another chunk), or causal from the same first
token (the same chunk). Each block runs through PyTorch's CPU flash-attention kernel unmasked, so no mask is ever
built, and a pair with no block (documents apart) reads nothing.

Forward joins a chunk of queries' pairs by their log-sum-exps (an online softmax). Backward runs FlashAttention-2's
order, each chunk of keys against every chunk of queries at or after it, each block given the whole row's output and
log-sum-exp, which makes its gradients its exact share.
"""

from __future__ import annotations

import torch

from .chunk_file import return_freed_memory

__all__ = ["Segments", "attend", "attention_backward"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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


def attend(heads, segments: Segments, chunk: int, q, k_here, v_here, earlier_keys_and_values):
    """Attention of one chunk of queries ``[heads, C, d]`` to the keys and values of every chunk up to it (this
    chunk's given, an earlier one's from ``earlier_keys_and_values(chunk)``), block by block, the pairs joined by
    their log-sum-exps: the output in the queries' dtype and the log-sum-exp (float32, float64 for float64) per head
    and query, -inf for a query that sees no key."""
    compute = torch.promote_types(q.dtype, torch.float32)
    q = q.to(compute)[None]
    out = log_sum_exp = None
    for earlier in range(chunk + 1):
        blocks = segments.blocks(chunk, earlier)
        if not blocks:
            continue
        k, v = (k_here, v_here) if earlier == chunk else earlier_keys_and_values(earlier)
        k, v = heads.by_head(k.to(compute)), heads.by_head(v.to(compute))
        if blocks[0][0] == slice(None):  # one sequence: the whole pair in one call
            pair_out, pair_log_sum_exp = _FLASH(q, k, v, 0.0, blocks[0][2], scale=heads.scaling)
        else:
            pair_out, pair_log_sum_exp = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=compute)
            for rows, keys, causal in blocks:
                pair_out[:, :, rows], pair_log_sum_exp[:, :, rows] = _FLASH(
                    q[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0, causal, scale=heads.scaling
                )
        if out is None:  # the first pair: its output and log-sum-exp as they are
            out, log_sum_exp = pair_out, pair_log_sum_exp
            continue
        joined = torch.logaddexp(log_sum_exp, pair_log_sum_exp)
        base = joined.masked_fill(joined == float("-inf"), 0.0)  # a query that sees no key yet keeps output 0
        out.mul_(log_sum_exp.sub_(base).exp_()[..., None]).add_(
            pair_out.mul_(pair_log_sum_exp.sub_(base).exp_()[..., None])
        )
        log_sum_exp = joined
    if out is None:  # padding that sees no key
        out, log_sum_exp = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=compute)
    return out[0].to(k_here.dtype), log_sum_exp[0]


def attention_backward(heads, segments: Segments, read, write) -> None:
    """FlashAttention-2's backward over chunks: for each chunk of keys and values, every chunk of queries at or
    after it that sees them. ``read(name, chunk)`` gives what forward kept ("q", "k", "v", "attended", "lse") and the
    output's gradient ("grad attended"); ``write(name, chunk, tensor)`` takes each chunk's "grad q", "grad k" and
    "grad v" (zeros where no block had any)."""
    chunks = len(segments.bounds)
    started = set()  # the chunks of queries whose gradient is in the file
    for keys_chunk in range(chunks):
        k, v = read("k", keys_chunk), read("v", keys_chunk)
        compute = torch.promote_types(k.dtype, torch.float32)
        k_heads, v_heads = heads.by_head(k.to(compute)), heads.by_head(v.to(compute))
        grad_k, grad_v = torch.zeros_like(k_heads), torch.zeros_like(v_heads)
        for queries_chunk in range(keys_chunk, chunks):
            blocks = segments.blocks(queries_chunk, keys_chunk)
            if not blocks:
                continue
            q, grad_out, attended = (
                read(name, queries_chunk).to(compute)[None] for name in ("q", "grad attended", "attended")
            )
            log_sum_exp = read("lse", queries_chunk)[None]
            grad_q = read("grad q", queries_chunk)[None] if queries_chunk in started else None
            if grad_q is None and blocks[0][0] != slice(None):
                grad_q = torch.zeros_like(q)
            for rows, keys, causal in blocks:
                block_grad_q, block_grad_k, block_grad_v = _FLASH_BACKWARD(
                    grad_out[:, :, rows],
                    q[:, :, rows],
                    k_heads[:, :, keys],
                    v_heads[:, :, keys],
                    attended[:, :, rows],
                    log_sum_exp[:, :, rows],
                    0.0,
                    causal,
                    scale=heads.scaling,
                )
                if grad_q is None:  # the first pair of one sequence: its gradient as it is
                    grad_q = block_grad_q
                else:
                    grad_q[:, :, rows].add_(block_grad_q)  # in place through views: no copy back
                grad_k[:, :, keys].add_(block_grad_k)
                grad_v[:, :, keys].add_(block_grad_v)
            write("grad q", queries_chunk, grad_q[0])
            started.add(queries_chunk)
        kv_shape = (k.shape[0], heads.groups, *k.shape[1:])
        return_freed_memory()
        write("grad k", keys_chunk, grad_k.view(kv_shape).sum(1))
        write("grad v", keys_chunk, grad_v.view(kv_shape).sum(1))
    for queries_chunk in set(range(chunks)) - started:  # padding that sees nothing
        q = read("q", queries_chunk)
        write("grad q", queries_chunk, torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32)))
