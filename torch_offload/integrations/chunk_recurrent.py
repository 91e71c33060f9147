"""One training step of a causal LM, chunk-recurrent: ``chunk_recurrent_loss(model, input_ids, labels)``, and
apply()'s step for training calls with labels (chunk_recurrent_route.py).

Why: a whole training step holds tensors of every token at once (each layer's activations, autograd's gradients of
``[T, hidden]``). Here one autograd Function owns the step, and everything that grows with the sequence (each
layer's output, keys, values, attention output and log-sum-exp, the gradients flowing back) lives in the step's store
in chunks of ``chunk_tokens`` tokens (chunk_store.py: by default on the CPU the disk tier's unnamed file; on a GPU
pinned host memory, past its budget the file). The process (on a GPU, the device) holds one chunk's working set, one
chunk of keys and values at a time and the weights' gradients, and the host the batch's token ids, positions and
labels: a few bytes per token, whatever the context.

How: forward runs the decoder's own forward on one chunk after another (chunk_model.py), its attention modules
calling the step's attention implementation (chunk_seam.py), which attends a chunk's queries to the keys and values
of every chunk up to it, within the batch's documents and rows (chunk_attention.py); the loss and its gradient come
per chunk from the fused head (``linear_cross_entropy``, gradients in forward). Backward runs the chunks last to
first: the decoder's forward again, each layer handing on the output forward kept, and autograd back through it,
which recomputes one layer of one chunk at a time through the model's own modules; attention's backward then takes
the chunk's queries against every earlier chunk, whose keys' and values' shares wait in the file until their own
chunk runs.

What it takes (``step_problem``): a causal LM whose ``get_decoder()`` holds the decoder layers and the input
embedding and whose output layer is a plain ``nn.Linear`` outside it, every trained parameter in one of the two (or
one its loss on text does not reach: a vision tower's, which gets no gradient either way), float32 or float64 (on a
GPU float32, bfloat16 or float16: its attention kernels take no float64; the weights' gradients summed in float32),
no dropout in training (backward's recomputation would draw other masks), a rotary embedding that does not depend on
the call's longest position, no embedding that counts tokens (``scale_grad_by_freq``) or whose gradient is sparse;
and what the seam refuses at run time (``Unsupported``: dropout in attention, a mask composed from overlays, an
argument it does not know). Rows of tokens (on the CPU or the model's GPU): one row, several, packed documents
(``position_ids`` restarting), padded rows (``attention_mask``), read as transformers reads them without a key/value
cache (chunk_batch.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..causal_lm_loss import _PROBE_RTOL
from ..disk import default_spill_directory, spill_directory_in_ram
from ..linear_cross_entropy import linear_cross_entropy
from .chunk_attention import Segments
from .chunk_batch import Batch, batch_of, checked_rows, chunk_bounds, reach_of, runs_of_real_tokens
from .chunk_model import StepModel, add_gradients, packs_documents, reached_outside, step_model_problem
from .chunk_seam import StepAttention, Unsupported, running
from .chunk_store import ChunkStore, return_freed_memory
from .sequence_parallelism import rope_of_the_calls_positions

__all__ = ["chunk_recurrent_loss"]

CHUNK_TOKENS = 2048  # tokens per chunk: attention's pairs of chunks work in [heads, C, C] blocks
# On a GPU each pair of chunks reads the earlier chunk's keys and values from host memory: T^2 / (2C) tokens' worth a
# layer and pass (4 KiB a token at Llama-8B), 1 TiB a layer at a million tokens in chunks of 2048, 64 GiB in chunks
# of 32768, a few seconds' copying beside the 20-odd seconds of attention's own arithmetic. Its flash kernels write no
# [C, C] scores.
GPU_CHUNK_TOKENS = 32768
_PROBE_TOKENS = 12


def step_problem(model: nn.Module, unreached: frozenset | None = frozenset()) -> str | None:
    """What in ``model`` the step would not compute as its own forward and loss do (see the module's docstring), or
    None; what only a call shows, the seam refuses then. ``unreached``: trained parameters outside its decoder and
    output layer that its loss was found not to reach (chunk_model.reached_outside), None where a probe will look."""
    problem = step_model_problem(model, unreached)
    if problem is not None:
        return problem
    dropout = next((name for name, m in model.named_modules() if _drops_out(m)), None)
    if dropout is not None:
        return f"{dropout} drops out in training mode (backward's recomputation would draw other masks)"
    config = getattr(model, "config", None)
    if rope_of_the_calls_positions(config) is not None:
        return f"its rotary embedding ({rope_of_the_calls_positions(config)!r}) depends on a call's longest position"
    dtypes = {p.dtype for p in model.parameters()}
    on_gpu = all(p.device.type == "cuda" for p in model.parameters())
    if on_gpu and torch.float64 in dtypes:
        return "parameters in torch.float64 on a GPU, whose attention kernels take float32, bfloat16 and float16"
    low_precision = sorted(str(dtype) for dtype in dtypes - {torch.float32, torch.float64})
    if low_precision and not on_gpu:  # tested against float64 on a GPU only, where users train in them
        return (
            f"parameters in {', '.join(low_precision)}: the step would round each chunk's share of their gradients "
            "(on the CPU it takes float32 and float64; on a GPU bfloat16 and float16 too)"
        )
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
    chunk_tokens: int | None = None,
    directory: str | os.PathLike | None = None,
    host_budget: int | None = None,
) -> torch.Tensor:
    """``model(input_ids=..., labels=..., attention_mask=..., position_ids=..., use_cache=False).loss``,
    differentiable in the model's parameters, in memory that does not grow with the sequence but for the batch's own
    tensors (see the module's docstring).

    The model's parameters are on the CPU or on one CUDA GPU; ``input_ids`` and ``labels`` are ``[rows, T]`` (or
    ``[T]``) int64 on the CPU or that GPU; labels equal to ``ignore_index`` are not counted, and
    ``num_items_in_batch`` divides the summed loss where given (transformers' gradient accumulation).
    ``attention_mask`` (1 for real tokens, contiguous in each row) and ``position_ids`` (packed documents restart at
    0) are transformers'. ``chunk_tokens`` sets the chunk (None: CHUNK_TOKENS on the CPU, where the working set grows
    with its square, attention's ``[heads, C, C]`` blocks; GPU_CHUNK_TOKENS on a GPU); ``directory`` where the chunk
    file lives (the disk tier's default; RAM file systems are refused). ``host_budget`` (bytes): the chunks' tensors
    wait in host memory up to it, the oldest moved to the file past it (chunk_store.py). None: on the CPU every one
    goes to the file, whose memory stays flat; on a GPU the pinned arena's free budget (a budget past it is refused:
    its copies would be pageable). On the CPU a budget makes the host tier stand in for a GPU's pinned one: the GPU
    step's test mode (docs/apply.md)."""
    devices = {p.device for p in model.parameters()}
    device = next(iter(devices)) if len(devices) == 1 else None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError("chunk_recurrent_loss: model: its parameters must be on one device, the CPU or a CUDA GPU")
    if device.type == "cuda" and torch.version.hip is not None:  # its kernels' log-sum-exp layouts differ
        raise ValueError("chunk_recurrent_loss: model: it is on a ROCm GPU; the step's GPU kernels are CUDA's")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "chunk_recurrent_loss: a CUDA graph is being captured: the step reads its batch on the host and moves "
            "its chunks between the device, host memory and disk, which a graph cannot replay"
        )
    problem = step_problem(model, unreached=None)  # the probe below looks at the parameters outside
    if problem is not None:
        raise ValueError(f"chunk_recurrent_loss: model: {problem}")
    input_ids, labels, attention_mask, position_ids = (
        checked_rows(name, value, optional, input_ids, device)
        for name, value, optional in (
            ("input_ids", input_ids, False),
            ("labels", labels, False),
            ("attention_mask", attention_mask, True),
            ("position_ids", position_ids, True),
        )
    )
    if attention_mask is not None and bool((runs_of_real_tokens(attention_mask) > 1).any()):
        raise ValueError("chunk_recurrent_loss: attention_mask: a row's real tokens are not contiguous")
    if chunk_tokens is None:
        chunk_tokens = GPU_CHUNK_TOKENS if device.type == "cuda" else CHUNK_TOKENS
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_recurrent_loss: chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    directory = os.fspath(directory) if directory is not None else default_spill_directory()
    if not os.path.isdir(directory):
        raise ValueError(f"chunk_recurrent_loss: directory {directory!r} is not a directory")
    if spill_directory_in_ram(directory):
        raise ValueError(f"chunk_recurrent_loss: directory {directory!r} is on a RAM file system")
    host_budget = _host_budget(host_budget, device)
    if autocast_on():
        raise RuntimeError("chunk_recurrent_loss: autocast is on: call the step outside torch.autocast")
    _probe(model, input_ids[0], directory, host_budget)
    batch = batch_of(
        input_ids,
        labels,
        attention_mask=attention_mask,
        position_ids=position_ids,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        packed=packs_documents(model),
    )
    return chunk_recurrent_step(model, batch, chunk_tokens, directory, host_budget)


def _host_budget(host_budget, device: torch.device) -> int | None:
    """The store's host budget (chunk_store.py): as given on the CPU; on a GPU at most what the pinned arena has free
    (past it offload_pack's copies would be pageable, which the step never makes), that by default."""
    whole_bytes = isinstance(host_budget, int) and not isinstance(host_budget, bool)
    if host_budget is not None and not (whole_bytes and host_budget >= 0):
        raise ValueError(f"chunk_recurrent_loss: host_budget must be None or an int >= 0, got {host_budget!r}")
    if device.type != "cuda":
        return host_budget
    arena = torch.ops.offload.pinned_arena_stats()  # budget, reserved, in use, ...
    free = max(0, arena[0] - arena[2])
    if host_budget is not None and host_budget > free:
        raise ValueError(
            f"chunk_recurrent_loss: host_budget ({host_budget} bytes) is over what the pinned arena has free ({free} "
            "bytes; torch_offload.set_pinned_budget raises it): past it the copies would be pageable"
        )
    # By default a sixteenth less: a slice does not cross the arena's chunks, whose ends go unused.
    return free - free // 16 if host_budget is None else host_budget


def _probe(model: nn.Module, ids: torch.Tensor, directory: str, host_budget: int | None) -> None:
    """Refuse a model whose own loss on the sequence's first tokens is not the step's (what only running it shows:
    a call of its attention the seam refuses, a forward across tokens outside attention)."""
    probe = ids[None, :_PROBE_TOKENS]
    head = model.get_output_embeddings().weight
    on_device = probe.to(head.device)
    reached = reached_outside(model, dict(input_ids=on_device, labels=on_device))
    if reached is not None:
        raise ValueError(f"chunk_recurrent_loss: model: {reached}")
    with torch.no_grad():
        want = model(input_ids=on_device, labels=on_device, use_cache=False).loss
        try:
            chunks = max(1, probe.shape[1] // 2)
            got = chunk_recurrent_step(model, batch_of(probe, probe), chunks, directory, host_budget)
        except Unsupported as error:
            raise ValueError(f"chunk_recurrent_loss: model: {error}") from None
    rtol = _PROBE_RTOL.get(head.dtype, 1e-4)  # transformers: a float32 loss, of bfloat16 logits in a bfloat16 model
    if not torch.allclose(got.to(want.dtype), want, rtol=rtol, atol=rtol / 10):
        raise ValueError(
            f"chunk_recurrent_loss: model: its own loss on {probe.shape[1]} tokens is {want.item()}, the "
            f"chunk-recurrent step's {got.item()}: its forward differs in chunks"
        )


def chunk_recurrent_step(
    model: nn.Module, batch: Batch, chunk_tokens: int, directory: str, host_budget: int | None = None
) -> torch.Tensor:
    """The step's loss, differentiable in ``model``'s trained parameters (checked by the caller)."""
    named = dict(model.named_parameters())  # a tied head's weight once
    trained = [p for p in named.values() if p.requires_grad]
    parts = StepModel(model)
    read_again = _ReadAgain(model, batch.ids if _trained(parts.embed.parameters()) else None)
    # Keys and values are read for every later chunk: past the host budget they move to disk last. What the model's
    # own code holds too (its keys, values, attention output, layers' outputs) is watched for an in-place change
    # during its copy; the step's own buffers are not, nor held for it.
    device, reread, watched = parts.head.weight.device, frozenset({"k", "v"}), frozenset({"k", "v", "out", "output"})
    store = ChunkStore(directory, host_budget=host_budget, device=device, reread=reread, watched=watched)
    return _ChunkRecurrentStep.apply(parts, batch, chunk_tokens, store, (trained, read_again), *trained)


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
    def forward(ctx, parts, batch, chunk_tokens, store, trained_and_read_again, *parameters):
        trained, read_again = trained_and_read_again
        bounds = chunk_bounds(batch, chunk_tokens, within_rows=parts.places_from_cache)
        segments = Segments(bounds, batch.query_segments, batch.key_segments, batch.chunked_places)
        seam = StepAttention(store, segments, reach_of(batch), parts.layer_of)
        wants_gradients = any(ctx.needs_input_grad[5:])
        if parts.eager and batch.query_segments is not None:
            unseeing = (batch.query_segments < 0) & (batch.targets != batch.ignore_index)
            if bool(unseeing.any()):
                store.close()
                raise Unsupported(
                    "eager attention gives a query that sees no key (a left pad) a softmax over its whole row, "
                    "later keys too, and its label is counted"
                )
        weight = parts.head.weight
        loss = weight.new_zeros((), dtype=torch.promote_types(weight.dtype, torch.float32))
        gradients: dict = {}
        head = _trained(p for p in (parts.head.weight, parts.head.bias) if p is not None) if wants_gradients else []

        def write(layer, output):
            store.write(("output", layer, seam.chunk), output)

        try:
            with running(seam, parts.configs), parts.layers_recorded(write, seam.hand_on):
                for chunk, (start, end) in enumerate(bounds):
                    seam.start(chunk, backward=False)
                    with torch.no_grad():
                        hidden = parts.hidden(
                            batch.ids[start:end], batch.positions[start:end], start % batch.row_length
                        )
                    seam.finish(len(parts.layers))
                    chunk_loss, grad_hidden = _chunk_loss(
                        parts, hidden, batch, start, end, wants_gradients, head, gradients
                    )
                    loss += chunk_loss
                    if grad_hidden is not None:
                        store.write(("grad", chunk), grad_hidden)
                    del hidden, grad_hidden
                    store.settle()
                    return_freed_memory()
        except BaseException:
            store.close()
            raise
        if not wants_gradients:
            store.close()
            return loss.to(chunk_loss.dtype)
        ctx.step = (parts, store, seam, batch, trained, gradients, read_again)
        return loss.to(chunk_loss.dtype)

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
        parts, store, seam, batch, trained, head_gradients, read_again = ctx.step
        read_again.check()
        keep = _keeps_graph()
        if not keep:
            del ctx.step  # the file closes at the end, whatever happens
        gradients = {p: g.clone() if keep else g for p, g in head_gradients.items()}
        plain = parts.plain_embedding()
        others = parts.others()
        try:

            def read(layer):
                return store.read(("output", layer, seam.chunk))

            def read_ahead(layer, input_too):  # what the layer's backward reads first: its attention's results, its
                # input where it reads it again; from host memory only (from the file the CPU's step held 34 MiB more
                # at 8K tokens, no faster)
                keys = [("out", layer, seam.chunk), ("lse", layer, seam.chunk)]
                for key in keys + ([("output", layer - 1, seam.chunk)] if input_too else []):
                    store.prefetch(key, from_file=False)

            replayed = parts.layers_replayed(read, gradients, seam.handed_on, read_ahead)
            with running(seam, parts.configs), replayed as entries:
                for chunk in reversed(range(len(seam.segments.bounds))):
                    start, end = seam.segments.bounds[chunk]
                    seam.start(chunk, backward=True)
                    entries.clear()
                    with torch.enable_grad(), parts.embeddings_seen() as seen:
                        hidden = parts.hidden(
                            batch.ids[start:end], batch.positions[start:end], start % batch.row_length
                        )
                        read_ahead(len(parts.layers) - 1, False)  # backward begins with the last layer
                        embedded = [output for _, output in seen] if plain else []
                        found = torch.autograd.grad(
                            hidden,
                            [*embedded, *others, *entries],
                            store.read(("grad", chunk)).to(hidden.dtype),
                            allow_unused=True,
                        )
                    seam.finish(len(parts.layers))
                    add_gradients(gradients, others, found[len(embedded) : len(embedded) + len(others)])
                    for call, ((ids, _), grad) in enumerate(zip(seen, found[: len(embedded)])):  # _embedding_rows
                        if grad is not None:
                            store.write(("grad embedding", chunk, call), grad.reshape(-1, grad.shape[-1]))
                            store.write(("embedded ids", chunk, call), ids.reshape(-1))
                    if not keep:  # no chunk before this one reads its keys and values
                        store.release(("grad", chunk))
                        for layer in range(len(parts.layers)):
                            for name in ("k", "v", "out", "lse", "output"):
                                store.release((name, layer, chunk))
                    del hidden, found, seen, embedded
                    entries.clear()
                    store.settle()
                    return_freed_memory()
            if plain:
                _embedding_rows(parts.embed, store, len(seam.segments.bounds), gradients)
        finally:
            if not keep:
                store.close()
        scale = None if torch.equal(grad_loss, torch.ones_like(grad_loss)) else grad_loss
        grads = [gradients.get(p) for p in trained]
        if scale is not None:
            grads = [g if g is None else g.mul_(scale) for g in grads]
        grads = [g if g is None else g.to(p.dtype) for g, p in zip(grads, trained)]  # summed in at least float32
        return (None, None, None, None, None, *grads)


def _chunk_loss(parts, hidden, batch, start, end, wants_gradients, head, gradients):
    """One chunk's share of the loss (its summed fused loss over ``batch.count``) and, ``wants_gradients``, its
    hidden states' gradient (for a loss gradient of 1), that of the head's trained parameters ``head`` added into
    ``gradients``; else None."""
    targets = batch.targets[start:end].to(hidden.device)
    count = batch.count
    with torch.set_grad_enabled(wants_gradients):
        hidden = hidden.detach().requires_grad_(wants_gradients)
        scaled = hidden * parts.math.scale if parts.math.scale != 1.0 else hidden
        chunk_sum = linear_cross_entropy(
            scaled,
            parts.head.weight,
            targets,
            bias=parts.head.bias,
            ignore_index=batch.ignore_index,
            reduction="sum",
            softcap=parts.math.softcap,
        )
        chunk_sum = chunk_sum.to(torch.promote_types(chunk_sum.dtype, torch.float32))
        grad_hidden = None
        if wants_gradients:
            # A chunk without a counted target adds no gradient; 1 / count of a batch with none (count 0) would
            # turn its zeros into NaN, where transformers' loss gives zeros.
            counted = bool((targets != batch.ignore_index).any())
            scale = torch.ones_like(chunk_sum) / count if counted else torch.zeros_like(chunk_sum)
            found = torch.autograd.grad(chunk_sum, [hidden, *head], scale, allow_unused=True)
            grad_hidden = found[0]
            add_gradients(gradients, head, found[1:])
    return chunk_sum.detach() / count, grad_hidden


def _embedding_rows(embed: nn.Embedding, store, chunks: int, gradients: dict) -> None:
    """The plain embedding's gradient, made after every chunk's layers (its ``[vocab, hidden]`` tensor beside no
    layer's working set): each call's rows added in place (autograd would make a dense one per chunk)."""
    for chunk in range(chunks):
        call = 0
        while store.has(("grad embedding", chunk, call)):
            grad_rows = store.pop(("grad embedding", chunk, call))
            ids = store.pop(("embedded ids", chunk, call))
            if embed.padding_idx is not None:  # its row gets no gradient
                grad_rows[ids == embed.padding_idx] = 0
            if embed.weight not in gradients:  # summed in at least float32 (add_gradients)
                gradients[embed.weight] = torch.zeros_like(
                    embed.weight, dtype=torch.promote_types(embed.weight.dtype, torch.float32)
                )
            gradients[embed.weight].index_add_(0, ids, grad_rows.to(gradients[embed.weight].dtype))
            call += 1


def _keeps_graph() -> bool:
    """Whether this backward was asked to keep the graph (retain_graph), so that the step's file must stay whole."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else keep_graph()


def _trained(parameters):
    return [p for p in parameters if p.requires_grad]
