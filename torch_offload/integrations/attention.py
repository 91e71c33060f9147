"""Attention modules through the attention_block op, where a probe proves they compute the same."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call

from .. import masking, sequence_parallel
from ..attention_block import attention_block as attention_block_op
from ..attention_block import attention_block_attend
from ..masking import is_segment_ids
from ..tiled_mlp import _is_plain_linear
from .checkpointing import _CACHE_ARGUMENTS, _checkpoint_forward, attention_once
from .layers import _attention_of
from .probes import _PROBE_ERRORS, _close, _finite, _probing

if TYPE_CHECKING:
    from .handle import OffloadHandle


# attention_block: an attention module is handed to the op only when it is made of exactly the
# four nn.Linear projections (and q/k norms per head or over the whole projection), is causal, and its own
# forward gives the op's result on random weights at apply time (which rules out soft-capped scores, norms of
# another kind, partial rotary embeddings...). At call time the op runs only where the module would compute plain causal
# attention with SDPA: no mask (no padding, no sliding window in reach), no cache, no dropout.

# The projections' layouts the op takes: separate q/k/v, or one fused qkv_proj whose rows
# are q, then k, then v (Phi-3). Weights are read at each call, so the op sees the current ones.
_SEPARATE = ("q_proj", "k_proj", "v_proj", "o_proj")
_FUSED = ("qkv_proj", "o_proj")
# Norms of q and k before the rotary embedding, beside separate projections: per head (Qwen3's) or over
# each token's whole projection (OLMo 2's). The op's q_norm and k_norm when each holds one weight, [head_dim]
# or the projection's width, and an epsilon the op can read (the probe proves they compute that RMSNorm).
_NORMS = ("q_norm", "k_norm")
_ATTENTION_ARGUMENTS = ("hidden_states", "position_embeddings", "attention_mask")  # and a cache (_CACHE_ARGUMENTS)
# Other arguments transformers passes an attention module that do not change what SDPA computes
# without a mask (packed sequences' position_ids make transformers build one). Any other argument
# sends the call to the module's own forward. DataCollatorWithFlattening(return_flash_attn_kwargs=True)
# adds the documents' cumulative lengths for flash attention (and seq_idx) beside their position_ids: SDPA reads the
# documents from the mask (position_ids) alone, and so does the op.
_NEUTRAL_ARGUMENTS = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "num_items_in_batch",
        "shift_labels",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",  # mixture-of-experts models pass it to every module
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
    }
)


# The attention implementations whose masks the op computes: SDPA's (where there is no mask) and
# masking.IMPLEMENTATION's (no mask, or segment ids).
_CAUSAL_IMPLEMENTATIONS = ("sdpa", masking.IMPLEMENTATION)


# Config options known to change attention's arithmetic in a way the op does not compute: OLMo's
# clip_qkv clamps q, k and v; Gemma 2's attn_logit_softcapping caps the scores. Read at apply time and
# at each call (a config changed after apply).
_CONFIG_CHANGES_ATTENTION = ("clip_qkv", "attn_logit_softcapping")


def _config_change(config: Any) -> str | None:
    name = next((n for n in _CONFIG_CHANGES_ATTENTION if getattr(config, n, None) is not None), None)
    return None if name is None else f"config.{name} is {getattr(config, name)!r}, which the op does not compute"


def _has_norms(attention: nn.Module) -> bool:
    children = dict(attention.named_children())
    return all(name in children for name in _NORMS) and all(name in children for name in _SEPARATE)


def _projection_layout(attention: nn.Module) -> tuple[str, ...] | None:
    children = dict(attention.named_children())
    projections = set(children) - set(_NORMS) if _has_norms(attention) else set(children)
    return next(
        (
            layout
            for layout in (_SEPARATE, _FUSED)
            if projections == set(layout) and all(type(children[n]) is nn.Linear for n in layout)
        ),
        None,
    )


def _norm_eps(norm: nn.Module) -> float | None:
    """A per-head RMSNorm's epsilon: ``variance_epsilon`` (transformers' ``Qwen3RMSNorm``) or ``eps``."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (float, int)) and not isinstance(eps, bool) else None


def _norms_problem(attention: nn.Module, head_dim: int) -> str | None:
    """Why ``attention``'s q_norm and k_norm (when it has them) are not the op's norms."""
    if not _has_norms(attention):
        return None
    for name, projection in zip(_NORMS, ("q_proj", "k_proj")):
        norm = getattr(attention, name)
        parameters = dict(norm.named_parameters())
        weight = parameters.get("weight")
        if (
            list(parameters) != ["weight"]
            or weight.shape not in ((head_dim,), (getattr(attention, projection).out_features,))
            or any(True for _ in norm.children())
            or _norm_eps(norm) is None
        ):
            return (
                f"its {name} is not a norm of one weight ([head_dim] or {projection}'s width) with an epsilon the op"
                " reads"
            )
    if _norm_eps(attention.q_norm) != _norm_eps(attention.k_norm):
        return "its q_norm and k_norm have different epsilons"
    return None


def _op_weights(attention: nn.Module, layout: tuple[str, ...], weights: dict[str, torch.Tensor | None]) -> dict:
    """The op's w_q, w_k, w_v, w_o and biases from the projections' ``weights`` (``"q_proj.weight"``...)."""
    if layout == _SEPARATE:
        norms = (
            {name: weights[f"{name}.weight"] for name in _NORMS} | {"norm_eps": _norm_eps(attention.q_norm)}
            if _has_norms(attention)
            else {}
        )
        return {
            **{f"w_{n[0]}": weights[f"{n}.weight"] for n in _SEPARATE},
            **{f"b_{n[0]}": weights.get(f"{n}.bias") for n in _SEPARATE},
            **norms,
        }
    qkv, bias = weights["qkv_proj.weight"], weights.get("qkv_proj.bias")
    q_rows = attention.config.num_attention_heads * attention.head_dim
    sizes = [q_rows, (qkv.shape[0] - q_rows) // 2, (qkv.shape[0] - q_rows) // 2]
    split = dict(zip("qkv", qkv.split(sizes)))  # views: the gradients reach qkv_proj.weight
    split_bias = dict(zip("qkv", bias.split(sizes) if bias is not None else (None,) * 3))
    return {
        **{f"w_{n}": split[n] for n in "qkv"},
        **{f"b_{n}": split_bias[n] for n in "qkv"},
        "w_o": weights["o_proj.weight"],
        "b_o": weights.get("o_proj.bias"),
    }


def _layout_problem(attention: nn.Module) -> str:
    """Why ``attention``'s children are not exactly the nn.Linear q_proj, k_proj, v_proj (or qkv_proj) and o_proj."""
    children = dict(attention.named_children())
    layout = _FUSED if "qkv_proj" in children else _SEPARATE
    missing = [name for name in layout if name not in children]
    if missing:
        return f"it has no {', '.join(missing)} ({', '.join(children) or 'no modules'} instead)"
    kinds = {name: type(children[name]) for name in layout}
    wrapped = [
        f"{name} is a {kind.__module__}.{kind.__qualname__}" for name, kind in kinds.items() if kind is not nn.Linear
    ]
    if wrapped:
        return f"{', '.join(wrapped)}, not an nn.Linear"
    others = [name for name in children if name not in layout and not (_has_norms(attention) and name in _NORMS)]
    return f"it has {', '.join(others)} besides its nn.Linear projections"


def _attention_block_problem(attention: nn.Module) -> str | None:
    """None when ``attention`` computes what the attention_block op computes; else why not."""
    layout = _projection_layout(attention)
    if layout is None:
        return _layout_problem(attention)
    # The module's own hooks run around the op's forward as around its own (transformers' output-capturing hooks,
    # installed by the first call that records attentions, hidden states or router logits); a projection's would not.
    if "forward" in vars(attention):
        return "it has a forward of its own (the op would bypass it)"
    if any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in list(attention.modules())[1:]):
        return "a projection has hooks or a forward of its own (the op would bypass them)"
    parameters = inspect.signature(attention.forward).parameters
    if any(name not in parameters for name in _ATTENTION_ARGUMENTS) or not any(
        name in parameters for name in _CACHE_ARGUMENTS
    ):
        return f"its forward does not take {', '.join(_ATTENTION_ARGUMENTS)} and a key/value cache"
    head_dim, scaling = getattr(attention, "head_dim", None), getattr(attention, "scaling", None)
    if not isinstance(head_dim, int) or not isinstance(scaling, float) or not getattr(attention, "is_causal", False):
        return "it has no int head_dim, float scaling and is_causal=True"
    if _norms_problem(attention, head_dim) is not None:
        return _norms_problem(attention, head_dim)
    config = getattr(attention, "config", None)
    if _config_change(config) is not None:
        return _config_change(config)
    if layout == _FUSED and not isinstance(getattr(config, "num_attention_heads", None), int):
        return "its qkv_proj cannot be split: no config.num_attention_heads"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":  # the op is causal SDPA: eager attention without a mask is not even causal
        return f"its attention implementation is {implementation!r}, not 'sdpa'"
    try:
        with _probing(attention, training=True) as (params, inputs):
            for scale, x in inputs.items():
                angles = torch.randn(1, x.shape[1], head_dim // 2).to(x.device, x.dtype).repeat(1, 1, 2)
                rotary = (angles.cos(), angles.sin())
                want = functional_call(
                    attention, params, (), {"hidden_states": x, "position_embeddings": rotary, "attention_mask": None}
                )
                want = want[0] if isinstance(want, tuple) else want
                if not _finite(want):
                    continue
                got = attention_block_op(
                    x, cos=rotary[0], sin=rotary[1], **_op_weights(attention, layout, params), scale=scaling
                )
                if not _close(got, want):
                    return (
                        "its forward computes something else than the op (a probe on random weights at input "
                        f"scale {scale:g} differs)"
                    )
    except _PROBE_ERRORS as error:
        return f"the op cannot compute it ({type(error).__name__}: {error})"
    return None


def _attention_block_forward(attention: nn.Module, fallback, group: str | None = None, ranks: int = 1):
    """``attention``'s forward through the op where the call allows, else ``fallback``; with ``group``
    (sequence parallelism, its ``ranks`` each holding a chunk of the rows), the op over that group."""
    layout = _projection_layout(attention)
    norms = _NORMS if _has_norms(attention) else ()
    signature = inspect.signature(attention.forward)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    config = getattr(attention, "config", None)
    windows = [w for w in (getattr(attention, "sliding_window", None), masking.config_window(config)) if w is not None]

    @functools.wraps(attention.forward)
    def forward(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        x, rotary = call["hidden_states"], call.get("position_embeddings")
        others = {
            name: value for name, value in call.items() if name not in _ATTENTION_ARGUMENTS and name != var_keyword
        }
        others.update(call.get(var_keyword) or {})
        caches = [others.pop(name, None) for name in _CACHE_ARGUMENTS]
        cache = next((c for c in caches if c is not None), None)
        causal = others.pop("is_causal", None)  # transformers' SDPA: the call's, else the module's
        causal = getattr(attention, "is_causal", True) if causal is None else causal
        # Read at each call: a projection replaced or hooked since apply (a LoRA wrapper, FSDP2 on a
        # Linear) would be bypassed by the op.
        projections = [getattr(attention, name, None) for name in layout]
        if (
            cache is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        ):  # dynamo cannot trace warnings.warn
            warnings.warn(
                "torch_offload: attention_block is not used while the model fills a key/value cache "
                "(use_cache=True, transformers' default even in training): the attention modules run "
                "their own forward; pass use_cache=False or set model.config.use_cache = False",
                UserWarning,
                stacklevel=2,
            )
        mask = call.get("attention_mask")
        implementation = getattr(config, "_attn_implementation", None)
        if group is None:
            # SDPA's or ours: no mask then means causal, segment ids mean causal per segment
            segments = (
                mask
                if implementation == masking.IMPLEMENTATION and is_segment_ids(mask) and mask.shape == x.shape[:2]
                else None
            )
            ours = implementation in _CAUSAL_IMPLEMENTATIONS and (mask is None or segments is not None)
        else:  # sequence_parallel.mask's: this rank's real-token flags, or None (all real)
            ours = implementation == sequence_parallel.IMPLEMENTATION and (
                mask is None or (mask.dtype == torch.bool and mask.shape == x.shape[:2])
            )
        plain_causal = (
            torch.is_grad_enabled()  # inference keeps the module's own path
            and all(_is_plain_linear(p) for p in projections)
            and ours
            and causal is True
            and cache is None
            and all(value is None or name in _NEUTRAL_ARGUMENTS for name, value in others.items())
            and not (attention.training and getattr(attention, "attention_dropout", 0.0))
            and x.dim() == 3
            and (group is not None or all(x.shape[1] <= w for w in windows))  # the group's: from its segments
            and rotary is not None
            and not any(t.requires_grad for t in rotary)
            and rotary[0].shape[-1] == attention.head_dim  # a partial rotary embedding is not the op's
            # The op rotates in x's dtype; tables of a wider dtype (OLMo's float32 ones for a bfloat16
            # model) make the module rotate in theirs. Narrower ones are promoted exactly, as the module does.
            and all(torch.promote_types(t.dtype, x.dtype) == x.dtype for t in rotary)
            and _config_change(config) is None
        )
        if not plain_causal:
            return fallback(*args, **kwargs)
        if group is not None:
            segments = sequence_parallel.whole_rows_segment_ids(mask, others.get("position_ids"), x.shape[0], group)
            if any(sequence_parallel.window_problem(w, segments, ranks) for w in windows):
                return fallback(*args, **kwargs)  # whose attention function computes the window over the ranks
        weights = {
            f"{name}.{kind}": getattr(p, kind) for name, p in zip(layout, projections) for kind in ("weight", "bias")
        }
        for name in norms:  # a loop: dynamo cannot lift a comprehension's free variables inside checkpoint's subgraph
            weights[f"{name}.weight"] = getattr(attention, name).weight
        arguments = dict(
            cos=rotary[0].to(x.dtype),
            sin=rotary[1].to(x.dtype),
            **_op_weights(attention, layout, weights),
            scale=attention.scaling,
            segment_ids=segments,
            group_name=group,
        )
        # In a checkpointed layer whose tensors go to the offload tier: the attention's output and log-sum-exps
        # from its forward, kept through the tier, so that neither the recompute nor the op's backward runs the
        # attention forward again.
        kept = attention_once(
            lambda: attention_block_attend(x, **{k: v for k, v in arguments.items() if k not in ("w_o", "b_o")})
        )
        saved = {} if kept is None else dict(zip(("attention", "logsumexp"), kept))
        return attention_block_op(x, **arguments, **saved), None

    return forward


def _fuse_attention(handle: OffloadHandle, name: str, layer: nn.Module, checkpointed: bool) -> None:
    """The layer's attention through the attention_block op where it is proven to compute the same."""
    attention = _attention_of(layer)
    if attention is None:
        return
    module = getattr(layer, attention)
    problem = _attention_block_problem(module)
    handle.attention[f"{name}.{attention}"] = "attention_block" if problem is None else f"module: {problem}"
    if problem is not None:
        return
    # The op saves only its input and recomputes itself in backward: checkpointing it again
    # would compute its forward twice. Calls the op cannot take get the module's own path.
    fallback = _checkpoint_forward(handle, module, offload=True) if checkpointed else module.forward
    handle._patch(
        f"{name}.{attention}.forward",
        module,
        "forward",
        _attention_block_forward(module, fallback, handle.sequence_parallel, handle._sequence_parallel_ranks),
    )
