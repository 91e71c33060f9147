"""torch_offload: PyTorch ops (namespace ``torch.ops.offload``) for training with less memory.

Importing the package loads the shared library once and registers the fake
(FakeTensor) implementations that torch.compile needs.
"""

from __future__ import annotations

import torch

__all__ = [
    "CrossEntropyStatistics",
    "OffloadHandle",
    "apply",
    "attention_block",
    "attention_block_attend",
    "attention_block_segment_ids",
    "candidate_divergence",
    "checkpoint",
    "chunk_recurrent_loss",
    "cmake_prefix_path",
    "configure_disk_spill",
    "disk_prefetch",
    "disk_read",
    "disk_restore",
    "disk_spill",
    "disk_spill_stats",
    "disk_wait",
    "distillation_loss",
    "library_path",
    "linear_cross_entropy",
    "linear_cross_entropy_tile",
    "offload_activations",
    "offload_pack",
    "offload_unpack",
    "segment_attention",
    "set_pinned_budget",
    "shard_batch",
    "pinned_arena_stats",
    "rms_norm",
    "rms_norm_tiled_mlp",
    "TiledMLP",
    "token_divergence",
    "token_logprob_summaries",
    "token_logprobs",
    "TorchOffloadCallback",
    "tiled_apply",
    "tiled_mlp",
    "tiled_mlp_num_shards",
    "ulysses_attention",
]


from ._library import cmake_prefix_path, library_path  # noqa: E402
from ._library import load as _load_library  # noqa: E402

_load_library()

from . import _fake  # noqa: E402,F401  (registers fake impls; needs the ops loaded)
from .activations import checkpoint, offload_activations  # noqa: E402
from .disk import (  # noqa: E402
    configure_disk_spill,
    disk_prefetch,
    disk_read,
    disk_restore,
    disk_spill,
    disk_spill_stats,
    disk_wait,
)


def _require_tensor(value, op: str, arg: str) -> None:
    # torch.ops would only say "tensor does not have a device" for None.
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"{op}: {arg} is {type(value).__name__}; expected a defined tensor")


def offload_pack(src: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """Return a new contiguous CPU tensor with ``src``'s values (differentiable).

    On CUDA the copy runs on a dedicated device-to-host stream into pinned memory
    from a reusable arena, after the work already queued on the current stream.
    With ``non_blocking=True`` it returns before the copy ends: ``offload_unpack``
    waits for it by itself, but do not read the result on the host or modify
    ``src`` in place until then. Freeing ``src`` is always safe.
    """
    _require_tensor(src, "offload_pack", "src")
    return torch.ops.offload.offload_pack(src, non_blocking)


def offload_unpack(packed: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Return a new contiguous tensor on ``device`` with ``packed``'s values (differentiable).

    Host-to-GPU copies run on their own stream; the current stream waits on that
    copy's event only, so the result is ready to use on the current stream.
    """
    _require_tensor(packed, "offload_unpack", "packed")
    return torch.ops.offload.offload_unpack(packed, torch.device(device))


def set_pinned_budget(budget_bytes: int) -> None:
    """Cap the pinned host memory held by the pack arena (default: a quarter of RAM).

    Packs that do not fit go to pageable memory with a synchronous copy.
    """
    torch.ops.offload.set_pinned_budget(budget_bytes)


def pinned_arena_stats() -> dict[str, int]:
    """Byte and call counters of the pinned arena that ``offload_pack`` uses on CUDA."""
    keys = ("budget_bytes", "reserved_bytes", "in_use_bytes", "chunk_allocations", "slice_allocations")
    return dict(zip(keys, torch.ops.offload.pinned_arena_stats()))


from .attention_block import (  # noqa: E402
    attention_block,
    attention_block_attend,
    attention_block_segment_ids,
    segment_attention,
)
from .candidate_divergence import candidate_divergence  # noqa: E402
from .integrations import OffloadHandle, apply  # noqa: E402
from .integrations.chunk_recurrent import chunk_recurrent_loss  # noqa: E402
from .linear_cross_entropy import CrossEntropyStatistics, linear_cross_entropy, linear_cross_entropy_tile  # noqa: E402
from .rms_norm import rms_norm, rms_norm_tiled_mlp  # noqa: E402
from .sequence_parallel import shard_batch, ulysses_attention  # noqa: E402
from .tiled_mlp import TiledMLP, tiled_apply, tiled_mlp, tiled_mlp_num_shards  # noqa: E402  (uses _require_tensor above)
from .token_divergence import distillation_loss, token_divergence  # noqa: E402
from .token_logprobs import token_logprob_summaries, token_logprobs  # noqa: E402


def __getattr__(name: str):
    # Imported on first use: it needs transformers, which the ops do not.
    if name == "TorchOffloadCallback":
        from .trainer_callback import TorchOffloadCallback

        return TorchOffloadCallback
    raise AttributeError(f"module 'torch_offload' has no attribute {name!r}")
