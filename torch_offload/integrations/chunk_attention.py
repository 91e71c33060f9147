"""Causal attention over chunks of tokens for the chunk-recurrent step (chunk_recurrent.py), within segments.

The step's tokens are one row, or a batch's rows laid end to end; ``Segments`` says which keys a query sees: the
keys of its own segment at or before it. Each run of a row's real tokens is a segment (a packed document, a padded
row's text, a whole row); padding is no one's key, and a pad query sees the segment before it in its row, or nothing
(output 0): what apply's segment ids give (``attention_block_segment_ids``), and SDPA for a query whose every key is
masked. A pair of chunks (queries, keys) is cut into blocks, one per segment in both, each a contiguous run of
queries against a contiguous run of keys: all of it before the queries (another chunk), or causal from the same first
token (the same chunk). Each block runs through an attention kernel unmasked (chunk_kernels.py: PyTorch's flash
kernels on the CPU and on CUDA), so no mask is ever built, and a pair with no block (documents apart) reads nothing.

Forward joins a chunk of queries' pairs by their log-sum-exps (an online softmax). Backward takes one chunk of
queries against every chunk of keys up to it, each block given the whole row's output and log-sum-exp, which makes
its gradients its exact share: the queries' gradient whole, the keys' and values' each pair's share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .chunk_kernels import block_backward, block_forward, kernel_dtype
from .chunk_store import return_freed_memory

__all__ = ["Heads", "Segments", "attend", "attend_backward"]


@dataclass(frozen=True)
class Heads:
    """What one attention call's heads need: the scores' scale, the query heads per key/value head, and the score
    mods the model's attention passes: a soft-cap (``cap * tanh(score / cap)``), a sliding window (a query sees
    ``window`` keys at most: itself and those just before it), sinks (one more logit per head in each query's softmax,
    with no value), attention chunks (a query sees only the keys of its own ``attention_chunk`` tokens, as
    ``Segments.chunked_places`` count them: Llama 4's chunked attention)."""

    scaling: float
    groups: int
    softcap: float | None = None
    window: int | None = None
    sinks: torch.Tensor | None = None
    attention_chunk: int | None = None

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

    def before_any_key(self, heads: int, queries: int, like: torch.Tensor) -> torch.Tensor:
        """Each query's log-sum-exp before any key, ``[1, heads, queries]`` in ``like``'s dtype and device: its
        head's sink, else -inf."""
        if self.sinks is None:
            return like.new_full((1, heads, queries), float("-inf"))
        return self.sinks.detach().to(like)[None, :, None].expand(1, heads, queries).clone()


@dataclass(frozen=True)
class _Block:
    """A block of a pair of chunks: queries ``rows`` of their chunk against keys ``keys`` of theirs, whose first
    tokens stand at ``query_start`` and ``key_start`` in the batch laid end to end; ``causal``: the two begin at the
    same token, and a query sees the keys up to itself."""

    rows: slice
    keys: slice
    causal: bool
    query_start: int
    key_start: int

    def reach(self, heads: Heads, queries: int, keys: int) -> str:
        """ "all" where the window hides none of the block's keys from its queries, "none" where it hides every
        one, else "some"."""
        if heads.window is None:
            return "all"
        farthest = self.query_start + queries - 1 - self.key_start  # the last query and the first key
        nearest = 0 if self.causal else self.query_start - (self.key_start + keys - 1)
        return "all" if farthest < heads.window else "none" if nearest >= heads.window else "some"


def _runs(segments: torch.Tensor) -> dict[int, slice]:
    """Each segment's run of positions in one chunk (a segment's tokens are contiguous), the -1 runs left out."""
    values, counts = torch.unique_consecutive(segments, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return {v: slice(end - n, end) for v, n, end in zip(values.tolist(), counts.tolist(), ends) if v >= 0}


class Segments:
    """Which keys each query sees, as blocks of pairs of chunks.

    ``query_segments`` and ``key_segments`` (``[tokens]`` int64, or both None for one causal sequence) give each
    token the segment it sees as a query and the one it belongs to as a key, -1 for none. A segment's tokens are
    contiguous, and so are the queries that see it (its tokens, then the padding after them in their row).
    ``chunked_places`` (``[tokens]``, where given) are the places attention chunks are counted from."""

    def __init__(
        self,
        bounds,
        query_segments: torch.Tensor | None = None,
        key_segments: torch.Tensor | None = None,
        chunked_places: torch.Tensor | None = None,
    ):
        self.bounds = bounds
        self._segments, self._chunked_places, self._within_chunks = (query_segments, key_segments), chunked_places, {}
        self._runs = None
        if query_segments is not None:
            self._runs = [(_runs(query_segments[start:end]), _runs(key_segments[start:end])) for start, end in bounds]

    def seen_by(self, heads: Heads) -> Segments:
        """These segments as ``heads`` see them: cut at the bounds of its attention chunks, where it has them (a
        segment's run within one attention chunk is a segment of its own)."""
        size = heads.attention_chunk
        if size is None:
            return self
        if size not in self._within_chunks:
            if self._chunked_places is None:
                raise ValueError("Segments: attention chunks asked for without the places they are counted from")
            queries, keys = self._segments
            if queries is None:
                queries = keys = torch.zeros_like(self._chunked_places)
            chunk = self._chunked_places.div(size, rounding_mode="floor")
            chunk = chunk - chunk.min()
            count = int(chunk.max()) + 1
            queries, keys = (torch.where(ids >= 0, ids * count + chunk, -1) for ids in (queries, keys))
            self._within_chunks[size] = Segments(self.bounds, queries, keys)
        return self._within_chunks[size]

    def blocks(self, queries_chunk: int, keys_chunk: int) -> list[_Block]:
        """The blocks of ``queries_chunk`` against ``keys_chunk`` (at or before it): the queries that see those
        keys."""
        diagonal = queries_chunk == keys_chunk
        query_start, key_start = self.bounds[queries_chunk][0], self.bounds[keys_chunk][0]
        if self._runs is None:
            return [_Block(slice(None), slice(None), diagonal, query_start, key_start)]
        queries, keys = self._runs[queries_chunk][0], self._runs[keys_chunk][1]
        return [
            _Block(rows, keys[segment], diagonal, query_start + rows.start, key_start + keys[segment].start)
            for segment, rows in queries.items()
            if segment in keys
        ]


def attend(heads: Heads, segments: Segments, chunk: int, q, keys_and_values, read_ahead=None):
    """Attention of one chunk of queries ``[heads, C, d]`` to the keys and values ``[kv heads, C', d]`` (``[.., dv]``)
    of every chunk up to it (``keys_and_values(chunk)``), block by block, the pairs joined by their log-sum-exps: the
    output ``[heads, C, dv]`` in the queries' dtype and the log-sum-exp (float32, float64 for float64) per head and
    query, the sinks' included; -inf (output 0) for a query that sees no key and no sink. ``read_ahead(chunk)``
    (where given) is told the chunk whose keys and values come next, before this one's are computed with. The blocks
    run in chunk_kernels.kernel_dtype, the pairs are joined in at least float32."""
    compute, join_dtype = kernel_dtype(q), torch.promote_types(q.dtype, torch.float32)
    value_dim = keys_and_values(chunk)[1].shape[-1]  # the queries' own chunk's: at hand (chunk_seam.py)
    width = max(q.shape[-1], value_dim)
    query = F.pad(q.to(compute), (0, width - q.shape[-1]))[None]
    out = query.new_zeros((1, q.shape[0], q.shape[1], value_dim), dtype=join_dtype)
    log_sum_exp = heads.before_any_key(q.shape[0], q.shape[1], out)
    for earlier, blocks in _pairs(heads, segments, chunk, query, read_ahead):
        k, v = (heads.by_head(t.to(compute), width) for t in keys_and_values(earlier))
        pair_out, pair_log_sum_exp = torch.zeros_like(query), torch.full_like(log_sum_exp, float("-inf"))
        for block in blocks:
            rows, keys = block.rows, block.keys
            pair_out[:, :, rows], pair_log_sum_exp[:, :, rows] = _block_forward(
                heads, block, query[:, :, rows], k[:, :, keys], v[:, :, keys]
            )
        joined = torch.logaddexp(log_sum_exp, pair_log_sum_exp)
        base = joined.masked_fill(joined == float("-inf"), 0.0)
        out.mul_(log_sum_exp.sub_(base).exp_()[..., None]).add_(
            pair_out[..., :value_dim].to(join_dtype).mul_(pair_log_sum_exp.sub_(base).exp_()[..., None])
        )
        log_sum_exp = joined
    return out[0].to(q.dtype), log_sum_exp[0]


def attend_backward(
    heads: Heads,
    segments: Segments,
    chunk: int,
    q,
    grad_out,
    out,
    log_sum_exp,
    keys_and_values,
    add_share,
    read_ahead=None,
):
    """attend's gradients for one chunk of queries: the queries' gradient ``[heads, C, d]`` and the sinks' share
    (``[heads]``, None without sinks), returned, and for each chunk of keys up to it that a block reads, its share
    of the keys' and values' gradients, handed to ``add_share(earlier, grad k, grad v)`` (``[kv heads, C', d]``, in
    at least float32, as the queries' gradient). ``out`` and ``log_sum_exp`` are the whole row's (attend's),
    ``grad_out`` their output's gradient."""
    compute, join_dtype = kernel_dtype(q), torch.promote_types(q.dtype, torch.float32)
    value_dim = out.shape[-1]
    width = max(q.shape[-1], value_dim)
    query = F.pad(q.to(compute), (0, width - q.shape[-1]))[None]
    grad_out, out = (F.pad(t.to(compute), (0, width - value_dim))[None] for t in (grad_out, out))
    log_sum_exp = log_sum_exp[None]
    grad_q = query.new_zeros(query.shape, dtype=join_dtype)
    for earlier, blocks in _pairs(heads, segments, chunk, query, read_ahead):
        k, v = keys_and_values(earlier)
        k_heads, v_heads = heads.by_head(k.to(compute), width), heads.by_head(v.to(compute), width)
        grad_k, grad_v = (t.new_zeros(t.shape, dtype=join_dtype) for t in (k_heads, v_heads))
        for block in blocks:
            rows, keys = block.rows, block.keys
            block_grad_q, block_grad_k, block_grad_v = _block_backward(
                heads,
                block,
                grad_out[:, :, rows],
                query[:, :, rows],
                k_heads[:, :, keys],
                v_heads[:, :, keys],
                out[:, :, rows],
                log_sum_exp[:, :, rows],
            )
            grad_q[:, :, rows].add_(block_grad_q)  # in place through views: no copy back
            grad_k[:, :, keys].add_(block_grad_k)
            grad_v[:, :, keys].add_(block_grad_v)
        add_share(earlier, heads.by_key_head(grad_k, k.shape[-1]), heads.by_key_head(grad_v, v.shape[-1]))
        return_freed_memory()
    grad_sinks = None
    if heads.sinks is not None:  # d out_i / d sink = -p_sink_i out_i: the sink's gradient -sum_i p_sink_i (dO_i . O_i)
        sink_share = (heads.sinks.detach().to(join_dtype)[None, :, None] - log_sum_exp).exp()
        grad_sinks = -(sink_share * (grad_out.to(join_dtype) * out.to(join_dtype)).sum(-1)).sum((0, 2))
    return grad_q[0, ..., : q.shape[-1]], grad_sinks


def _pairs(heads: Heads, segments: Segments, chunk: int, query, read_ahead):
    """The chunks of keys up to ``chunk`` that some block of its queries reads, each with those blocks; before each
    is computed with, ``read_ahead`` (where given) is told the next one read, so that a chunk no block reads (another
    document's, one past a window) is never read ahead and left in memory."""
    segments = segments.seen_by(heads)
    pairs = []
    for earlier in range(chunk + 1):
        blocks = [b for b in segments.blocks(chunk, earlier) if _reach(heads, b, query, segments, earlier) != "none"]
        if blocks:
            pairs.append((earlier, blocks))
    for index, (earlier, blocks) in enumerate(pairs):
        following = pairs[index + 1][0] if index + 1 < len(pairs) else chunk
        if read_ahead is not None and following < chunk:  # the queries' own chunk is at hand
            read_ahead(following)
        yield earlier, blocks


def _reach(heads: Heads, block: _Block, query, segments: Segments, keys_chunk: int) -> str:
    queries = query.shape[2] if block.rows == slice(None) else block.rows.stop - block.rows.start
    start, end = segments.bounds[keys_chunk]
    keys = end - start if block.keys == slice(None) else block.keys.stop - block.keys.start
    return block.reach(heads, queries, keys)


def _block_forward(heads: Heads, block: _Block, q, k, v):
    """One block's output and log-sum-exp (queries that see no key of it: 0 and -inf): an attention kernel
    (chunk_kernels.py) where no score mod touches it, else its scores written out in at least float32, a piece of its
    queries at a time (_pieces)."""
    if heads.softcap is None and block.reach(heads, q.shape[2], k.shape[2]) == "all":
        return block_forward(q, k, v, block.causal, heads.scaling)
    q, k, v = _at_least_float32(q, k, v)
    out = q.new_zeros((*q.shape[:3], v.shape[-1]))
    log_sum_exp = q.new_full(q.shape[:3], float("-inf"))
    for rows, keys, piece in _pieces(heads, block, q, k):
        scores, _ = _scores(heads, piece, q[:, :, rows], k[:, :, keys])
        piece_log_sum_exp = scores.logsumexp(-1)
        base = piece_log_sum_exp.masked_fill(piece_log_sum_exp == float("-inf"), 0.0)
        out[:, :, rows] = (scores - base[..., None]).exp() @ v[:, :, keys]
        log_sum_exp[:, :, rows] = piece_log_sum_exp
    return out, log_sum_exp


def _block_backward(heads: Heads, block: _Block, grad_out, q, k, v, out, log_sum_exp):
    """One block's share of the gradients of q, k and v, given the whole row's output and log-sum-exp."""
    if heads.softcap is None and block.reach(heads, q.shape[2], k.shape[2]) == "all":
        return block_backward(grad_out, q, k, v, out, log_sum_exp, block.causal, heads.scaling)
    grad_out, q, k, v, out, log_sum_exp = _at_least_float32(grad_out, q, k, v, out, log_sum_exp)
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    base = log_sum_exp.masked_fill(log_sum_exp == float("-inf"), 0.0)
    delta = (grad_out * out).sum(-1, keepdim=True)  # each query's dO . O: the softmax's gradient takes it off
    for rows, keys, piece in _pieces(heads, block, q, k):
        scores, slope = _scores(heads, piece, q[:, :, rows], k[:, :, keys])
        probabilities = (scores - base[:, :, rows, None]).exp()
        grad_scores = probabilities * (grad_out[:, :, rows] @ v[:, :, keys].transpose(-1, -2) - delta[:, :, rows])
        if slope is not None:
            grad_scores = grad_scores * slope
        grad_q[:, :, rows] += grad_scores @ k[:, :, keys] * heads.scaling
        grad_k[:, :, keys] += grad_scores.transpose(-1, -2) @ q[:, :, rows] * heads.scaling
        grad_v[:, :, keys] += probabilities.transpose(-1, -2) @ grad_out[:, :, rows]
    return grad_q, grad_k, grad_v


def _at_least_float32(*tensors):
    return [t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors]


# One piece's scores (backward holds about five tensors of that size at once). At 16 MiB, glibc's heap (its mmap
# threshold risen past them) kept their freed blocks beside the tier's buffers: the step at 32K tokens of Mistral held
# 330 MiB against 140 at 8K; at 4 MiB, 159 against 138, and a little faster.
_PIECE_BYTES = 4 << 20


def _pieces(heads: Heads, block: _Block, q, k):
    """A block's queries in pieces whose scores fit _PIECE_BYTES, each against the keys it can see: (rows, keys, the
    piece as a block of its own); none for a piece that sees no key."""
    queries, keys = q.shape[2], k.shape[2]
    step = max(1, _PIECE_BYTES // max(1, q.shape[1] * keys * q.element_size()))
    for first in range(0, queries, step):
        last = min(queries, first + step) - 1
        end = min(keys, block.query_start + last - block.key_start + 1) if block.causal else keys
        start = 0 if heads.window is None else max(0, block.query_start + first - heads.window + 1 - block.key_start)
        if start < end:
            piece = _Block(slice(None), slice(None), block.causal, block.query_start + first, block.key_start + start)
            yield slice(first, last + 1), slice(start, end), piece


def _scores(heads: Heads, block: _Block, q, k):
    """A block's scores as the softmax takes them (scaled, soft-capped, -inf where the query does not see the key)
    and the cap's slope (d capped / d scaled; None without a cap)."""
    scores = q @ k.transpose(-1, -2) * heads.scaling
    slope = None
    if heads.softcap is not None:
        capped = (scores / heads.softcap).tanh()
        scores, slope = capped * heads.softcap, 1 - capped * capped
    query = torch.arange(q.shape[2], device=q.device)[:, None] + block.query_start
    key = torch.arange(k.shape[2], device=q.device)[None, :] + block.key_start
    hidden = key > query if block.causal else torch.zeros((), dtype=torch.bool, device=q.device)
    if heads.window is not None:
        hidden = hidden | (key <= query - heads.window)
    return scores.masked_fill(hidden, float("-inf")), slope
