"""TRL's fused LM head through the ``token_logprobs`` op, for TorchOffloadCallback.

TRL 1.16's trainers (GRPO, DPO, RLOO, KTO, SFT) patch the model with ``add_fused_lm_head``: a call with
``fused_lm_head=True`` runs the backbone and scores the positions with ``ChunkedLogProbFunction``, which holds
tiles of 4096 tokens x 32768 vocabulary rows of logits (512 MiB in bf16) and float32 accumulators. Calls with
the head in the hidden states' dtype go through ``token_logprobs`` instead (8 MiB tiles, float64 kept in
float64; soft-capping and a logit scale, Gemma 2's and Cohere's, as TRL applies them), and the metrics they ask
for (mean logits, top-1, log sum of squared probabilities) through ``token_logprob_summaries``; SFT's call
(log-probabilities, entropy and top-1 at temperature 1, no logit scale) goes through one pass of
``linear_cross_entropy_with_statistics`` instead of those two; the others
(a head cast to float32 against bf16 hidden states, outputs the op does not compute) keep TRL's. The stand-in is put in
``trl.trainer.utils`` for the time of training and taken out after.
"""

from __future__ import annotations

import collections
import warnings

import torch

from ._trl_stand_in import install_stand_in, tested_versions

# The arguments TRL's function's forward takes, in order, as the tested TRL versions call it.
_ARGUMENTS = (
    "ctx",
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)
# TRL's trainers that score tokens with per-token log-probabilities (their configurations' class names).
_RL_CONFIGS = {
    "BCOConfig",
    "CPOConfig",
    "DPOConfig",
    "GRPOConfig",
    "KTOConfig",
    "NashMDConfig",
    "OnlineDPOConfig",
    "ORPOConfig",
    "PPOConfig",
    "RLOOConfig",
    "XPOConfig",
}
_SUMMARIES = ("log_sum_sq_probs", "mean_logits", "is_top1")
_OURS = {"log_probs", "entropy", *_SUMMARIES}
# What linear_cross_entropy's loss per token (-log p) and statistics give in one pass.
_CROSS_ENTROPY_PASS = {"log_probs", "entropy", "is_top1"}


class _EntropyWithoutGradient(torch.autograd.Function):
    """The entropy of one pass of linear_cross_entropy's statistics, which have no gradient, placed in the graph
    so that a backward through it raises instead of giving none. TRL's entropy has one; SFTTrainer only logs it
    (detached), so its backward never comes here."""

    @staticmethod
    def forward(ctx, entropy, hidden):
        return entropy.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "TorchOffloadCallback: the entropy of TRL's fused LM head has no gradient where the head is asked for "
            "log-probabilities, entropy and top-1 only (one pass of linear_cross_entropy's statistics, for SFT's "
            "metrics); token_logprobs' entropy has one, and serves a head asked for another output too (mean_logits)"
        )


class TokenLogprobsHead:
    """Stands in for ``ChunkedLogProbFunction`` (its ``apply`` alone, which is all TRL calls). ``calls`` counts
    the calls the ops served, ``ops`` the calls of each op."""

    def __init__(self, original) -> None:
        self.original = original
        self.calls = 0
        self.ops = collections.Counter()

    def apply(
        self,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        final_logit_softcapping=None,
        logit_scale=1.0,
        outputs=("log_probs",),
    ):
        # TRL's cast_lm_head_to_fp32 hands a float32 hidden to a bf16/fp16 head, which the op refuses (one dtype):
        # TRL's kernel casts each tile.
        mixed = weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype)
        if mixed or not set(outputs) <= _OURS:
            return self.original.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        self.calls += 1
        entropy = "entropy" in outputs
        if "is_top1" in outputs and set(outputs) <= _CROSS_ENTROPY_PASS and temperature == 1 and logit_scale == 1:
            self.ops["linear_cross_entropy_with_statistics"] += 1
            loss, _, accuracy, entropies = torch.ops.offload.linear_cross_entropy_with_statistics(
                hidden, weight, bias, targets, softcap=float(final_logit_softcapping or 0.0), reduction="none"
            )
            if entropy and torch.is_grad_enabled() and hidden.requires_grad:
                entropies = _EntropyWithoutGradient.apply(entropies, hidden)
            return -loss, entropies if entropy else None, None, None, accuracy.bool()
        scoring = dict(
            bias=bias,
            temperature=float(temperature),
            softcap=float(final_logit_softcapping or 0.0),
            logit_scale=float(logit_scale),
        )
        self.ops["token_logprobs"] += 1
        logprobs, entropies = torch.ops.offload.token_logprobs(hidden, weight, targets, entropy=entropy, **scoring)
        summaries = {}
        if any(name in outputs for name in _SUMMARIES):
            self.ops["token_logprob_summaries"] += 1
            mean_logits, is_top1, log_sum_sq_probs = torch.ops.offload.token_logprob_summaries(
                hidden, weight, targets, **scoring
            )
            summaries = {"log_sum_sq_probs": log_sum_sq_probs, "mean_logits": mean_logits, "is_top1": is_top1}
        # TRL's fields: log-probabilities, entropy, log sum of squared probabilities, mean logit, top-1.
        return (
            logprobs,
            entropies if entropy else None,
            *(summaries[name] if name in outputs else None for name in _SUMMARIES),
        )


def _has_trl_fused_head(model) -> bool:
    """Whether model.forward, or a PEFT model's base model's (which TRL patches), is TRL's add_fused_lm_head forward
    (it takes ``fused_lm_head``), or wraps it: under bf16/fp16 mixed precision accelerate wraps the forward in
    autocast and a float32 cast of its outputs, each naming what it wraps in ``__wrapped__``. The whole chain is
    read, not its end: TRL's own forward names the model class's forward as what it wraps."""
    get_base_model = getattr(model, "get_base_model", None)
    for candidate in (model, get_base_model() if callable(get_base_model) else None):
        function, seen = getattr(candidate, "forward", None), set()
        while function is not None and id(function) not in seen:
            seen.add(id(function))
            function = getattr(function, "__func__", function)  # a bound method's function
            code = getattr(function, "__code__", None)
            if code is not None and "fused_lm_head" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
                return True
            function = getattr(function, "__wrapped__", None)
    return False


def _rl_trainer_config(args) -> str | None:
    """The name of TRL's configuration class of a trainer that scores tokens with log-probabilities, if ``args``
    is one (or derives from one)."""
    for cls in type(args).__mro__:
        if cls.__module__.startswith("trl.") and cls.__name__ in _RL_CONFIGS:
            return cls.__name__
    return None


def scores_tokens(model, args) -> bool:
    """Whether the trainer scores tokens through TRL's fused LM head or under an RL configuration: calls without
    labels, which the chunk-recurrent step does not take."""
    return _has_trl_fused_head(model) or _rl_trainer_config(args) is not None


def install(model, caller: str, args=None):
    """Where a TRL trainer gave ``model`` its fused LM head: puts the stand-in in place of TRL's function and
    returns it with the undo, or warns and returns (None, None) where the installed TRL is not a version whose
    code path this matches. A model without it: (None, None), with a warning under an RL trainer's ``args``
    (TRL before 1.16 scores tokens from the whole logits, which the callback does not reach)."""
    if not _has_trl_fused_head(model):
        config = _rl_trainer_config(args)
        if config is not None:
            import trl

            warnings.warn(
                f"{caller}: under TRL {trl.__version__}'s {config} the model has no fused LM head, so the trainer "
                "scores tokens from the model's whole [tokens, vocabulary] logits, which is left as it is "
                f"(token_logprobs serves TRL {tested_versions()}'s fused head only)",
                UserWarning,
                stacklevel=3,
            )
        return None, None
    import trl.trainer.utils as trl_utils

    return install_stand_in(
        trl_utils, "_ChunkedLogProbFunction", _ARGUMENTS, TokenLogprobsHead, caller, "fused LM head", "token_logprobs"
    )
