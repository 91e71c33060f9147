"""The attention kernels that the chunk-recurrent step's blocks run (chunk_attention.py), by device.

A block is a run of queries against a run of keys, ``[1, heads, L, d]`` each, either all keys before the queries or,
``causal``, both beginning at one token (a query sees the keys up to itself: the mask's top left). On the CPU:
PyTorch's CPU flash-attention kernel, in float32 or float64. On CUDA, as attention_block's CUDA kernels choose
(ops/attention_block/attention_block_cuda.cpp): PyTorch's flash kernels for bfloat16 and float16 on sm80 and sm90,
else its memory-efficient ones (float32, other GPUs, no float64), and the memory-efficient ones for a causal block
longer in queries than in keys (a row's padding after its text: flash aligns a causal mask to the bottom right).
Each returns the block's output in the inputs' dtype and its log-sum-exp in float32 (the CPU's: the inputs' dtype);
backward takes the whole row's output and log-sum-exp, which makes a block's gradients its exact share.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["block_backward", "block_forward", "kernel_dtype"]

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# What the CUDA kernels' backward takes for the random state of a dropout the step never draws (read only with
# dropout: PyTorch's memory-efficient forward returns such an empty int64 scalar on the CPU without one).
_NO_DROPOUT = torch.empty((), dtype=torch.int64)
_EFFICIENT_QUERY_ALIGNMENT = 32  # the memory-efficient kernels' log-sum-exp pads its queries to a multiple of it


def kernel_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a block's queries, keys and values go to the kernel in: the CPU's at least float32 (its float64
    kernel serves the exact tests), CUDA's the model's own (bfloat16 and float16 on the tensor cores); outputs are
    joined in at least float32 either way."""
    return q.dtype if q.device.type == "cuda" else torch.promote_types(q.dtype, torch.float32)


def block_forward(q, k, v, causal: bool, scale: float):
    """A block's output ``[1, heads, L, dv]`` and log-sum-exp ``[1, heads, L]``."""
    if q.device.type != "cuda":
        return _CPU_FLASH(q, k, v, 0.0, causal, scale=scale)
    if _flash(q, k, causal):
        out, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[
            :2
        ]
        return out, log_sum_exp
    out, log_sum_exp = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )[:2]
    return out, log_sum_exp[..., : q.shape[2]]


def block_backward(grad_out, q, k, v, out, log_sum_exp, causal: bool, scale: float):
    """A block's share of the gradients of ``q``, ``k`` and ``v``, given the whole row's ``out`` and
    ``log_sum_exp``."""
    if q.device.type != "cuda":
        return _CPU_FLASH_BACKWARD(grad_out, q, k, v, out, log_sum_exp, 0.0, causal, scale=scale)
    log_sum_exp = log_sum_exp.float().contiguous()
    if _flash(q, k, causal):
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, log_sum_exp, None, None, q.shape[2], k.shape[2], 0.0, causal, _NO_DROPOUT,
            _NO_DROPOUT, scale=scale,
        )  # fmt: skip
    # Token-major memory: CUDA's memory-efficient backward reads out (and its gradient) with a token stride of
    # heads * d, whatever their strides say.
    grad_out, out = _token_major(grad_out), _token_major(out)
    queries = q.shape[2]
    padded = -(-queries // _EFFICIENT_QUERY_ALIGNMENT) * _EFFICIENT_QUERY_ALIGNMENT
    log_sum_exp = F.pad(log_sum_exp, (0, padded - queries))
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, log_sum_exp, _NO_DROPOUT, _NO_DROPOUT, 0.0, [True, True, True, False], causal,
        scale=scale,
    )[:3]  # fmt: skip


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[1, heads, L, d]`` over ``[1, L, heads, d]`` memory (a copy where it is not)."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def _flash(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and _flash_device(q.device.index if q.device.index is not None else torch.cuda.current_device())
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and not (causal and q.shape[2] != k.shape[2])
    )


@functools.cache
def _flash_device(index: int) -> bool:
    """Whether ATen builds its flash kernels, backward included, for every head dimension up to 256 on the GPU."""
    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor) == (8, 0) or major == 9
