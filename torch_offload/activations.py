"""Activation offloading: saved activations wait for backward on the host.

The hooks here are thin: ``torch.classes.offload.ActivationStore`` (C++) decides
what to offload, deduplicates storages, keeps the host budget, prefetches during
backward and counts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree

from ._options import check_bool, check_int, check_path

__all__ = ["offload_activations", "checkpoint"]

_TIERS = ("cpu", "disk")
_active = threading.local()  # per thread, like PyTorch's saved-tensor hooks


def _active_stack() -> list:
    if not hasattr(_active, "stack"):
        _active.stack = []
    return _active.stack


class offload_activations:
    """Context manager that moves saved activations to the host until backward needs them.

    Every tensor autograd saves inside the context goes through ``offload_pack``
    and comes back through ``offload_unpack``, except:

    - parameters (leaves that require grad) and views of them, and the storages of
      ``module``'s parameters and buffers when ``module`` is given;
    - tensors smaller than ``min_bytes``;
    - CPU tensors, unless ``offload_cpu_tensors`` (default: True with ``tier="disk"``,
      False with ``tier="cpu"``, where host to host only costs a copy);
    - what bytes, sizes and strides cannot rebuild exactly: tensor subclasses, sparse,
      quantized, nested and zero tensors, functorch wrappers (conjugate and negative
      views are rebuilt with their bit).

    Tensors that share a storage (views, expanded tensors, the same tensor saved
    twice) are offloaded once while the storage is unchanged (same version counter,
    same version), and rebuilt exactly; a view spanning at most a quarter of its
    storage is offloaded alone, only the bytes it spans. Host memory is used up to
    ``max_host_bytes``; past it a tensor goes to disk with ``tier="disk"``
    (``torch_offload.disk_spill``) and stays on its device with ``tier="cpu"``.
    During backward the tensors packed just before the one being unpacked are
    restored ahead of need, up to ``prefetch_bytes`` in flight (the next one always,
    however large, unless ``prefetch_over_budget=False``). Host copies and
    disk space are freed with the graph.

    Args:
        min_bytes: smallest tensor (in bytes) worth offloading.
        max_host_bytes: most host bytes held at once by this context; None: no limit
            with tier="cpu", no host copies at all with tier="disk".
        prefetch_bytes: most bytes restored ahead of need during backward (at least the
            next tensor, even a larger one, with prefetch_over_budget); 0 disables it.
        prefetch_over_budget: restore the next tensor ahead even when it alone is over
            prefetch_bytes (True, the default: a GPU's copy then overlaps compute); False: a
            tensor over the budget is restored when backward asks for it.
        tier: where activations wait: "cpu" (host memory) or "disk" (host memory up to
            max_host_bytes, then the spill file).
        spill_directory, allow_tmpfs: where the disk tier writes, as for ``disk_spill``.
        offload_cpu_tensors: offload tensors that already live on the CPU too; None
            (default): only with tier="disk".
        module: a module (or list of modules) whose parameters and buffers are never offloaded.
    """

    def __init__(
        self,
        *,
        min_bytes: int = 1 << 20,
        max_host_bytes: int | None = None,
        prefetch_bytes: int = 64 << 20,
        prefetch_over_budget: bool = True,
        tier: str = "cpu",
        offload_cpu_tensors: bool | None = None,
        module: torch.nn.Module | list[torch.nn.Module] | None = None,
        spill_directory: str | os.PathLike | None = None,
        allow_tmpfs: bool = False,
    ):
        if tier not in _TIERS:
            raise ValueError(f"offload_activations: tier must be one of {_TIERS}, got {tier!r}")
        caller = "offload_activations"
        min_bytes = check_int(min_bytes, "min_bytes", caller)
        max_host_bytes = check_int(max_host_bytes, "max_host_bytes", caller, none_ok=True)
        prefetch_bytes = check_int(prefetch_bytes, "prefetch_bytes", caller)
        prefetch_over_budget = check_bool(prefetch_over_budget, "prefetch_over_budget", caller)
        offload_cpu_tensors = check_bool(offload_cpu_tensors, "offload_cpu_tensors", caller, none_ok=True)
        spill_directory = check_path(spill_directory, "spill_directory", caller)
        allow_tmpfs = check_bool(allow_tmpfs, "allow_tmpfs", caller)
        if tier == "cpu" and (spill_directory is not None or allow_tmpfs):
            raise ValueError(
                "offload_activations: spill_directory and allow_tmpfs would be ignored with tier='cpu' "
                "(only tier='disk' writes to disk)"
            )
        if max_host_bytes is None:
            max_host_bytes = 0 if tier == "disk" else -1
        if offload_cpu_tensors is None:
            offload_cpu_tensors = tier == "disk"  # the disk tier exists to take RAM off the host too
        self._store = torch.classes.offload.ActivationStore(
            min_bytes,
            max_host_bytes,
            prefetch_bytes,
            prefetch_over_budget,
            offload_cpu_tensors,
            tier == "disk",
            spill_directory,
            allow_tmpfs,
        )
        # The store's cheap decisions, taken in _pack without crossing into C++.
        self._min_bytes = min_bytes
        self._keep_cpu_tensors = not offload_cpu_tensors
        self._store_pack = self._store.pack
        modules = [] if module is None else [module] if isinstance(module, torch.nn.Module) else list(module)
        self._skipped = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks] = []

    def _pack(self, tensor: torch.Tensor) -> Any:
        # Most tensors left in place are told apart here, at a fraction of the
        # cost of a call into the store: subclasses (Parameter included) and
        # non-strided tensors, CPU tensors when those stay, small tensors, and
        # parameters' views. The store decides the rest.
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or (self._keep_cpu_tensors and tensor.is_cpu)
            or tensor.nbytes < self._min_bytes
        ):
            return _saved_as_is(tensor)
        base = tensor._base
        root = tensor if base is None else base
        if root.requires_grad and root.is_leaf:
            return _saved_as_is(tensor)
        return self._store_pack(tensor)

    def __enter__(self) -> offload_activations:
        if not self._hooks:
            self._store.skip_storages_of(self._skipped)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        _active_stack().append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _active_stack().pop()
        self._hooks.pop().__exit__(*exc_info)
        if not self._hooks:
            self._store.clear_skipped_storages()

    def keep(self, tensor: torch.Tensor) -> Any:
        """``tensor`` kept for backward as this context keeps a saved tensor (through its tier, or where it is when the
        tier leaves it there), inside the context or not; ``restore_kept`` gives it back."""
        return self._pack(tensor)

    def stats(self) -> dict[str, int]:
        """Counters: pack_calls (saved tensors that reached the store), packed_bytes
        (host and disk), unpacked_bytes (read back), live_bytes (served from the original
        storage, which something else still held), dedup_hits, refreshed_bytes (older copies made
        again when their storage was saved through another version counter or version),
        kept_on_device_bytes, disk_bytes,
        prefetch_hits, prefetch_scanned (entries the prefetch looked at), peak_host_bytes,
        host_bytes (held now) and live_entries."""
        return dict(self._store.stats())


def _saved_as_is(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    # Detached: an output must not own itself. Autograd stops checking versions
    # once hooks are installed, so the version is kept for _unpack to check.
    return tensor.detach(), tensor._version


def _unpack(saved: Any) -> torch.Tensor:
    if type(saved) is tuple:
        tensor, version = saved
        if tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{tensor.dtype} {list(tensor.shape)}] is at version {tensor._version}; expected "
                f"version {version} instead (it was saved for backward, then changed in place)"
            )
        return tensor
    return saved.unpack()


def restore_kept(kept: Any) -> torch.Tensor:
    """What ``offload_activations.keep`` kept, back where it was."""
    return _unpack(kept)


def checkpoint(fn: Callable, *args, offload: bool = True, **kwargs):
    """Non-reentrant ``torch.utils.checkpoint`` whose saved inputs are offloaded.

    Only the layer's inputs are saved (everything inside is recomputed in
    backward), through the ordinary saved-tensor mechanism, so with
    ``offload=True`` they go to the host: through the innermost active
    ``offload_activations`` context, or a default one for this call. With
    ``offload=False`` they stay on the device even inside an offload context:
    use it for the last layer(s), whose activations backward needs first, e.g.
    ``checkpoint(layer, x, offload=(i < len(layers) - 1))``.

    Non-reentrant checkpointing keeps DDP's hooks firing once per parameter;
    ``use_reentrant=True`` is refused.
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError("torch_offload.checkpoint: use_reentrant=True is not supported (it breaks DDP)")
    options = {key: kwargs.pop(key) for key in _CHECKPOINT_OPTIONS if key in kwargs}
    call, tensors = _tensors_as_arguments(fn, args, kwargs)
    run = lambda: torch.utils.checkpoint.checkpoint(call, *tensors, use_reentrant=False, **options)  # noqa: E731
    if not offload and torch.compiler.is_compiling():
        # dynamo cannot enter saved-tensor hooks; the checkpoint it compiles saves
        # the inputs in the graph, where no offload context reaches them anyway.
        return run()
    if not offload:
        with torch.autograd.graph.saved_tensors_hooks(_saved_as_is, _unpack):
            return run()
    if _active_stack():
        return run()
    with offload_activations():
        return run()


# torch.utils.checkpoint's own keyword arguments; every other one is the function's.
_CHECKPOINT_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


def _tensors_as_arguments(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, list]:
    """``fn`` as a function of the tensors in ``args`` and ``kwargs`` alone.

    torch.utils.checkpoint saves only top-level positional tensors through the
    saved-tensor mechanism; tensors in keyword arguments or inside tuples (a decoder
    layer's ``hidden_states=`` and ``position_embeddings=(cos, sin)``) it holds by
    reference, so no offload context would ever see them.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]  # holds no tensor
    # The forward gets the caller's own lists and dicts, as with torch.utils.checkpoint, so
    # what fn appends to them (aux losses, router logits) reaches the caller; taken at that
    # call, so that recomputation, which gets copies, does not keep them alive. (dynamo traces
    # no closure mutation in a checkpoint: a compiled forward gets copies too.)
    callers = [] if torch.compiler.is_compiling() else [(args, kwargs)]

    def call(*tensors):
        if callers:
            call_args, call_kwargs = callers.pop()
            return fn(*call_args, **call_kwargs)
        filled = list(others)
        for i, tensor in zip(where, tensors):
            filled[i] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
        return fn(*call_args, **call_kwargs)

    return call, [leaves[i] for i in where]
