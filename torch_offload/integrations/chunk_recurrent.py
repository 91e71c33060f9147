"""One training step of a Llama-built causal LM, chunk-recurrent: ``chunk_recurrent_loss(model, input_ids, labels)``,
and apply()'s step for training calls with labels (chunk_recurrent_route.py).

Why: apply()'s layers run module at a time, so autograd's backward of a layer holds ``[T, h]`` tensors (its
output's gradient, its input's, the residual's) whatever the tiers keep: about three hidden vectors per token at the
peak (BENCHMARKS.md, "Peaks by phase"). Here one autograd Function owns the whole step, and everything that grows
with the sequence (each layer's input, queries, keys, values, attention output and log-sum-exp, and the gradients
flowing back) lives in an unnamed file in chunks of ``chunk_tokens`` tokens (chunk_file.py). The process holds one
chunk's working set, one chunk of keys and values at a time, the weights' gradients and the batch's token ids,
positions and labels: its memory grows by a few bytes per token (the batch's own tensors), whatever the context.

How, per layer: forward attends one chunk of queries to the keys and values of every chunk up to it, read back one
chunk at a time (chunk_attention.py: pairs of chunks, within the batch's documents and rows). Backward runs the
token-local parts (the residual adds, norms, projections, rotary embedding and MLP) through autograd one chunk at a
time, and attention's backward pair by pair. The loss's gradient is computed with its forward
(``linear_cross_entropy``'s gradients in forward), chunk by chunk.

What it takes (``_parts``): the decoder's children ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``; each
layer's ``input_layernorm``, ``self_attn`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, and Qwen3's ``q_norm``
and ``k_norm``), ``post_attention_layernorm``, ``mlp``; a bias-free ``lm_head``; full causal attention (no sliding
window), no dropout in training, a rotary embedding that does not depend on the call's longest position. Rows of
tokens on the CPU: one row, several, packed documents (``position_ids`` restarting), padded rows
(``attention_mask``), read as transformers reads them without a key/value cache (chunk_batch.py).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from ..disk import default_spill_directory, spill_directory_in_ram
from ..linear_cross_entropy import linear_cross_entropy
from .chunk_attention import Segments, attend, attention_backward
from .chunk_batch import Batch, batch_of, checked_rows, runs_of_real_tokens
from .chunk_file import ChunkFile, return_freed_memory
from .layer_loop import _DECODER_CHILDREN, _LAYER_CHILDREN
from .sequence_parallelism import rope_of_the_calls_positions

__all__ = ["chunk_recurrent_loss"]

CHUNK_TOKENS = 2048  # tokens per chunk: attention's pairs of chunks work in [heads, C, C] blocks
_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})  # decoder layers read to be Llama's, as below
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QUERY_KEY_NORMS = {"q_norm", "k_norm"}  # Qwen3's: each head's query and key normalized before the rotary embedding
_PROBE_TOKENS = 12


class _Parts:
    """The modules of a Llama-built causal LM, and its layers' token-local halves as functions of one chunk."""

    def __init__(self, model: nn.Module):
        decoder = model.model
        self.embed, self.layers, self.norm, self.rotary = (
            decoder.embed_tokens,
            list(decoder.layers),
            decoder.norm,
            decoder.rotary_emb,
        )
        self.head = model.lm_head
        self.attentions = [_Attention(layer.self_attn) for layer in self.layers]

    def before_attention(self, index, hidden, positions):
        """Queries ``[heads, C, d]``, keys and values ``[kv heads, C, d]`` of one chunk, as Llama's attention (and
        Qwen3's, which normalizes each head's queries and keys first)."""
        layer, attention = self.layers[index], self.layers[index].self_attn
        x = layer.input_layernorm(hidden[None])
        shape = (1, hidden.shape[0], -1, self.attentions[index].head_dim)
        norms = (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None), None)
        q, k, v = (
            (projection(x).view(shape) if norm is None else norm(projection(x).view(shape))).transpose(1, 2)
            for projection, norm in zip(_attention_projections(attention), norms)
        )
        cos, sin = self.rotary(x, position_ids=positions[None])
        q, k = self.attentions[index].rope(q, k, cos, sin)
        return q[0], k[0], v[0]

    def after_attention(self, index, hidden, attended):
        """The layer's output for one chunk, from its input and attention's output ``[heads, C, d]``."""
        layer = self.layers[index]
        hidden = hidden + layer.self_attn.o_proj(attended.transpose(0, 1).reshape(hidden.shape[0], -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def differentiated(self) -> list[nn.Parameter]:
        """Every parameter whose gradient the step computes: those of the modules whose forwards it calls (each
        layer's norms, projections, query/key norms and MLP, the embedding, the final norm) and the head's weight."""
        modules = [self.embed, self.norm]
        for layer in self.layers:
            modules += [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp, layer.self_attn.o_proj]
            modules += [*_attention_projections(layer.self_attn), *_query_key_norms(layer.self_attn)]
        return [*(p for module in modules for p in module.parameters()), self.head.weight]


class _Attention:
    """What the step reads off one layer's attention module (each its own: a layer's scaling may differ): its
    scaling, head width, query heads per key head and its module's rotary function."""

    def __init__(self, attention: nn.Module):
        self.scaling, self.head_dim = attention.scaling, attention.head_dim
        self.groups = attention.num_key_value_groups
        self.rope = sys.modules[type(attention).__module__].apply_rotary_pos_emb

    def by_head(self, keys):
        """Keys or values ``[kv heads, C, d]`` for every query head (transformers' repeat_kv), a batch of one."""
        kv_heads, length, dim = keys.shape
        return keys[:, None].expand(kv_heads, self.groups, length, dim).reshape(1, -1, length, dim)


def _attention_projections(attention):
    return attention.q_proj, attention.k_proj, attention.v_proj


def parts_problem(model: nn.Module) -> str | None:
    """What in ``model`` the step would not compute as its own forward does, or None."""
    config = getattr(model, "config", None)
    decoder = getattr(model, "model", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(_MODEL_TYPES)}"
    if not isinstance(decoder, nn.Module) or set(dict(decoder.named_children())) != _DECODER_CHILDREN:
        return f"its decoder's children are not {sorted(_DECODER_CHILDREN)}"
    attention_children = _ATTENTION_CHILDREN | (_QUERY_KEY_NORMS if model_type == "qwen3" else set())
    for layer in decoder.layers:
        if set(dict(layer.named_children())) != _LAYER_CHILDREN:
            return f"a layer's children are not {sorted(_LAYER_CHILDREN)}"
        if set(dict(layer.self_attn.named_children())) != attention_children:
            return f"an attention's children are not {sorted(attention_children)}"
        if layer.self_attn.training and getattr(layer.self_attn, "attention_dropout", 0.0):
            return "attention dropout in training mode"
        if getattr(layer.self_attn, "is_causal", True) is not True:
            return "an attention module that is not causal"
    dropout = next((name for name, m in model.named_modules() if _drops_out(m)), None)
    if dropout is not None:
        return f"{dropout} drops out in training mode (backward's recomputation would draw other masks)"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "a sliding window"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "layers of other kinds than full attention"
    if rope_of_the_calls_positions(config) is not None:
        return f"its rotary embedding ({rope_of_the_calls_positions(config)!r}) depends on a call's longest position"
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return "lm_head is not a bias-free nn.Linear"
    if getattr(config, "num_hidden_layers", None) != len(decoder.layers):
        return "config.num_hidden_layers is not the number of layers"
    for layer in decoder.layers:
        attention = layer.self_attn
        read = ("scaling", "head_dim", "num_key_value_groups")
        if not all(hasattr(attention, name) for name in read):
            return f"an attention module lacks one of {', '.join(read)}"
        if not callable(getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)):
            return f"{type(attention).__name__}'s module has no apply_rotary_pos_emb"
    embeddings = [m for m in decoder.embed_tokens.modules() if isinstance(m, nn.Embedding)]
    if any(embedding.scale_grad_by_freq for embedding in embeddings):
        return "its embedding scales gradients by token frequency (scale_grad_by_freq): a chunk's counts differ"
    if any(embedding.sparse for embedding in embeddings):
        return "its embedding's gradient is sparse (sparse=True): the step's would be dense"
    differentiated = {id(p) for p in _Parts(model).differentiated()}
    missed = next((n for n, p in model.named_parameters() if p.requires_grad and id(p) not in differentiated), None)
    if missed is not None:
        return f"{missed} is trained and the step would not differentiate it (no module of the step's owns it)"
    low_precision = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32", "torch.float64"})
    if low_precision:  # one matmul over every token, as the model's backward, rounds once
        return f"parameters in {', '.join(low_precision)}: the step would round each chunk's share of their gradients"
    return None


def autocast_on() -> bool:
    """Whether torch.autocast is on, under which the step's forward would round where its backward's recomputation,
    outside the context, does not."""
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def _drops_out(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0


def chunk_recurrent_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    chunk_tokens: int = CHUNK_TOKENS,
    directory: str | os.PathLike | None = None,
) -> torch.Tensor:
    """``model(input_ids=..., labels=..., attention_mask=..., position_ids=..., use_cache=False).loss``,
    differentiable in the model's parameters, in memory that does not grow with the sequence but for the batch's own
    tensors (see the module's docstring).

    ``input_ids`` and ``labels`` are ``[rows, T]`` (or ``[T]``) int64 on the CPU; labels equal to ``ignore_index``
    are not counted, and ``num_items_in_batch`` divides the summed loss where given (transformers' gradient
    accumulation). ``attention_mask`` (1 for real tokens, contiguous in each row) and ``position_ids`` (packed
    documents restart at 0) are transformers'. ``chunk_tokens`` sets the chunk (the working set grows with its square:
    attention's ``[heads, C, C]`` blocks); ``directory`` where the chunk file lives (the disk tier's default; RAM file
    systems are refused)."""
    if parts_problem(model) is not None:
        raise ValueError(f"chunk_recurrent_loss: model: {parts_problem(model)}")
    input_ids, labels, attention_mask, position_ids = (
        checked_rows(name, value, optional, input_ids)
        for name, value, optional in (
            ("input_ids", input_ids, False),
            ("labels", labels, False),
            ("attention_mask", attention_mask, True),
            ("position_ids", position_ids, True),
        )
    )
    if attention_mask is not None and bool((runs_of_real_tokens(attention_mask) > 1).any()):
        raise ValueError("chunk_recurrent_loss: attention_mask: a row's real tokens are not contiguous")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_recurrent_loss: chunk_tokens must be a positive int, got {chunk_tokens!r}")
    directory = os.fspath(directory) if directory is not None else default_spill_directory()
    if not os.path.isdir(directory):
        raise ValueError(f"chunk_recurrent_loss: directory {directory!r} is not a directory")
    if spill_directory_in_ram(directory):
        raise ValueError(f"chunk_recurrent_loss: directory {directory!r} is on a RAM file system")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("chunk_recurrent_loss: model: its parameters must be on the CPU")
    if autocast_on():
        raise RuntimeError("chunk_recurrent_loss: autocast is on: call the step outside torch.autocast")
    _probe(model, input_ids[0], directory)
    batch = batch_of(
        input_ids,
        labels,
        attention_mask=attention_mask,
        position_ids=position_ids,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
    )
    return chunk_recurrent_step(model, batch, chunk_tokens, directory)


def _probe(model: nn.Module, ids: torch.Tensor, directory: str) -> None:
    """Refuse a model whose own loss on the sequence's first tokens is not the step's: a forward of its own."""
    probe = ids[None, :_PROBE_TOKENS]
    with torch.no_grad():
        want = model(input_ids=probe, labels=probe, use_cache=False).loss
        got = chunk_recurrent_step(model, batch_of(probe, probe), max(1, probe.shape[1] // 2), directory)
    if not torch.allclose(got.to(want.dtype), want, rtol=1e-4, atol=1e-5):  # transformers: a float32 loss
        raise ValueError(
            f"chunk_recurrent_loss: model: its own loss on {probe.shape[1]} tokens is {want.item()}, the "
            f"chunk-recurrent step's {got.item()}: its forward is not Llama's"
        )


def chunk_recurrent_step(model: nn.Module, batch: Batch, chunk_tokens: int, directory: str) -> torch.Tensor:
    """The step's loss, differentiable in ``model``'s trained parameters (checked by the caller)."""
    named = dict(model.named_parameters())  # a tied head's weight once
    trained = [p for p in named.values() if p.requires_grad]
    parts = _Parts(model)
    read_again = _ReadAgain(model, batch.ids if _trained(parts.embed.parameters()) else None)
    return _ChunkRecurrentStep.apply(parts, batch, chunk_tokens, directory, (trained, read_again), *trained)


class _ReadAgain:
    """The version counters of what backward reads again: every parameter and buffer (the recomputation's), and the
    token ids where the embedding is trained. Plain PyTorch's backward raises where one changed in place since its
    forward saved it; so does the step's, which would otherwise compute with the new values."""

    def __init__(self, model: nn.Module, ids: torch.Tensor | None):
        tensors = [*model.named_parameters(), *model.named_buffers()]
        tensors += [("input_ids", ids)] if ids is not None else []
        self._versions = [(name, tensor, tensor._version) for name, tensor in tensors]

    def check(self) -> None:
        changed = next((name for name, tensor, version in self._versions if tensor._version != version), None)
        if changed is not None:
            raise RuntimeError(
                f"chunk_recurrent_loss: {changed}, which backward reads again, was modified by an inplace operation "
                "since the step's forward (plain PyTorch's backward raises too)"
            )


class _ChunkRecurrentStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, parts, batch, chunk_tokens, directory, trained_and_read_again, *parameters):
        trained, read_again = trained_and_read_again
        tokens = len(batch.ids)
        bounds = [(start, min(start + chunk_tokens, tokens)) for start in range(0, tokens, chunk_tokens)]
        segments = Segments(bounds, batch.query_segments, batch.key_segments)
        store = ChunkFile(directory)
        wants_gradients = any(ctx.needs_input_grad[5:])
        try:
            for chunk, (start, end) in enumerate(bounds):
                store.write(("hidden", 0, chunk), parts.embed(batch.ids[start:end]))
            for index in range(len(parts.layers)):
                for chunk, (start, end) in enumerate(bounds):
                    _layer_forward(parts, store, segments, index, chunk, batch.positions[start:end])
                    return_freed_memory()
            loss, loss_weights = _loss_and_gradients(parts, store, bounds, batch, wants_gradients)
        except BaseException:
            store.close()
            raise
        if not wants_gradients:
            store.close()
            return loss
        ctx.step = (parts, store, segments, batch, trained, loss_weights, read_again)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():  # create_graph=True: its gradients carry no graph, so say so, not read as constants
            raise RuntimeError(
                "chunk_recurrent_loss: the step's gradients have no graph of their own (create_graph=True, as a "
                "gradient penalty asks): run that step without it"
            )
        if not hasattr(ctx, "step"):
            raise RuntimeError(
                "chunk_recurrent_loss: a second backward through the step, whose file went with the first "
                "(pass retain_graph=True to the first)"
            )
        parts, store, segments, batch, trained, loss_weights, read_again = ctx.step
        read_again.check()
        keep = _keeps_graph()
        if not keep:
            del ctx.step  # the file closes at the end, whatever happens
        try:
            gradients = {weight: store.read(("loss weight grad", i)) for i, weight in enumerate(loss_weights)}
            for index in reversed(range(len(parts.layers))):
                _layer_backward(parts, store, segments, index, batch.positions, gradients, keep)
            embedding = _trained(parts.embed.parameters())  # none when frozen, adapters' alone under LoRA
            for chunk, (start, end) in enumerate(segments.bounds):
                if embedding:
                    grad_hidden = store.read(("grad", 0, chunk))
                    _embedding_backward(parts.embed, embedding, batch.ids[start:end], grad_hidden, gradients)
                store.release(("grad", 0, chunk))
        finally:
            if not keep:
                store.close()
        scale = None if torch.equal(grad_loss, torch.ones_like(grad_loss)) else grad_loss
        grads = [gradients.get(p) for p in trained]
        if scale is not None:
            grads = [g if g is None else g.mul_(scale) for g in grads]
        return (None, None, None, None, None, *grads)


def _embedding_backward(embed, trained, ids, grad_hidden, gradients) -> None:
    """Add one chunk's gradients of the embedding's ``trained`` parameters into ``gradients``: a plain
    ``nn.Embedding``'s rows added in place (autograd would make a dense ``[vocab, hidden]`` gradient per chunk, the
    step's largest transient), else through autograd (adapters, peft's trainable tokens)."""
    plain = type(embed) is nn.Embedding and embed.max_norm is None and not embed.scale_grad_by_freq
    if not plain:
        with torch.enable_grad():
            _add(gradients, embed(ids), grad_hidden, trained)
        return
    if embed.padding_idx is not None:  # its row gets no gradient
        grad_hidden[ids == embed.padding_idx] = 0
    if embed.weight not in gradients:
        gradients[embed.weight] = torch.zeros_like(embed.weight)
    gradients[embed.weight].index_add_(0, ids, grad_hidden.to(embed.weight.dtype))


def _keeps_graph() -> bool:
    """Whether this backward was asked to keep the graph (retain_graph), so that the step's file must stay whole."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else keep_graph()


def _layer_forward(parts, store, segments, index, chunk, positions):
    hidden = store.read(("hidden", index, chunk))
    q, k, v = parts.before_attention(index, hidden, positions)
    for name, value in (("q", q), ("k", k), ("v", v)):
        store.write((name, index, chunk), value)

    def earlier_keys_and_values(earlier):
        return store.read(("k", index, earlier)), store.read(("v", index, earlier))

    attended, log_sum_exp = attend(parts.attentions[index], segments, chunk, q, k, v, earlier_keys_and_values)
    store.write(("attended", index, chunk), attended)
    store.write(("lse", index, chunk), log_sum_exp)
    store.write(("hidden", index + 1, chunk), parts.after_attention(index, hidden, attended))


def _loss_and_gradients(parts, store, bounds, batch, wants_gradients):
    """The loss (the sum over chunks of the fused head's, over ``batch.count``) and the weights whose gradients,
    when wanted, it wrote to the file with the last layer's output gradient per chunk (for a loss gradient of 1)."""
    loss = torch.zeros((), dtype=torch.promote_types(parts.head.weight.dtype, torch.float32))
    gradients: dict = {}
    weights = _trained([*parts.norm.parameters(), parts.head.weight]) if wants_gradients else []
    last = len(parts.layers)
    count = batch.count.to(loss.device) if isinstance(batch.count, torch.Tensor) else batch.count
    for chunk, (start, end) in enumerate(bounds):
        hidden = store.read(("hidden", last, chunk))
        targets = batch.targets[start:end]
        with torch.set_grad_enabled(wants_gradients):
            hidden.requires_grad_(wants_gradients)
            chunk_sum = linear_cross_entropy(
                parts.norm(hidden), parts.head.weight, targets, ignore_index=batch.ignore_index, reduction="sum"
            )
            if wants_gradients:
                # A chunk without a counted target adds no gradient; 1 / count of a batch with none (count 0)
                # would turn its zeros into NaN, where transformers' loss gives zeros.
                counted = bool((targets != batch.ignore_index).any())
                scale = torch.ones_like(chunk_sum) / count if counted else torch.zeros_like(chunk_sum)
                (grad_hidden,) = _add(gradients, chunk_sum, scale, weights, hidden)
                store.write(("grad", last, chunk), grad_hidden)
        chunk_loss = chunk_sum.detach() / count
        loss += chunk_loss
        store.release(("hidden", last, chunk))
    for i, weight in enumerate(weights):
        store.write(("loss weight grad", i), gradients.pop(weight))
    return loss.to(chunk_loss.dtype), weights


def _layer_backward(parts, store, segments, index, positions, gradients, keep):
    """One layer's backward, chunk by chunk; with ``keep``, what forward wrote stays for another backward."""
    layer = parts.layers[index]
    after = [p for m in (layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp) for p in m.parameters()]
    before = [
        p
        for m in (layer.input_layernorm, *_attention_projections(layer.self_attn), *_query_key_norms(layer.self_attn))
        for p in m.parameters()
    ]
    chunks = len(segments.bounds)
    for chunk in range(chunks):  # the residual adds, the norm, o_proj and the MLP, for each chunk
        hidden = store.read(("hidden", index, chunk)).requires_grad_()
        attended = store.read(("attended", index, chunk)).requires_grad_()
        with torch.enable_grad():
            output = parts.after_attention(index, hidden, attended)
            grad_hidden, grad_attended = _add(
                gradients, output, store.read(("grad", index + 1, chunk)), _trained(after), hidden, attended
            )
        if not keep:
            store.release(("hidden", index + 1, chunk))
        if not keep or index + 1 < len(parts.layers):  # the last layer's is the loss's gradient, from forward
            store.release(("grad", index + 1, chunk))
        store.write(("grad", index, chunk), grad_hidden)
        store.write(("grad attended", index, chunk), grad_attended)
        del output, grad_hidden, grad_attended
        return_freed_memory()

    def read(name, chunk):
        return store.read((name, index, chunk))

    def write(name, chunk, tensor):
        store.write((name, index, chunk), tensor)

    attention_backward(parts.attentions[index], segments, read, write)
    for chunk, (start, end) in enumerate(segments.bounds):  # the norms, the projections and the rotary embedding
        hidden = store.read(("hidden", index, chunk)).requires_grad_()
        with torch.enable_grad():
            q, k, v = parts.before_attention(index, hidden, positions[start:end])
            incoming = [store.read((name, index, chunk)).to(q.dtype) for name in ("grad q", "grad k", "grad v")]
            (grad_hidden,) = _add(gradients, (q, k, v), incoming, _trained(before), hidden)
        store.write(("grad", index, chunk), store.read(("grad", index, chunk)) + grad_hidden)
        released = (
            "grad q",
            "grad k",
            "grad v",
            "grad attended",
            *(() if keep else ("q", "k", "v", "attended", "lse")),
        )
        for name in released:
            store.release((name, index, chunk))
        del q, k, v, incoming, grad_hidden
        return_freed_memory()


def _query_key_norms(attention):
    return [getattr(attention, name) for name in sorted(_QUERY_KEY_NORMS) if hasattr(attention, name)]


def _trained(parameters):
    return [p for p in parameters if p.requires_grad]


def _add(gradients: dict, outputs, grad_outputs, parameters, *inputs):
    """The gradients of ``inputs``, with those of ``parameters`` added into ``gradients`` (one tensor each)."""
    found = torch.autograd.grad(outputs, [*inputs, *parameters], grad_outputs, allow_unused=True)
    for parameter, gradient in zip(parameters, found[len(inputs) :]):
        if gradient is None:
            continue
        if parameter in gradients:
            gradients[parameter].add_(gradient)
        else:
            gradients[parameter] = gradient
    return found[: len(inputs)]
