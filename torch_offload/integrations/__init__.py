"""One call for Hugging Face style causal LMs: ``torch_offload.apply(model)``.

Finds the language model's decoder layers by structure (a ``ModuleList`` of layers that
each have an ``mlp``, looked for inside ``model.get_decoder()`` where the model has one,
so that a vision tower's blocks are not mistaken for them), computes each MLP in shards
of tokens where a probe shows that this leaves its output unchanged, and runs each layer
under offloaded non-reentrant checkpointing (with the disk tier, only its attention is
recomputed and the rest of what it saves goes to disk). ``.remove()`` on the returned
handle restores the model.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

from torch import nn

from .. import masking
from ..causal_lm_loss import fuse_causal_lm_loss
from .chunk_recurrent_route import install_step_route
from .compiled import _offload_in_compiled_graphs
from .handle import OffloadHandle, _refuse_patched
from .implementations import _use_segment_masks
from .layer_loop import install_layer_loop
from .layer_wrapping import _wrap_layer
from .layers import _find_layers, _mlp_name
from .mlp import _recorded_outputs, _tile_mlp
from .norms import fuse_norms
from .options import (
    _check_arguments,
    _check_offload_options,
    _offload_context,
    _on_accelerator,
    _resolve_checkpoint,
    _resolve_keep_last,
    _resolve_offload,
    check_option_names,
)
from .plan import LAYERS, STEP, Plan, plan_route
from .report import summary_line
from .sequence_parallelism import _attend_over_ranks, _sequence_parallel_group

__all__ = ["apply", "OffloadHandle"]

_log = logging.getLogger(__name__)


def check_apply_option_names(names: Any, caller: str) -> None:
    """check_option_names against everything apply() takes by keyword, for callers that pass options on to it."""
    own = tuple(name for name in inspect.signature(apply).parameters if name not in ("model", "offload_options"))
    check_option_names(names, caller, own)


def apply(
    model: nn.Module,
    *,
    tiled_mlp: bool = True,
    checkpoint: bool | str = True,
    offload: str | None = "auto",
    num_shards: int = 0,
    keep_last: int | None = None,
    layers: str | None = None,
    loss: bool = True,
    attention_block: bool = True,
    rms_norm: bool = True,
    sequence_parallel: Any = None,
    chunk_recurrent: bool = True,
    **offload_options,
) -> OffloadHandle:
    """Make ``model`` (a Hugging Face style causal LM or VLM) train with less memory, in place.

    - ``layers``: the decoder layers' path (e.g. ``"model.layers"``); by default the
      ``nn.ModuleList`` whose every module has an ``mlp``, inside ``model.get_decoder()``
      where the model has one (the language model of a VLM). None found, or several:
      ValueError.
    - ``tiled_mlp``: every layer's MLP runs in shards of tokens where a probe at apply time
      (the module's own forward on random weights) shows the result is the same: through
      the ``tiled_mlp`` op (``TiledMLP``) for gate/up/down (or Phi-3's fused gate_up) or
      fc1/fc2 ``nn.Linear`` MLPs that compute exactly the op's function, through ``tiled_apply``
      around the module's own forward for other token-wise MLPs (LoRA/PEFT-wrapped, quantized,
      GPT-2's Conv1D, Gemma3n's activation sparsity). A mixture of
      experts, whose router logits the model records, stays whole with its experts module in
      shards (``"tiled_experts"``) where a probe allows, or else, where the block is token by
      token, the whole block in shards with its outputs whole (``"tiled_block"``). MLPs that are not token-wise stay as
      they are, with a warning. ``num_shards=0`` chooses per call.
    - ``checkpoint``: what backward recomputes (non-reentrant checkpointing, DDP-safe):
      ``"layer"``: each decoder layer, whose inputs alone are saved; ``"attention"``: each
      layer's attention module alone, while everything else the layer saves goes to the
      offload tier (needs one), so that backward holds one attention's activations instead
      of a whole layer's, at the cost of more bytes moved; True: ``"attention"`` with
      ``offload="disk"``, ``"layer"`` otherwise; False: none. A layer without exactly one
      attention child module (class name ending in ``Attention``) is checkpointed whole.
    - ``offload``: "cpu" sends saved activations of device tensors to host memory,
      "disk" sends every saved activation (CPU tensors included) to the disk tier,
      None keeps them in place; "auto" is "cpu" for a model on an accelerator and "disk"
      for a model in host memory (where "cpu" would move nothing), None there if the spill
      directory is on a RAM file system and ``allow_tmpfs`` is not set. The last ``keep_last``
      layers keep theirs on the device, recomputed whole: backward needs them first; but a layer
      whose MLP stays untiled is offloaded too, as a recomputed layer would hold all of its MLP's
      activations at once. ``keep_last=None`` (the default) is 0 where ``checkpoint`` resolves to
      ``"attention"`` (a last layer recomputed whole would be the step's peak), 1 otherwise.
    - ``loss``: a call with ``labels`` and gradients computes the loss with the
      ``linear_cross_entropy`` op from the final hidden states, never materializing the
      ``[tokens, vocab]`` logits (the output's ``logits`` is None then; calls without
      gradients, as evaluation, run the model's own head and loss); transformers' label shift, ``ignore_index``,
      ``num_items_in_batch``, tied embeddings and the logits' soft-capping or scaling are
      honoured, and a probe at apply time checks the loss against the model's own, on padded
      rows and with ``num_items_in_batch`` too (a model that does not match keeps its own, with
      a warning). Calls without labels are unchanged.
    - ``attention_block``: in every layer apply checkpoints or offloads, the attention module
      runs through the ``attention_block`` op (one group of heads at a time; backward saves
      only the module's input and recomputes each group) where a probe at apply time shows
      the module computes exactly that (the four ``nn.Linear`` projections with rotary
      embeddings and causal attention, as Llama, Mistral and Qwen2; no config option the op
      lacks, as ``clip_qkv``; probes at input scales 1, 16 and 256), and where a call is plain
      causal SDPA attention (no mask, no key/value cache, no dropout, no argument that
      changes attention); other calls and
      modules keep their own forward (``handle.attention`` says which modules and why; a call
      with a cache warns). In a layer checkpointed whole this adds one attention forward to
      backward. With it, a model of a tested family (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3,
      GPT-2, Qwen3-MoE, Mixtral) whose attention implementation is ``"sdpa"`` gets
      ``torch_offload.masking``'s, so that packed documents (``position_ids`` restarting) and
      padded rows (``attention_mask``) reach the attention as segment ids, never as a dense
      ``[batch, 1, T, T]`` mask, eager and under ``torch.compile``: the op takes them, and
      modules it does not replace run the ``segment_attention`` op. Masks it cannot describe (a
      sliding window within reach, overlays, a cache) are built dense as before and counted in
      ``handle.mask_fallbacks`` (uncounted under compile).
    - ``rms_norm``: each layer's RMSNorms and the one after the layers run through the ``rms_norm`` op
      where a probe at apply time shows the module's own forward gives the op's output bit for bit
      (transformers' ``LlamaRMSNorm`` and its copies; not Gemma's ``1 + weight``, nor a float64 model's,
      which transformers computes in float32): backward then holds the input's gradient alone, where
      autograd through the module holds five of its size (``handle.norms`` says which and why not).
    - The loop over the layers: where every layer is offloaded with only its attention recomputed (the disk tier's
      default), without sequence parallelism, in a family whose decoder forward is Llama's (Llama, Mistral without
      a sliding window, Qwen2, Qwen3, Gemma, SmolLM3, Mixtral, Qwen3-MoE, DeepSeek-V3) built as Llama's, and where a
      probe at apply time shows apply's loop gives the decoder's own output bit for bit, apply runs the loop itself
      in training calls with gradients, no cache, no recorded outputs and no hooks on the layers, so that neither
      the embeddings nor a layer's input stay alive past their last use (``handle.layer_loop`` says which loop
      runs, and why; docs/apply.md, "The loop over the layers").
    - ``chunk_recurrent``: apply first plans one route (``handle.route``). On a CPU, with the options above as their
      defaults (the disk tier, no option only the layers' path reads, no sequence parallelism, the loss fused), for a
      model whose decoder and output layer the step runs, where a probe at apply time shows the step's loss is the
      model's own on one row, padded rows, packed documents and with ``num_items_in_batch``, the route is the
      chunk-recurrent step (``chunk_recurrent_loss``'s): a training call with labels runs the whole step in chunks
      of 2048 tokens kept in a file in the spill directory, through the model's own modules, in memory that does not
      grow with the sequence; apply installs the fused loss and the step's forward, and nothing on the layers, so
      any other call (evaluation, no labels, a hook on a module, autocast, ``torch.compile``, a cache or logits
      asked for, attention the step does not compute yet: soft-capped scores, sinks, a window shorter than the
      batch) runs the model's own layers with the fused loss. ``handle.chunk_recurrent`` says whether it is on and
      why not, ``handle.chunk_recurrent_calls`` counts its calls (docs/apply.md, "The chunk-recurrent step").
      Otherwise the route is the layers' path, described above.
    - ``sequence_parallel``: a ``torch.distributed`` ProcessGroup (or a 1-D DeviceMesh, or a
      mesh's dimension ``mesh["sp"]``) whose ranks each hold a contiguous chunk of every row's
      tokens, as ``torch_offload.shard_batch(batch, group)`` gives them; call the model with
      that batch. Attention runs over the whole rows for a share of the heads between two
      all-to-alls, within the whole rows' documents and padding: modules ``attention_block``
      computes run it with the group (one head group at a time, recomputed in backward), the
      others keep their own forwards (projections, norms, rotary embedding with the whole rows'
      ``position_ids``) with their core attention through the ``ulysses_attention`` op
      (``handle.attention`` says which). The fused loss
      is the whole batch's on every rank (``num_items_in_batch``, else the group's count of
      labelled tokens), and after backward the ranks' gradients add up to one process's on the
      whole batch. Needs a model of a tested family with ``"sdpa"`` attention (``"eager"`` gives a query
      with no key to attend, as a left-padded row's pads, another output than SDPA), its
      loss fused, query heads a multiple of the ranks; no cache, attention dropout, sliding
      window shorter than the rows or rotary embedding scaled by a call's largest position
      ("dynamic", "longrope"). Calls with labels compute the fused loss under ``no_grad`` too
      (no logits in evaluation).
    - A checkpointed call never carries a key/value cache (backward's recomputation would
      fill it a second time): in training mode a layer handed an empty cache runs without
      it (``use_cache=False``, with a warning), as transformers' gradient checkpointing
      does, and the model returns an empty cache; a call whose cache holds tokens, or in
      eval mode, runs the layer un-checkpointed. Calls without gradients fill it as usual.
    - ``torch.compile(model, fullgraph=True)`` afterwards traces in one graph: each layer is
      a checkpoint in the graph and, with offloading, the compiled graphs hand the saved
      activations the offloaded layers use to the same store (``torch_offload::store_pack``
      and ``store_unpack`` nodes). Compile the model itself, not a function that calls it.
    - ``offload_options`` go to ``offload_activations`` (``min_bytes``,
      ``max_host_bytes``, ``prefetch_bytes``, ``spill_directory``...); for a model in host memory
      with ``offload="disk"``, ``prefetch_bytes`` is 16 MiB and ``prefetch_over_budget`` False unless
      given (a saved tensor over the read-ahead is read when backward asks for it). An unknown one is a
      TypeError naming it; one the configuration would ignore (any of them without a tier,
      ``spill_directory`` or ``allow_tmpfs`` with ``offload="cpu"``) is a ValueError.

    Every forward apply installs presents the original's signature (``functools.wraps``), which
    ``generate()`` and Trainer read.

    Returns a handle (see ``OffloadHandle``): ``handle.remove()`` restores the model,
    ``handle.stats()`` counts, ``print(handle)`` shows what each layer got and why not more (logged at
    INFO level by the ``torch_offload`` logger too). Applying twice to the same layers is refused.
    """
    _check_arguments(
        offload,
        {
            "tiled_mlp": tiled_mlp,
            "loss": loss,
            "attention_block": attention_block,
            "rms_norm": rms_norm,
            "chunk_recurrent": chunk_recurrent,
        },
        keep_last,
        num_shards,
    )
    # The layers, then the options resolved and checked against each other.
    layer_path, layer_list = _find_layers(model, layers)
    names = [f"{layer_path}.{index}" for index in range(len(layer_list))]
    _refuse_patched(names, layer_list)
    group = _sequence_parallel_group(sequence_parallel, loss)
    requested, offload = offload, _resolve_offload(model, offload, offload_options)
    _check_offload_options(offload_options, offload, requested, _on_accelerator(model))
    recompute = _resolve_checkpoint(checkpoint, offload)
    keep_last = _resolve_keep_last(keep_last, recompute)
    context = _offload_context(model, offload, offload_options)  # checks the options and the spill directory
    plan = plan_route(
        model,
        chunk_recurrent=chunk_recurrent,
        loss=loss,
        sequence_parallel=group is not None,
        offload=offload,
        recompute=recompute,
        keep_last=keep_last,
        layers=layers,
        layer_path=layer_path,
        layers_path_options=dict(
            tiled_mlp=tiled_mlp, attention_block=attention_block, rms_norm=rms_norm, num_shards=num_shards
        ),
        offload_options=offload_options,
    )
    if plan.route == STEP:
        installed = _install_step(model, layer_path, layer_list, plan, offload, offload_options)
        if isinstance(installed, OffloadHandle):
            return installed
        plan = Plan(LAYERS, installed)
    handle = OffloadHandle(layer_path, layer_list, offload, context)
    handle.chunk_recurrent = f"off: {plan.why}"
    if group is not None:
        handle.sequence_parallel, handle._sequence_parallel_ranks = group.group_name, group.size()
    # The plan: every layer's MLP tiled (where a probe allows), each layer checkpointed as `recompute`
    # says, and with a tier, all but the last keep_last layers offloaded. Installed, or nothing is.
    offloaded = set(range(len(layer_list) - keep_last)) if handle.context is not None else set()
    handle._model_name, handle._offloaded = type(model).__name__, offloaded
    handle._options = {
        "tiled_mlp": tiled_mlp,
        "attention_block": attention_block,
        "keep_last": keep_last,
        "rms_norm": rms_norm,
        "chunk_recurrent": chunk_recurrent,
    }
    try:
        _install_layers(handle, model, names, layer_list, recompute, offloaded, tiled_mlp, num_shards, attention_block)
        if rms_norm:
            fuse_norms(handle, model, names, layer_list)
        above = dict(attention_block=attention_block, loss=loss)
        _install_above_layers(handle, model, names, layer_list, group, offloaded, **above)
        if not handle._patches:
            raise ValueError(
                f"torch_offload.apply: nothing to change in {layer_path} with tiled_mlp={tiled_mlp}, "
                f"checkpoint={checkpoint}, offload={offload!r}, keep_last={keep_last}"
                + (f" (MLPs: {sorted(set(handle.mlp_tiling.values()))})" if handle.mlp_tiling else "")
            )
    except BaseException:
        handle.remove()
        raise
    _warn_what_stays(handle)
    if _log.isEnabledFor(logging.INFO):
        _log.info("%s", summary_line(handle.report()))
    return handle


def _install_step(
    model: nn.Module,
    layer_path: str,
    layers: nn.ModuleList,
    plan: Plan,
    offload: str | None,
    offload_options: dict[str, Any],
) -> OffloadHandle | str:
    """The step's route (plan.py): the fused loss and the step's forward, nothing on the layers; or, where the fused
    loss refuses the model (nothing installed then), why not."""
    handle = OffloadHandle(layer_path, layers, offload, None)
    handle._model_name, handle.route = type(model).__name__, STEP
    try:
        handle.chunk_recurrent = install_step_route(handle, model, plan.owner, plan.output_type, offload_options)
    except BaseException:
        handle.remove()
        raise
    if handle.chunk_recurrent != "on":
        handle.remove()
        return handle.chunk_recurrent.removeprefix("off: ")
    if _log.isEnabledFor(logging.INFO):
        _log.info("%s", summary_line(handle.report()))
    return handle


def _install_layers(
    handle: OffloadHandle,
    model: nn.Module,
    names: list[str],
    layers: nn.ModuleList,
    recompute: str | None,
    offloaded: set[int],
    tiled_mlp: bool,
    num_shards: int,
    attention_block: bool,
) -> None:
    """Each layer in turn: its MLP tiled, then its forward checkpointed and/or offloaded."""
    recorded = _recorded_outputs(model) if tiled_mlp else {}
    for index, (name, layer) in enumerate(zip(names, layers)):
        mlp = _mlp_name(layer)
        offload_layer = index in offloaded
        if tiled_mlp and mlp is not None:
            streamed = offload_layer and recompute != "layer"  # what it saves comes back from the tier one by one
            _tile_mlp(handle, f"{name}.{mlp}", layer, mlp, num_shards, recorded, streamed)
            if (
                not offload_layer
                and handle.context is not None
                and recompute != "layer"
                and handle.mlp_tiling[f"{name}.{mlp}"].startswith("untiled")
            ):
                # A kept layer is recomputed whole in backward, so an MLP in no shards (Llama 4's mixtures)
                # would rebuild all its activations at once: streamed from the tier, they come back one by one.
                offloaded.add(index)
                offload_layer = True
                _tile_mlp(handle, f"{name}.{mlp}", layer, mlp, num_shards, recorded, streamed=True)
        if recompute or offload_layer:
            _wrap_layer(handle, index, name, layer, recompute, offload_layer, attention_block)


def _install_above_layers(
    handle: OffloadHandle,
    model: nn.Module,
    names: list[str],
    layers: nn.ModuleList,
    group: Any,
    offloaded: set[int],
    *,
    attention_block: bool,
    loss: bool,
) -> None:
    """What the model gets above its layers: segment-id masks, the fused loss, attention over the
    sequence-parallel group's ranks, the loop over the layers, and the offload in compiled graphs (last: its
    forward hands compiled code what it calls)."""
    if group is not None:
        handle._masks = "each rank's real-token flags, the whole rows' segments gathered (sequence_parallel)"
    elif attention_block:
        handle._masks = _use_segment_masks(handle, model)
    else:
        handle._masks = "the model's own (attention_block=False)"
    if loss:
        handle.loss = fuse_causal_lm_loss(handle, model, handle.sequence_parallel)
        for config, _, _ in handle._attention_implementations:  # the loss probe's masks are apply's, not the user's
            masking.forget(config)
    if group is not None:
        _attend_over_ranks(handle, model, names, layers, group)
    handle.layer_loop = install_layer_loop(handle, model)
    if handle.context is not None:
        _offload_in_compiled_graphs(handle, model, offloaded)


def _warn_what_stays(handle: OffloadHandle) -> None:
    """apply()'s warnings (attributed to its caller) for a loss and MLPs that stay the model's own."""
    if handle.loss.startswith("unfused"):
        warnings.warn(
            f"torch_offload.apply: the loss stays the model's own ({handle.loss.removeprefix('unfused: ')})",
            UserWarning,
            stacklevel=3,
        )
    untiled = {name: how for name, how in handle.mlp_tiling.items() if how.startswith("untiled")}
    if untiled:
        first, how = next(iter(untiled.items()))
        warnings.warn(
            f"torch_offload.apply: {len(untiled)} of {len(handle.mlp_tiling)} MLPs stay untiled "
            f"({first}: {how.removeprefix('untiled: ')}); see handle.mlp_tiling",
            UserWarning,
            stacklevel=3,
        )
