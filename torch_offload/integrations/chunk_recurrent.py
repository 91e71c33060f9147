"""One training step of a Llama-built causal LM, chunk-recurrent: ``chunk_recurrent_loss(model, input_ids, labels)``.

Why: apply()'s layers run module at a time, so autograd's backward of a layer holds ``[T, h]`` tensors (its
output's gradient, its input's, the residual's) whatever the tiers keep: about three hidden vectors per token at the
peak (BENCHMARKS.md, "Peaks by phase"). Here one autograd Function owns the whole step, and everything that grows
with the sequence (each layer's input, queries, keys, values, attention output and log-sum-exp, and the gradients
flowing back) lives in an unnamed file in chunks of ``chunk_tokens`` tokens (``_ChunkFile``). The process holds one
chunk's working set, one chunk of keys and values at a time, the weights' gradients and the token ids: its memory
grows by 16 bytes per token (the ids and labels), whatever the context.

How, per layer: forward attends one chunk of queries to the keys and values of every chunk up to it, read back one
chunk at a time, each pair of chunks through PyTorch's CPU flash kernel and the pairs joined by their log-sum-exps
(an online softmax); the log-sum-exp it keeps makes backward exact without the probabilities. Backward runs the
token-local parts (the residual adds, norms, projections, rotary embedding and MLP) through autograd one chunk at a
time, and attention's backward in FlashAttention-2's order: for each chunk of keys and values, every chunk of
queries after it, the queries' gradient added up in the file. The loss's gradient is computed with its forward
(``linear_cross_entropy``'s gradients in forward), chunk by chunk.

What it takes (``_parts``, and a probe at each call that the step's loss is the model's own on a short sequence):
the decoder's children ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``; each layer's ``input_layernorm``,
``self_attn`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), ``post_attention_layernorm``, ``mlp``; a bias-free
``lm_head``; full causal attention (no sliding window, no attention dropout in training); one row of tokens on the
CPU, without padding or packed documents. Not yet apply()'s path (docs/apply.md, "Chunk-recurrent step").
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from collections import defaultdict

import torch
from torch import nn

from ..disk import default_spill_directory, spill_directory_in_ram
from ..linear_cross_entropy import linear_cross_entropy

__all__ = ["chunk_recurrent_loss"]

_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})  # decoder layers read to be Llama's, q/k/v bias aside
_DECODER_CHILDREN = {"embed_tokens", "layers", "norm", "rotary_emb"}
_LAYER_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_PROBE_TOKENS = 12
# Attention over one pair of chunks ([1, heads, C, d]): the output and log-sum-exp, and the backward given them.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None with another C library
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _ChunkFile:
    """Tensors by key in one unnamed file (gone on any exit), each written and read whole; a released tensor's bytes
    are taken by the next tensor of the same size."""

    def __init__(self, directory: str):
        self._file = tempfile.TemporaryFile(dir=directory)  # O_TMPFILE, or unlinked at once
        self._end = 0
        self._slots: dict = {}  # key: (offset, shape, dtype)
        self._free: defaultdict[int, list[int]] = defaultdict(list)  # bytes: offsets

    def write(self, key, tensor: torch.Tensor) -> None:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.release(key)
        size = data.numel()
        offset = self._free[size].pop() if self._free[size] else self._grow(size)
        view, done = memoryview(data.numpy()), 0
        while done < size:
            done += os.pwrite(self._file.fileno(), view[done:], offset + done)
        self._slots[key] = (offset, tensor.shape, tensor.dtype)

    def read(self, key) -> torch.Tensor:
        offset, shape, dtype = self._slots[key]
        out = torch.empty(shape, dtype=dtype)
        view, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
        while done < len(view):
            read = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if read == 0:
                raise OSError(f"chunk_recurrent_loss: the chunk file ended inside {key}")
            done += read
        return out

    def release(self, key) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            offset, shape, dtype = slot
            self._free[shape.numel() * dtype.itemsize].append(offset)

    def close(self) -> None:
        self._file.close()

    def __del__(self):  # a graph freed without backward, or kept for a second one
        if hasattr(self, "_file"):  # not when the file could not be made
            self.close()

    def _grow(self, size: int) -> int:
        offset, self._end = self._end, self._end + size
        return offset


class _Parts:
    """The modules of a Llama-built causal LM, and its layers' token-local halves as functions of one chunk."""

    def __init__(self, model: nn.Module):
        decoder, config = model.model, model.config
        self.embed, self.layers, self.norm, self.rotary = (
            decoder.embed_tokens,
            list(decoder.layers),
            decoder.norm,
            decoder.rotary_emb,
        )
        self.head = model.lm_head
        attention = self.layers[0].self_attn
        self.rope = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        self.head_dim = attention.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = attention.scaling

    def before_attention(self, layer, hidden, positions):
        """Queries ``[heads, C, d]``, keys and values ``[kv heads, C, d]`` of one chunk, as Llama's attention."""
        attention = layer.self_attn
        x = layer.input_layernorm(hidden[None])
        shape = (1, hidden.shape[0], -1, self.head_dim)
        q, k, v = (projection(x).view(shape).transpose(1, 2) for projection in _attention_projections(attention))
        cos, sin = self.rotary(x, position_ids=positions[None])
        q, k = self.rope(q, k, cos, sin)
        return q[0], k[0], v[0]

    def after_attention(self, layer, hidden, attended):
        """The layer's output for one chunk, from its input and attention's output ``[heads, C, d]``."""
        hidden = hidden + layer.self_attn.o_proj(attended.transpose(0, 1).reshape(hidden.shape[0], -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def by_head(self, keys):
        """Keys or values ``[kv heads, C, d]`` for every query head (transformers' repeat_kv), a batch of one."""
        kv_heads, length, dim = keys.shape
        return keys[:, None].expand(kv_heads, self.groups, length, dim).reshape(1, -1, length, dim)


def _attention_projections(attention):
    return attention.q_proj, attention.k_proj, attention.v_proj


def _parts(model: nn.Module) -> _Parts:
    """The model's parts, or a ValueError saying what is not Llama's."""
    config = getattr(model, "config", None)
    decoder = getattr(model, "model", None)
    if getattr(config, "model_type", None) not in _MODEL_TYPES:
        raise ValueError(
            f"chunk_recurrent_loss: model: model type {getattr(config, 'model_type', None)!r} is not one of "
            f"{sorted(_MODEL_TYPES)}"
        )
    if not isinstance(decoder, nn.Module) or set(dict(decoder.named_children())) != _DECODER_CHILDREN:
        raise ValueError(f"chunk_recurrent_loss: model: its decoder's children are not {sorted(_DECODER_CHILDREN)}")
    for layer in decoder.layers:
        if set(dict(layer.named_children())) != _LAYER_CHILDREN:
            raise ValueError(f"chunk_recurrent_loss: model: a layer's children are not {sorted(_LAYER_CHILDREN)}")
        if set(dict(layer.self_attn.named_children())) != _ATTENTION_CHILDREN:
            raise ValueError(
                f"chunk_recurrent_loss: model: an attention's children are not {sorted(_ATTENTION_CHILDREN)} "
                "(Qwen3's query and key norms are not taken yet)"
            )
        if layer.training and getattr(layer.self_attn, "attention_dropout", 0.0):
            raise ValueError("chunk_recurrent_loss: model: attention dropout in training mode")
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        raise ValueError("chunk_recurrent_loss: model: a sliding window")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError("chunk_recurrent_loss: model: lm_head is not a bias-free nn.Linear")
    if getattr(config, "num_hidden_layers", None) != len(decoder.layers):
        raise ValueError("chunk_recurrent_loss: model: config.num_hidden_layers is not the number of layers")
    return _Parts(model)


def chunk_recurrent_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = 2048,
    directory: str | os.PathLike | None = None,
) -> torch.Tensor:
    """``model(input_ids=input_ids, labels=labels).loss``, differentiable in the model's parameters, in memory that
    does not grow with the sequence but for 16 bytes per token (see the module's docstring).

    ``input_ids`` and ``labels`` are ``[1, T]`` (or ``[T]``) int64 on the CPU; labels of -100 are not counted.
    ``chunk_tokens`` sets the chunk (the working set grows with its square: attention's ``[heads, C, C]`` scores);
    ``directory`` where the chunk file lives (the disk tier's default; RAM file systems are refused)."""
    parts = _parts(model)
    for name, value in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.device.type != "cpu":
            raise TypeError(f"chunk_recurrent_loss: {name} must be an int64 CPU tensor")
        if value.dim() not in (1, 2) or (value.dim() == 2 and value.shape[0] != 1) or value.numel() == 0:
            raise ValueError(f"chunk_recurrent_loss: {name} must be [1, T] or [T] with T > 0, got {list(value.shape)}")
    if input_ids.shape != labels.shape:
        raise ValueError(
            f"chunk_recurrent_loss: labels' shape {list(labels.shape)} is not input_ids' {list(input_ids.shape)}"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_recurrent_loss: chunk_tokens must be a positive int, got {chunk_tokens!r}")
    directory = os.fspath(directory) if directory is not None else default_spill_directory()
    if not os.path.isdir(directory):
        raise ValueError(f"chunk_recurrent_loss: directory {directory!r} is not a directory")
    if spill_directory_in_ram(directory):
        raise ValueError(f"chunk_recurrent_loss: directory {directory!r} is on a RAM file system")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("chunk_recurrent_loss: model: its parameters must be on the CPU")
    ids = input_ids.reshape(-1)
    targets = torch.cat([labels.reshape(-1)[1:], labels.new_full((1,), -100)])  # transformers' shift
    _probe(model, parts, ids, directory)
    named = dict(model.named_parameters())  # a tied head's weight once
    trained = [p for p in named.values() if p.requires_grad]
    return _ChunkRecurrentStep.apply(parts, ids, targets, chunk_tokens, directory, trained, *trained)


def _probe(model: nn.Module, parts: _Parts, ids: torch.Tensor, directory: str) -> None:
    """Refuse a model whose own loss on the sequence's first tokens is not the step's: a forward of its own."""
    probe = ids[:_PROBE_TOKENS]
    with torch.no_grad():
        want = model(input_ids=probe[None], labels=probe[None], use_cache=False).loss
        targets = torch.cat([probe[1:], probe.new_full((1,), -100)])
        got = _ChunkRecurrentStep.apply(parts, probe, targets, max(1, len(probe) // 2), directory, [])
    if not torch.allclose(got.to(want.dtype), want, rtol=1e-4, atol=1e-5):  # transformers: a float32 loss
        raise ValueError(
            f"chunk_recurrent_loss: model: its own loss on {len(probe)} tokens is {want.item()}, the chunk-recurrent "
            f"step's {got.item()}: its forward is not Llama's"
        )


class _ChunkRecurrentStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, parts, ids, targets, chunk_tokens, directory, trained, *parameters):
        store = _ChunkFile(directory)
        bounds = [(start, min(start + chunk_tokens, len(ids))) for start in range(0, len(ids), chunk_tokens)]
        wants_gradients = any(ctx.needs_input_grad[6:])
        try:
            for chunk, (start, end) in enumerate(bounds):
                store.write(("hidden", 0, chunk), parts.embed(ids[start:end]))
            for index, layer in enumerate(parts.layers):
                for chunk, (start, end) in enumerate(bounds):
                    _layer_forward(parts, store, index, layer, chunk, start, end)
                    _return_freed_memory()
            count = (targets != -100).sum()
            loss, loss_weights = _loss_and_gradients(parts, store, bounds, targets, count, wants_gradients)
        except BaseException:
            store.close()
            raise
        if not wants_gradients:
            store.close()
            return loss
        ctx.step = (parts, store, bounds, ids, trained, loss_weights)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if not hasattr(ctx, "step"):
            raise RuntimeError(
                "chunk_recurrent_loss: a second backward through the step, whose file went with the first "
                "(pass retain_graph=True to the first)"
            )
        parts, store, bounds, ids, trained, loss_weights = ctx.step
        keep = _keeps_graph()
        if not keep:
            del ctx.step  # the file closes at the end, whatever happens
        try:
            gradients = {weight: store.read(("loss weight grad", i)) for i, weight in enumerate(loss_weights)}
            for index in reversed(range(len(parts.layers))):
                _layer_backward(parts, store, index, bounds, gradients, keep)
            for chunk, (start, end) in enumerate(bounds):
                if parts.embed.weight.requires_grad:  # frozen under LoRA, say
                    with torch.enable_grad():
                        grad_hidden = store.read(("grad", 0, chunk))
                        _add(gradients, parts.embed(ids[start:end]), grad_hidden, [parts.embed.weight])
                store.release(("grad", 0, chunk))
        finally:
            if not keep:
                store.close()
        scale = None if torch.equal(grad_loss, torch.ones_like(grad_loss)) else grad_loss
        grads = [gradients.get(p) for p in trained]
        if scale is not None:
            grads = [g if g is None else g.mul_(scale) for g in grads]
        return (None, None, None, None, None, None, *grads)


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): glibc keeps freed blocks of up to 32 MiB
    resident by default, and a chunk's tensors, freed and taken again in other sizes, would pile them up layer after
    layer."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _keeps_graph() -> bool:
    """Whether this backward was asked to keep the graph (retain_graph), so that the step's file must stay whole."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else keep_graph()


def _layer_forward(parts, store, index, layer, chunk, start, end):
    hidden = store.read(("hidden", index, chunk))
    positions = torch.arange(start, end)
    q, k, v = parts.before_attention(layer, hidden, positions)
    for name, value in (("q", q), ("k", k), ("v", v)):
        store.write((name, index, chunk), value)
    attended, log_sum_exp = _attend(parts, store, index, chunk, q, k, v)
    store.write(("attended", index, chunk), attended)
    store.write(("lse", index, chunk), log_sum_exp)
    store.write(("hidden", index + 1, chunk), parts.after_attention(layer, hidden, attended))


def _attend(parts, store, index, chunk, q, k_here, v_here):
    """Attention of one chunk of queries to every chunk of keys up to it, read one chunk at a time, each pair through
    PyTorch's CPU flash kernel and the pairs joined by their log-sum-exps: the output in the queries' dtype and the
    log-sum-exp (float32, float64 for float64) per head and query."""
    compute = torch.promote_types(q.dtype, torch.float32)
    q = q.to(compute)[None]
    out, log_sum_exp = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=compute)
    for earlier in range(chunk + 1):
        k, v = (
            (k_here, v_here)
            if earlier == chunk
            else (store.read(("k", index, earlier)), store.read(("v", index, earlier)))
        )
        pair_out, pair_log_sum_exp = _FLASH(
            q, parts.by_head(k.to(compute)), parts.by_head(v.to(compute)), 0.0, earlier == chunk, scale=parts.scaling
        )
        joined = torch.logaddexp(log_sum_exp, pair_log_sum_exp)
        out = out * (log_sum_exp - joined).exp()[..., None] + pair_out * (pair_log_sum_exp - joined).exp()[..., None]
        log_sum_exp = joined
    return out[0].to(k_here.dtype), log_sum_exp[0]


def _loss_and_gradients(parts, store, bounds, targets, count, wants_gradients):
    """The loss (the sum over chunks of the fused head's, over the counted tokens) and the weights whose gradients,
    when wanted, it wrote to the file with the last layer's output gradient per chunk (for a loss gradient of 1)."""
    loss = torch.zeros((), dtype=torch.promote_types(parts.head.weight.dtype, torch.float32))
    gradients: dict = {}
    weights = [p for p in (parts.norm.weight, parts.head.weight) if p.requires_grad] if wants_gradients else []
    last = len(parts.layers)
    for chunk, (start, end) in enumerate(bounds):
        hidden = store.read(("hidden", last, chunk))
        with torch.set_grad_enabled(wants_gradients):
            hidden.requires_grad_(wants_gradients)
            chunk_loss = (
                linear_cross_entropy(parts.norm(hidden), parts.head.weight, targets[start:end], reduction="sum") / count
            )
            if wants_gradients:
                (grad_hidden,) = _add(gradients, chunk_loss, torch.ones_like(chunk_loss), weights, hidden)
                store.write(("grad", last, chunk), grad_hidden)
        loss += chunk_loss.detach()
        store.release(("hidden", last, chunk))
    for i, weight in enumerate(weights):
        store.write(("loss weight grad", i), gradients.pop(weight))
    return loss.to(chunk_loss.dtype), weights


def _layer_backward(parts, store, index, bounds, gradients, keep):
    """One layer's backward, chunk by chunk; with ``keep``, what forward wrote stays for another backward."""
    layer = parts.layers[index]
    after = [p for m in (layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp) for p in m.parameters()]
    before = [p for m in (layer.input_layernorm, *_attention_projections(layer.self_attn)) for p in m.parameters()]
    for chunk in range(len(bounds)):  # the residual adds, the norm, o_proj and the MLP, for each chunk
        hidden = store.read(("hidden", index, chunk)).requires_grad_()
        attended = store.read(("attended", index, chunk)).requires_grad_()
        with torch.enable_grad():
            output = parts.after_attention(layer, hidden, attended)
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
        _return_freed_memory()
    _attention_backward(parts, store, index, len(bounds))
    for chunk, (start, end) in enumerate(bounds):  # the norm, the projections and the rotary embedding
        hidden = store.read(("hidden", index, chunk)).requires_grad_()
        with torch.enable_grad():
            q, k, v = parts.before_attention(layer, hidden, torch.arange(start, end))
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
        _return_freed_memory()


def _attention_backward(parts, store, index, chunks):
    """FlashAttention-2's backward over chunks: for each chunk of keys and values, every chunk of queries at or
    after it, each pair through PyTorch's CPU flash kernel given the whole row's output and log-sum-exp (which makes
    a pair's gradients its exact share); the keys' and values' gradients added up here, the queries' in the file."""
    for keys_chunk in range(chunks):
        k, v = store.read(("k", index, keys_chunk)), store.read(("v", index, keys_chunk))
        compute = torch.promote_types(k.dtype, torch.float32)
        k_heads, v_heads = parts.by_head(k.to(compute)), parts.by_head(v.to(compute))
        grad_k, grad_v = torch.zeros_like(k_heads), torch.zeros_like(v_heads)
        for queries_chunk in range(keys_chunk, chunks):
            q, grad_out, attended = (
                store.read((name, index, queries_chunk)).to(compute)[None]
                for name in ("q", "grad attended", "attended")
            )
            log_sum_exp = store.read(("lse", index, queries_chunk))[None]
            diagonal = queries_chunk == keys_chunk
            grad_q, pair_grad_k, pair_grad_v = _FLASH_BACKWARD(
                grad_out, q, k_heads, v_heads, attended, log_sum_exp, 0.0, diagonal, scale=parts.scaling
            )
            grad_k += pair_grad_k
            grad_v += pair_grad_v
            if keys_chunk > 0:
                grad_q += store.read(("grad q", index, queries_chunk))
            store.write(("grad q", index, queries_chunk), grad_q[0])
        kv_shape = (k.shape[0], parts.groups, *k.shape[1:])
        _return_freed_memory()
        store.write(("grad k", index, keys_chunk), grad_k.view(kv_shape).sum(1))
        store.write(("grad v", index, keys_chunk), grad_v.view(kv_shape).sum(1))


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
