"""What the chunk-recurrent step (chunk_recurrent.py) runs of a causal LM: its decoder's own forward on one chunk of
tokens at a time, its layers' own forwards recorded in forward and recomputed in backward, its embedding and head.

The step never writes a layer of its own: each chunk runs through ``decoder(inputs_embeds=..., position_ids=...)``,
the model's own modules (embedding scale, norms, projections, query/key norms, rotary embedding, MLP or experts,
final norm), with the attention implementation of chunk_seam.py, so every parameter (adapters, a subclass's) gets
the gradient the model's code defines. While the step runs, each decoder layer's forward is wrapped
(``layers_recorded``, ``layers_replayed``): forward keeps each layer's output; in backward's pass the decoder's
forward runs again and each layer hands on the output forward kept, and autograd then recomputes the layer's own
forward from its input, one layer of one chunk at a time (``_ReplayedLayer``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import MutableMapping

import torch
from torch import nn
from torch.utils import _pytree

from ..causal_lm_loss import _head_math, _HeadMath
from ..families import family_of
from .implementations import _configs
from .layers import _attention_of, _find_layers

__all__ = ["StepModel", "packs_documents", "reached_outside", "step_model_problem", "trained_outside"]


class StepModel:
    """A causal LM as the step runs it: ``decoder``, its ``layers`` and each one's attention module (by id),
    ``embed``, ``head`` and what the model does to the head's logits (``math``), the configs that name the attention
    implementation."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.head = model.get_output_embeddings()
        self.decoder, self.layers = _decoder_and_layers(model)
        self.embed = self.decoder.get_input_embeddings()
        self.layer_of = {id(getattr(layer, _attention_of(layer))): index for index, layer in enumerate(self.layers)}
        self.math: _HeadMath = _head_math(model, self.head)
        self.configs = _configs(self.decoder)
        family = family_of(getattr(self.decoder, "config", None))
        self.places_from_cache = family is not None and family.places_from_cache
        self._place = 0  # where the running chunk begins in its row
        # Eager attention gives a query that sees no key (a left pad) a softmax over its whole row, later keys too.
        self.eager = any(vars(config).get("_attn_implementation_internal") == "eager" for config in self.configs)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, place: int) -> torch.Tensor:
        """The decoder's own output ``[C, hidden]`` (after its final norm) for one chunk's ``ids`` at ``positions``,
        beginning at ``place`` in its row."""
        self._place = place
        device = self.head.weight.device  # the batch waits on the host
        output = self.decoder(input_ids=ids[None].to(device), position_ids=positions[None].to(device), use_cache=False)
        return output.last_hidden_state[0]

    def _placed(self, kwargs: dict) -> dict:
        """A layer's keyword arguments, with a _ChunkPlace for its cache where the family reads places there."""
        return {**kwargs, "cache": _ChunkPlace(self._place)} if self.places_from_cache else kwargs

    def plain_embedding(self) -> bool:
        """Whether the input embedding is a trained plain ``nn.Embedding``, whose gradient the step adds by rows
        (embeddings_seen) rather than through autograd, which makes a dense ``[vocab, hidden]`` one per chunk."""
        embed = self.embed
        return type(embed) is nn.Embedding and embed.max_norm is None and embed.weight.requires_grad

    def others(self) -> list[nn.Parameter]:
        """The decoder's trained parameters in no layer, but the plain embedding's weight: its final norm's, an
        embedding's adapters, another embedding (Gemma 3n's per-layer one)."""
        inside = {id(p) for layer in self.layers for p in layer.parameters()}
        if self.plain_embedding():
            inside.add(id(self.embed.weight))
        return [p for p in self.decoder.parameters() if p.requires_grad and id(p) not in inside]

    @contextlib.contextmanager
    def embeddings_seen(self):
        """A list of (ids, output) of every call of the input embedding inside, whose outputs' gradients the caller
        asks autograd for."""
        seen, own, before = [], self.embed.forward, vars(self.embed).get("forward")

        def forward(ids):
            output = own(ids)
            seen.append((ids, output))
            return output

        vars(self.embed)["forward"] = forward
        try:
            yield seen
        finally:
            if before is None:
                vars(self.embed).pop("forward", None)
            else:
                vars(self.embed)["forward"] = before

    @contextlib.contextmanager
    def layers_recorded(self, write, hand_on):
        """Each layer's forward, while the step's forward runs: the layer's own, its output handed to
        ``write(layer, output)``, and each entry it sets in a mapping the decoder hands every layer (Gemma 3n's
        ``shared_kv_states``) to ``hand_on(layer, name, key, value)``."""

        def wrapped(index, own):
            def forward(*args, **kwargs):
                kwargs = self._placed(kwargs)
                before = {name: dict(given) for name, given in kwargs.items() if isinstance(given, MutableMapping)}
                output = own(*args, **kwargs)
                write(index, _hidden_of(output, self.layers[index]))
                for name, entries in before.items():
                    for key, value in kwargs[name].items():
                        if entries.get(key) is not value:
                            hand_on(index, name, key, value)
                return output

            return forward

        with _layers_wrapped(self.layers, wrapped):
            yield

    @contextlib.contextmanager
    def layers_replayed(self, read, gradients: dict, handed_on, read_ahead=None):
        """Each layer's forward, while backward's pass runs: the output ``read(layer)`` gives (forward's), and the
        entries ``handed_on(layer)`` gives ((name, key, value): what it set in forward) set again for the layers
        after it; its backward recomputes the layer's own forward and adds its parameters' gradients into
        ``gradients``, first telling ``read_ahead(layer, reads its input again)`` (where given) of the layer whose
        backward comes next. A layer
        whose input is the layer before's output, untouched, reads it again in backward rather than hold it: one
        chunk's outputs of every layer would otherwise stay alive through backward's pass. Yields a list of the inputs
        that did not require a gradient (a frozen embedding's output), made leaves that do, so that autograd runs back
        through every layer: the caller asks for their gradients too."""
        last, entries = [None], []  # the output the last layer handed on; the leaves made
        reads_input = {}  # layer: whether its backward reads its input again (else holds it)

        def wrapped(index, own):
            def forward(hidden, *args, **kwargs):
                for name, key, value in handed_on(index):
                    kwargs[name][key] = value
                leaves, spec = _pytree.tree_flatten((args, self._placed(kwargs)))
                tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

                def run(hidden, *tensor_leaves):
                    given = list(leaves)
                    for i, tensor in zip(tensors, tensor_leaves):
                        given[i] = tensor
                    args, kwargs = _pytree.tree_unflatten(given, spec)
                    return _hidden_of(own(hidden, *args, **kwargs), self.layers[index])

                if not hidden.requires_grad:
                    hidden = hidden.detach().requires_grad_()
                    entries.append(hidden)
                again = (lambda: read(index - 1)) if index and hidden is last[0] else None
                reads_input[index] = again is not None

                def below():  # what the layer below's backward reads first
                    read_ahead(index - 1, reads_input[index - 1])

                ahead = below if read_ahead is not None and index else None
                layer = _LayerReplay(self.layers[index], run, read(index), again, gradients, ahead)
                last[0] = _ReplayedLayer.apply(layer, hidden, *(leaves[i] for i in tensors))
                return last[0]

            return forward

        with _layers_wrapped(self.layers, wrapped):
            yield entries


class _ChunkPlace:
    """What a layer of a family that reads each token's place in the call off its key/value cache (families.py:
    ``places_from_cache``) is handed as its cache while the step runs a chunk: the chunk's tokens before it in its
    row as the cache's length, and nothing kept (``update`` hands the chunk's keys and values back)."""

    def __init__(self, place: int):
        self.place = place

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.place

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states


class _LayerReplay:
    """What _ReplayedLayer needs of one layer in one chunk: the layer, its forward as a function of its tensors,
    the output forward kept, how to read its input again (None: hold it), where its parameters' gradients go, and
    what to read ahead for the layer below (None: nothing)."""

    def __init__(self, layer: nn.Module, run, output: torch.Tensor, input_again, gradients: dict, read_ahead=None):
        self.layer, self.run, self.output, self.input_again, self.gradients = layer, run, output, input_again, gradients
        self.read_ahead = read_ahead


class _ReplayedLayer(torch.autograd.Function):
    """A decoder layer in backward's pass: forward hands on the output the step's forward kept; backward runs the
    layer's own forward again from its input, with autograd, and returns its input's gradient (and its other
    tensors'), its parameters' added into the step's gradients (one autograd node for the whole step returns them)."""

    @staticmethod
    def forward(ctx, replay, hidden, *tensors):
        ctx.replay, ctx.hidden_dtype = replay, hidden.dtype
        ctx.save_for_backward(*tensors, *((hidden,) if replay.input_again is None else ()))
        output, replay.output = replay.output, None  # held by ctx, the output (whose node ctx is) would be a cycle
        return output.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        replay = ctx.replay
        if replay.read_ahead is not None:  # the layer below's reads, while this one computes
            replay.read_ahead()
        saved = ctx.saved_tensors
        if replay.input_again is None:
            *tensors, hidden = saved
        else:
            tensors, hidden = saved, replay.input_again().to(ctx.hidden_dtype)
        inputs = [t.detach().requires_grad_(need) for t, need in zip((hidden, *tensors), ctx.needs_input_grad[1:])]
        parameters = [p for p in replay.layer.parameters() if p.requires_grad]
        with torch.enable_grad():
            output = replay.run(*inputs)
            wanted = [t for t in inputs if t.requires_grad]
            found = torch.autograd.grad(output, [*wanted, *parameters], grad_output, allow_unused=True)
        add_gradients(replay.gradients, parameters, found[len(wanted) :])
        by_input = iter(found[: len(wanted)])
        return None, *(next(by_input) if t.requires_grad else None for t in inputs)


def add_gradients(gradients: dict, parameters, found) -> None:
    """Add each of ``found`` (None for none) into ``gradients[parameter]``, in at least float32: the model's own
    backward rounds a bfloat16 weight's gradient once, not once a chunk (the step's caller rounds the sum)."""
    for parameter, gradient in zip(parameters, found):
        if gradient is None:
            continue
        if parameter in gradients:
            gradients[parameter].add_(gradient)
        else:
            gradients[parameter] = gradient.to(torch.promote_types(gradient.dtype, torch.float32))


@contextlib.contextmanager
def _layers_wrapped(layers, wrapped):
    """Each layer's forward is ``wrapped(index, its forward)`` inside; what it was after, whatever happens."""
    before = [vars(layer).get("forward") for layer in layers]
    try:
        for index, layer in enumerate(layers):
            vars(layer)["forward"] = wrapped(index, layer.forward)
        yield
    finally:
        for layer, own in zip(layers, before):
            if own is None:
                vars(layer).pop("forward", None)
            else:
                vars(layer)["forward"] = own


def _hidden_of(output, layer: nn.Module) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        from .chunk_seam import Unsupported

        raise Unsupported(f"{type(layer).__name__}'s forward returns a {type(output).__name__}, not its hidden states")
    return output


def packs_documents(model: nn.Module) -> bool:
    """Whether the model's decoder reads packed documents off ``position_ids`` (families.py)."""
    decoder, _ = _decoder_and_layers(model)
    return getattr(family_of(getattr(decoder, "config", None)), "packs_documents", True)


def _decoder_and_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder layers apply finds, and the module that holds them (the decoder: ``model.model``,
    ``model.model.language_model`` in a VLM)."""
    path, layers = _find_layers(model, None)
    return model.get_submodule(path.rpartition(".")[0]), layers


def trained_outside(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trained parameters of ``model`` in neither its decoder nor its output layer (a vision tower's), by name:
    the step gives them no gradient, which is the model's own only where its loss on text does not reach them
    (reached_outside)."""
    decoder, _ = _decoder_and_layers(model)
    ours = {id(p) for module in (decoder, model.get_output_embeddings()) for p in module.parameters()}
    return {name: p for name, p in model.named_parameters() if p.requires_grad and id(p) not in ours}


def reached_outside(model: nn.Module, call: dict) -> str | None:
    """Which of trained_outside(model) the model's own loss on ``call`` (text: the calls the step takes) reaches, or
    None."""
    outside = trained_outside(model)
    if not outside:
        return None
    with torch.enable_grad():
        loss = model(**call, use_cache=False).loss
        found = torch.autograd.grad(loss, list(outside.values()), allow_unused=True)
    reached = next((name for name, gradient in zip(outside, found) if gradient is not None), None)
    return (
        None
        if reached is None
        else f"{reached} is trained, in neither the decoder nor the output layer, and its loss reaches it"
    )


def step_model_problem(model: nn.Module, unreached: frozenset | None = frozenset()) -> str | None:
    """What in ``model`` the step cannot run as described above, or None; ``unreached``: the names of trained
    parameters outside its decoder and output layer that its loss was found not to reach (reached_outside), or None
    where a probe will look (the model's other checks passed)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain nn.Linear"
    try:
        decoder, layers = _decoder_and_layers(model)
    except ValueError as error:
        return str(error).removeprefix("torch_offload.apply: ")
    if decoder is model or not callable(getattr(decoder, "get_input_embeddings", None)):
        return "the module that holds its decoder layers is not a decoder with an input embedding"
    config = getattr(decoder, "config", None)
    family = family_of(config)
    if family is None:
        return f"model type {getattr(config, 'model_type', None)!r} is not one the step was read against (families.py)"
    if family.step is not None:
        return family.step
    if any(module is head for module in decoder.modules()):
        return "its output layer is inside its decoder"
    if any(_attention_of(layer) is None for layer in layers):
        return "a decoder layer has no single attention module"
    if family.places_from_cache and any(
        "cache" not in inspect.signature(getattr(layer, _attention_of(layer)).forward).parameters for layer in layers
    ):  # transformers before 5.24 names it past_key_values and reads places off cache_position
        return "its attention takes no cache argument, through which the step would hand it a chunk's place"
    math = _head_math(model, head)
    if isinstance(math, str):
        return math
    outside = None if unreached is None else next((n for n in trained_outside(model) if n not in unreached), None)
    if outside is not None:
        return f"{outside} is trained and is in neither the decoder nor the output layer"
    embeddings = [m for m in decoder.modules() if isinstance(m, nn.Embedding)]
    if any(embedding.scale_grad_by_freq for embedding in embeddings):
        return "its embedding scales gradients by token frequency (scale_grad_by_freq): a chunk's counts differ"
    if any(embedding.sparse for embedding in embeddings):
        return "its embedding's gradient is sparse (sparse=True): the step's would be dense"
    return None
