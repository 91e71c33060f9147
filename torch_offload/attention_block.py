"""A decoder layer's attention, from its normalized input to its output projection, computed
one group of heads at a time: ``attention_block`` (the ``torch.ops.offload.attention_block`` op)."""
from __future__ import annotations

import torch

from . import _require_tensor

__all__ = ["attention_block"]


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

    It runs one group of heads at a time (as many as fit in 16 MiB of per-group tensors),
    so one group's q, k, v and attention output exist at once; backward saves only the
    inputs and recomputes each group. ``cos`` and ``sin`` get no gradient (an error if
    they require one).
    """
    for value, arg in ((x, "x"), (w_q, "w_q"), (w_k, "w_k"), (w_v, "w_v"), (w_o, "w_o"), (cos, "cos"), (sin, "sin")):
        _require_tensor(value, "attention_block", arg)
    return torch.ops.offload.attention_block(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale)
