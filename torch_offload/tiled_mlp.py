"""The MLP block computed in shards of tokens, so that its [tokens, I] intermediate never exists whole.

- ``tiled_mlp``: the ``torch.ops.offload.tiled_mlp`` op (gated or plain MLP, fused activation).
- ``TiledMLP``: wraps a Hugging Face style MLP module so that it calls the op.
- ``tiled_apply``: the generic fallback for any token-wise module (LoRA/PEFT-wrapped, quantized).
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import _require_tensor

__all__ = ["TiledMLP", "tiled_apply", "tiled_mlp", "tiled_mlp_num_shards"]


def tiled_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    *,
    activation: str = "silu",
    num_shards: int = 0,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """``down(act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)) + b_down`` in shards of tokens (differentiable).

    Without ``w_up`` it is the plain MLP ``down(act(x @ w_gate.T + b_gate)) + b_down``.
    ``x`` is ``[..., h]``, ``w_gate``/``w_up`` ``[I, h]``, ``w_down`` ``[h, I]``; ``activation``
    is ``"silu"``, ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``. Forward writes each shard into
    the output and saves only ``x`` and the weights; backward recomputes each shard and
    returns every gradient once (bf16/fp16 weight gradients add up in float32), computing
    none that is not needed. ``num_shards <= 0`` picks the count from a per-shard memory
    budget that depends on the shapes only (see docs/ops.md, "Tiled MLP").
    """
    for value, arg in ((x, "x"), (w_gate, "w_gate"), (w_down, "w_down")):
        _require_tensor(value, "tiled_mlp", arg)
    return torch.ops.offload.tiled_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, num_shards)


def tiled_mlp_num_shards(
    tokens: int, intermediate: int, *, gated: bool = True, dtype: torch.dtype = torch.float32
) -> int:
    """The shard count ``tiled_mlp`` picks for ``num_shards <= 0``.

    A shard holds at most 128 MiB of ``[tokens, I]`` buffers (3 of them for a gated MLP,
    2 for a plain one) and between 2048 and 32768 tokens. It depends on the shapes and
    the dtype only, so every rank with the same shapes picks the same count. Handy to
    give ``tiled_apply`` the count ``tiled_mlp`` would use.
    """
    if torch.compiler.is_compiling():
        return _compiled_num_shards(tokens, intermediate, gated, dtype)
    return torch.ops.offload.tiled_mlp_num_shards(tokens, intermediate, gated, dtype)


# The op's rule (ops/tiled_mlp/tiled_mlp.cpp), for torch.compile: dynamo cannot trace an op that
# returns an int, and ``tokens`` may be symbolic there (dynamic=True); the count then guards
# only on which multiple of the shard size ``tokens`` falls in.
_SHARD_BYTES, _MIN_SHARD_TOKENS, _MAX_SHARD_TOKENS = 128 << 20, 2048, 32768


def _compiled_num_shards(tokens, intermediate: int, gated: bool, dtype: torch.dtype):
    bytes_per_token = max(1, (3 if gated else 2) * intermediate * dtype.itemsize)
    shard_tokens = min(max(_SHARD_BYTES // bytes_per_token, _MIN_SHARD_TOKENS), _MAX_SHARD_TOKENS)
    return max(1, (tokens + shard_tokens - 1) // shard_tokens)


# Activation modules by class name (torch.nn and transformers' ACT2FN classes), by what they compute.
_ACTIVATION_CLASSES = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "ReLU": "relu",
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "AccurateGELUActivation": "gelu_tanh",
}
_ACTIVATION_FUNCTIONS = {F.silu: "silu", F.relu: "relu", torch.relu: "relu", F.gelu: "gelu"}

# (gate, up, down) attribute names of the MLP layouts TiledMLP knows; up is None for plain MLPs.
# The MLPs' projections: gate, up and down; no up: not gated, unless the gate is a fused gate_up_proj (Phi-3), which
# holds the gate's rows, then the up projection's: the op takes the two halves of its weight as views.
_LAYOUTS = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", None, "down_proj"), ("fc1", None, "fc2"))


def _activation_name(act) -> str:
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    name = _ACTIVATION_CLASSES.get(type(act).__name__) or _ACTIVATION_FUNCTIONS.get(act)
    if name is None:
        raise ValueError(
            f"TiledMLP: activation {act!r} is not one tiled_mlp computes (silu, gelu, gelu_tanh, relu); "
            "use torch_offload.tiled_apply for this module instead"
        )
    return name


def _activation_of(mlp: nn.Module):
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def _is_plain_linear(module) -> bool:
    # module.forward, not its class's: accelerate's hooks (dispatch_model, cpu_offload) replace it on
    # the instance, and leave the bound nn.Linear.forward there when removed. Reading it is what
    # dynamo guards on: a hook added after compiling recompiles.
    forward = getattr(module, "forward", None)
    if (
        not isinstance(module, nn.Linear)
        or not isinstance(forward, types.MethodType)
        or module._forward_hooks
        or module._forward_pre_hooks
    ):
        return False
    if torch.compiler.is_compiling():
        # dynamo reads no bound method's __func__ or __self__: the class's forward it must be (an instance's
        # bound method, a removed hook's leftover, is then taken as not plain).
        return "forward" not in module.__dict__ and type(module).forward is nn.Linear.forward
    return forward.__func__ is nn.Linear.forward and forward.__self__ is module


def _check_linear(module, attr: str) -> None:
    # Anything but a plain nn.Linear (LoRA layers, quantized linears, hooks) would be bypassed by the op.
    if not _is_plain_linear(module):
        raise ValueError(
            f"TiledMLP: {attr} is {type(module).__name__}, not a plain nn.Linear without hooks "
            "(LoRA-wrapped or quantized?); use torch_offload.tiled_apply for this module instead"
        )


def _first_argument(name: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    """A call's first argument, passed by position or as ``name``, and the rest of the call."""
    if args:
        return args[0], args[1:], kwargs
    if name not in kwargs:
        raise TypeError(f"forward() missing its first argument {name!r}")
    kwargs = dict(kwargs)
    return kwargs.pop(name), args, kwargs


def _mlp_width(mlp: nn.Module) -> int:
    # The intermediate size, for the automatic shard count of tiled_apply.
    return max(max(p.shape) for p in mlp.parameters())


def _module_in_shards(
    fn: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, x: torch.Tensor, num_shards: int
) -> torch.Tensor:
    """``fn(x)`` through ``tiled_apply`` with ``module``'s trainable parameters; 0 shards: tiled_mlp's count."""
    shards = num_shards or tiled_mlp_num_shards(x.numel() // x.shape[-1], _mlp_width(module), dtype=x.dtype)
    return tiled_apply(fn, x, [p for p in module.parameters() if p.requires_grad], shards)


class TiledMLP(nn.Module):
    """A Hugging Face style MLP computed by ``tiled_mlp``, with the same parameters.

    ``mlp`` has ``gate_proj``/``up_proj``/``down_proj`` (LLaMA, Mistral, Qwen), ``gate_up_proj``/``down_proj``
    (Phi-3: the gate's rows, then the up projection's) or ``fc1``/``fc2`` (plain MLP) ``nn.Linear`` layers and
    its activation in ``act_fn`` or ``activation_fn``. The wrapper holds the very children of ``mlp`` (the same
    ``_modules``), so ``layer.mlp = TiledMLP(layer.mlp)`` keeps the state dict's keys and
    the optimizer's parameters, and a layer replaced in one after wrapping (PEFT's
    ``get_peft_model``) is replaced in both. While a layer is not a plain ``nn.Linear``
    without hooks, or the activation is not the one seen here, calls run ``mlp``'s own
    forward in shards (``tiled_apply``), since the op would bypass it. Other modules: ``tiled_apply``.
    """

    def __init__(self, mlp: nn.Module, num_shards: int = 0):
        super().__init__()
        layout = next((names for names in _LAYOUTS if all(hasattr(mlp, n) for n in names if n)), None)
        if layout is None:
            raise ValueError(
                f"TiledMLP: {type(mlp).__name__} has none of gate_proj/up_proj/down_proj, gate_up_proj/down_proj "
                "and fc1/fc2; "
                "use torch_offload.tiled_apply for this module instead"
            )
        act = _activation_of(mlp)
        if act is None:
            raise ValueError(f"TiledMLP: {type(mlp).__name__} has no act_fn or activation_fn")
        self.activation = _activation_name(act)
        object.__setattr__(self, "_activation_fn", act)  # not a child: it is one of mlp's already
        for attr in layout:
            if attr:
                _check_linear(getattr(mlp, attr), attr)
        if layout[0] == "gate_up_proj" and mlp.gate_up_proj.out_features % 2:
            raise ValueError(
                f"TiledMLP: {type(mlp).__name__}.gate_up_proj has {mlp.gate_up_proj.out_features} rows, not two "
                "halves; use torch_offload.tiled_apply for this module instead"
            )
        parameters = list(inspect.signature(mlp.forward).parameters.values())
        if len(parameters) != 1 or parameters[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            raise ValueError(
                f"TiledMLP: {type(mlp).__name__}.forward takes {inspect.signature(mlp.forward)}, not "
                "one input; use torch_offload.tiled_apply for this module instead"
            )
        self.input_name = parameters[0].name  # callers may pass it by that name
        self.layer_names = tuple(attr for attr in layout if attr)
        self._layout = layout
        self.num_shards = num_shards
        self._modules = mlp._modules  # shared: see the class docstring
        self.training = mlp.training
        object.__setattr__(self, "_wrapped", mlp)  # not a child: its children are already ours

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """The wrapped MLP's one input, by position or by the name its own forward gives it."""
        x, args, kwargs = _first_argument(self.input_name, args, kwargs)
        if args or kwargs:
            raise TypeError(
                f"TiledMLP.forward() takes one argument, {self.input_name!r}; got {1 + len(args) + len(kwargs)}"
            )
        gate, up, down = layers = [getattr(self, attr) if attr else None for attr in self._layout]
        if (
            not all(_is_plain_linear(layer) for layer in layers if layer is not None)
            or _activation_of(self._wrapped) is not self._activation_fn
        ):  # replaced since: the op's is not it
            return _module_in_shards(self._wrapped, self, x, self.num_shards)
        w_gate, b_gate = gate.weight, gate.bias
        w_up, b_up = (up.weight, up.bias) if up is not None else (None, None)
        if self._layout[0] == "gate_up_proj":
            w_gate, w_up = w_gate.chunk(2)
            b_gate, b_up = b_gate.chunk(2) if b_gate is not None else (None, None)
        return tiled_mlp(
            x,
            w_gate,
            w_up,
            down.weight,
            activation=self.activation,
            num_shards=self.num_shards,
            b_gate=b_gate,
            b_up=b_up,
            b_down=down.bias,
        )

    def train(self, mode: bool = True) -> TiledMLP:
        self._wrapped.training = mode  # not our child: model.train()/eval() would miss it (copies restore it)
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, num_shards={self.num_shards}"


def tiled_apply(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Iterable[torch.Tensor], num_shards: int
) -> torch.Tensor:
    """``fn(x)`` computed in ``num_shards`` shards of tokens, recomputed shard by shard in backward.

    The generic fallback of ``tiled_mlp`` for any token-wise module (LoRA/PEFT-wrapped,
    quantized): ``fn`` maps ``[rows, h]`` to ``[rows, h_out]`` treating each row (token)
    independently; ``x`` is ``[..., h]``, flattened to its tokens. ``params`` are the
    tensors ``fn`` uses that need gradients, e.g. ``[p for p in m.parameters() if
    p.requires_grad]``: backward computes them with ``torch.autograd.grad`` per shard,
    adds them up (in float32 for bf16/fp16) and returns each once from one autograd node,
    so DDP's and FSDP's hooks fire once. The random state and the autocast state are
    replayed, so dropout in ``fn`` draws the same masks and the recompute runs in the same
    dtypes. Forward saves only ``x``.
    """
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"tiled_apply: num_shards is {num_shards!r}; expected an int >= 1")
    _require_tensor(x, "tiled_apply", "x")
    if torch.compiler.is_compiling():
        return _checkpointed_shards(fn, x, num_shards)
    return _TiledApply.apply(fn, num_shards, 1, x, *params)


def _checkpointed_shards(fn, x: torch.Tensor, num_shards: int) -> torch.Tensor:
    # Under torch.compile, which cannot trace _TiledApply (random state, autograd.grad in
    # backward): each shard is a non-reentrant checkpoint, which dynamo lowers to its
    # activation-checkpoint op, so forward keeps only x and backward recomputes shard by
    # shard. tensor_split gives num_shards pieces for any token count, so the graph does
    # not depend on it (dynamic=True); pieces are empty when there are fewer tokens.
    flat = _token_rows(x)
    ys = [torch.utils.checkpoint.checkpoint(fn, rows, use_reentrant=False) for rows in flat.tensor_split(num_shards)]
    y = torch.cat(ys)
    return y.reshape(*x.shape[:-1], *y.shape[1:])


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    # [..., h] as [tokens, h]; reshape(-1, h) cannot infer the tokens when h is 0.
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _shards(tokens: int, num_shards: int):
    rows = max(1, math.ceil(tokens / num_shards))
    return [(start, min(rows, tokens - start)) for start in range(0, tokens, rows)]


class _TiledApply(torch.autograd.Function):
    """``fn`` over shards of rows of its ``num_rows`` first tensors (the first, ``x``, as ``[tokens, h]``; the
    others, as a mixture of experts' routing, already ``[tokens, ...]``), recomputed shard by shard in backward,
    where the gradients of the row tensors that need one and of the parameters that follow them are taken."""

    @staticmethod
    def forward(ctx, fn, num_shards, num_rows, *tensors):
        x, others, params = tensors[0], tensors[1:num_rows], tensors[num_rows:]
        rows_of = [_token_rows(x), *others]
        ctx.fn, ctx.num_shards, ctx.num_rows, ctx.params = fn, num_shards, num_rows, params
        ctx.rng_states = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        device_type = x.device.type
        ctx.autocast = {
            "device_type": device_type,
            "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type),
        }
        ctx.save_for_backward(x, *others)
        shards = _shards(rows_of[0].shape[0], num_shards)
        # The output is made in its final shape, not returned as a view: a caller may add to
        # it in place (Falcon's mlp_output += attention_output), which autograd refuses on a
        # view made inside a Function.
        if not shards:
            y = fn(*rows_of)
            return y.new_empty((*x.shape[:-1], *y.shape[1:]))
        out = rows_out = None
        for start, rows in shards:
            y = fn(*(t.narrow(0, start, rows) for t in rows_of))
            if out is None:
                out = y.new_empty((*x.shape[:-1], *y.shape[1:]))
                rows_out = out.view(rows_of[0].shape[0], *y.shape[1:])
            rows_out.narrow(0, start, rows).copy_(y)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *others = ctx.saved_tensors
        rows_of = [_token_rows(x.detach()), *(t.detach() for t in others)]
        grad_flat = _token_rows(grad_out)
        want_rows = list(ctx.needs_input_grad[3 : 3 + ctx.num_rows])
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3 + ctx.num_rows :]) if need]
        reduced = (torch.bfloat16, torch.float16)
        sums = [
            torch.zeros_like(ctx.params[i], dtype=torch.float32 if ctx.params[i].dtype in reduced else None)
            for i in wanted
        ]
        grad_rows = [torch.zeros_like(t) if want else None for t, want in zip(rows_of, want_rows)]
        cpu_state, cuda_state = ctx.rng_states
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, x.device)
            for start, rows in _shards(rows_of[0].shape[0], ctx.num_shards):
                shards = [t.narrow(0, start, rows).detach().requires_grad_(w) for t, w in zip(rows_of, want_rows)]
                with torch.enable_grad(), torch.autocast(**ctx.autocast):
                    y = ctx.fn(*shards)
                inputs = [s for s, w in zip(shards, want_rows) if w] + [ctx.params[i] for i in wanted]
                grads = list(torch.autograd.grad(y, inputs, grad_flat.narrow(0, start, rows), allow_unused=True))
                for grad_row in grad_rows:
                    grad = grads.pop(0) if grad_row is not None else None
                    if grad is not None:
                        grad_row.narrow(0, start, rows).copy_(grad)
                for total, grad in zip(sums, grads):
                    if grad is not None:
                        total.add_(grad)
        param_grads = [None] * len(ctx.params)
        for i, total in zip(wanted, sums):
            param_grads[i] = total.to(ctx.params[i].dtype)
        grad_x = grad_rows[0].view_as(x) if grad_rows[0] is not None else None
        return None, None, None, grad_x, *grad_rows[1:], *param_grads
