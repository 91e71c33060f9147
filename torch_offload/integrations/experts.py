"""A mixture of experts in shards of tokens: its experts module, and the dense MLPs beside it (a shared expert).

The block itself stays whole: the model records its router's logits for the auxiliary loss, and those must be
the whole batch's, with their gradient. What grows with the tokens times top-k is the experts' work, and the
experts module (transformers' ``Qwen2MoeExperts``, ``MixtralExperts``, ``GptOssExperts``...) maps each token's
row of hidden states, given that token's routing (expert indices and weights, rows of their own), to that
token's output: apply computes it in shards of rows through tiled_apply's autograd function, with the routing
weights' gradient, where a probe shows that the shards give the whole call's result.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call

from ..tiled_mlp import _TiledApply
from .probes import _PROBE_ERRORS, _close, _finite, _probing

if TYPE_CHECKING:
    from .handle import OffloadHandle

# One shard's working set: the experts' graph a shard's backward rebuilds at once (with the disk or host tier, the
# untiled experts' saved tensors would stream back one at a time instead, so a shard must stay small against
# that); on a GPU larger, for the experts' GEMMs.
_SHARD_BYTES = {"cpu": 16 << 20, "accelerator": 256 << 20}
_MIN_SHARD_ROWS = 128


def _rows_of_the_call(signature: inspect.Signature, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """The call's arguments in their order when the first is ``[tokens, h]`` and the others are tensors of as
    many rows (the routing), given as the forward's first parameters, else None. They are passed on by position:
    transformers' experts implementations (``grouped_mm``...) take the routing under other names than the
    module's own forward gives it."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    names, values = list(bound.arguments), list(bound.arguments.values())
    if bound.kwargs or names != list(signature.parameters)[: len(names)]:  # a default skipped before one given
        return None
    if not values or not isinstance(values[0], torch.Tensor) or values[0].dim() != 2:
        return None
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == values[0].shape[0] for v in values[1:]):
        return None
    return values


def _shard_count(rows: list[torch.Tensor], experts: nn.Module) -> int:
    """Shards of at most _SHARD_BYTES of the experts' work: each row goes to top-k experts (the routing's
    width), each with its own [intermediate] buffers (the 3-D weights' per-expert rows over h), and
    at least _MIN_SHARD_ROWS rows per shard."""
    x = rows[0]
    top_k = rows[1].shape[-1] if len(rows) > 1 and rows[1].dim() == 2 else 1
    width = sum(p[0].numel() // x.shape[1] for p in experts.parameters() if p.dim() == 3) or x.shape[1]
    row_bytes = top_k * (width + 2 * x.shape[1]) * x.element_size()
    budget = _SHARD_BYTES["cpu" if x.device.type == "cpu" else "accelerator"]
    shard_rows = max(_MIN_SHARD_ROWS, budget // max(1, row_bytes))
    return max(1, -(-x.shape[0] // shard_rows))


def _captured_call(mlp: nn.Module, experts: nn.Module, params: dict, x: torch.Tensor) -> tuple[tuple, dict] | None:
    calls = []
    hook = experts.register_forward_pre_hook(lambda _, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:
        functional_call(mlp, params, (x,))
    finally:
        hook.remove()
    return calls[0] if len(calls) == 1 else None


def _experts_problem(mlp: nn.Module) -> str | None:
    """None when ``mlp.experts`` maps rows and their routing to rows, so that shards of rows give the whole
    call's result (probed in ``mlp``'s own forward on random weights); else why not."""
    experts = getattr(mlp, "experts", None)
    if not isinstance(experts, nn.Module) or isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return "it has no experts module taking the tokens and their routing"
    prefix, signature = "experts.", inspect.signature(experts.forward)
    try:
        with _probing(mlp, training=False) as (params, inputs):
            own = {name.removeprefix(prefix): p for name, p in params.items() if name.startswith(prefix)}
            for x in inputs.values():
                call = _captured_call(mlp, experts, params, x)
                rows = None if call is None else _rows_of_the_call(signature, *call)
                if rows is None:
                    return "its experts are not called once with [tokens, h] rows and their routing"
                whole = functional_call(experts, own, tuple(rows))
                if not _finite(whole):
                    continue
                if not _close(functional_call(experts, own, *call), whole):  # the rows passed on as given
                    return "its experts' call cannot be passed on by position"
                half = rows[0].shape[0] // 2
                parts = [
                    functional_call(experts, own, tuple(v[part] for v in rows))
                    for part in (slice(None, half), slice(half, None))
                ]
                if not _close(torch.cat(parts), whole):
                    return "its experts' output for a token depends on the other tokens"
    except _PROBE_ERRORS as error:
        return f"apply cannot probe its experts ({type(error).__name__}: {error})"
    return None


def _tile_experts(handle: OffloadHandle, name: str, mlp: nn.Module, num_shards: int) -> None:
    """``mlp.experts`` in shards of tokens, once _experts_problem has found none."""
    experts = mlp.experts
    original = experts.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        # Without gradients nothing is saved; under torch.compile the shards' autograd function cannot be traced.
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        rows = _rows_of_the_call(signature, args, kwargs)
        if rows is None:
            return original(*args, **kwargs)
        params = [p for p in experts.parameters() if p.requires_grad]
        return _TiledApply.apply(original, num_shards or _shard_count(rows, experts), len(rows), *rows, *params)

    handle._patch(f"{name}.experts.forward", experts, "forward", forward)
