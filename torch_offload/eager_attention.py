"""Eager attention families without a [T, T] tensor: an attention implementation for transformers.

Gemma 2 (soft-capped scores) and GPT-OSS (learned sinks) run eager attention, which writes out every
head's [T, T] scores and probabilities, and their masks are dense [batch, 1, T, T] additive ones. ``apply()``
switches such a model (``masks`` "eager" in torch_offload.families), once a probe shows that
its attention module's own eager function computes what this one does, to ``IMPLEMENTATION``:

- its mask function (masking.eager_mask) gives segment ids, or None for plain causal attention, where
  masking.mask would, and otherwise transformers' dense eager mask (left padding included: eager attention
  gives a query that sees no key the mean of the row's values);
- its attention function runs the ``segment_attention`` op with the call's ``softcap`` (Gemma 2) and ``s_aux``
  sinks (GPT-OSS) for segment ids or None, and the module's own eager function for a dense mask or attention
  dropout (with the dense mask the ids stand for).
"""

from __future__ import annotations

import sys

import torch

from . import masking
from .segment_sdpa import attend_segments, dense_mask

IMPLEMENTATION = "torch_offload_eager"


def _modules_eager_attention(module: torch.nn.Module):
    """The eager attention function of ``module``'s modelling file (what transformers calls for "eager")."""
    return sys.modules[type(module).__module__].eager_attention_forward


def _additive_mask(segment_ids: torch.Tensor, dtype: torch.dtype, window: int | None) -> torch.Tensor:
    """The [batch, 1, T, T] additive mask the ids (and a window) stand for, as transformers' eager masks are (0 or
    the dtype's minimum)."""
    allowed, _ = dense_mask(segment_ids, window)
    return torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
):
    """The attention function registered for IMPLEMENTATION (query, key, value [B, heads, T, D])."""
    segment_ids = attention_mask
    if segment_ids is None:  # plain causal: one segment per row
        segment_ids = torch.zeros(query.shape[0], query.shape[2], dtype=torch.long, device=query.device)
    if not masking.is_segment_ids(segment_ids):
        return _modules_eager_attention(module)(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")  # the layer's, as its mask has it (passes_window in torch_offload.families)
    if kwargs.get("dropout", 0.0):  # transformers passes the module's dropout in training only
        mask = _additive_mask(segment_ids, query.dtype, window)
        return _modules_eager_attention(module)(module, query, key, value, mask, **kwargs)
    mods = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"), window=window)
    return attend_segments(query, key, value, segment_ids, scale=kwargs.get("scaling"), **mods), None


def probe_problem(module: torch.nn.Module) -> str | None:
    """None when ``module``'s own eager attention gives this implementation's result on random inputs (causal,
    with its soft-cap and sinks); else why not."""
    from transformers.masking_utils import causal_mask_function, eager_mask

    config = module.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or heads % kv_heads:
        return "its attention has no int head_dim, or query heads not a multiple of the key/value heads"
    like = next(module.parameters())
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 3).to(like.device, like.dtype)

    q, k, v = rand(2, heads, 7, head_dim), rand(2, kv_heads, 7, head_dim), rand(2, kv_heads, 7, head_dim)
    options = dict(dropout=0.0, scaling=getattr(module, "scaling", None))
    if getattr(module, "attn_logit_softcapping", None) is not None:
        options["softcap"] = module.attn_logit_softcapping
    if getattr(module, "sinks", None) is not None:
        options["s_aux"] = module.sinks
    dense = eager_mask(2, 7, 7, mask_function=causal_mask_function, dtype=like.dtype, device=like.device)
    training = module.training
    try:
        module.eval()  # no dropout in the probe
        with torch.no_grad():
            want = _modules_eager_attention(module)(module, q, k, v, dense, **options)[0]
            got = attention(module, q, k, v, None, **options)[0]
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError) as error:
        return f"its eager attention could not be compared ({type(error).__name__}: {error})"
    finally:
        module.train(training)
    rtol = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(like.dtype, 1e-4)
    if not bool((got.float() - want.float()).norm() <= rtol * want.float().norm()):
        return "its eager attention computes something else than segment_attention (a probe differs)"
    return None


def register() -> None:
    """Registers IMPLEMENTATION with transformers (registering again changes nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    masking.register()  # the factories the mask function reads
    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, masking.eager_mask)
