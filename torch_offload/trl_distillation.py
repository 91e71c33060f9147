"""TRL's DistillationTrainer's divergence through the ``token_divergence`` op, for TorchOffloadCallback.

TRL 1.16's DistillationTrainer compares the student's and the teacher's heads with ``ChunkedDivergenceFunction``
(``_chunked_divergence_loss``): off a GPU with Triton, tiles of 4096 tokens x 32768 vocabulary rows, two float32
buffers of 512 MiB, and every elementwise step a separate pass over them. Its calls go through ``token_divergence``
instead (tiles of at most 8 MiB per head), with TRL's own masking, reduction and metrics around them; calls whose
heads differ in dtype outside autocast keep TRL's kernel, which casts each tile. The stand-in is put in
``trl.trainer.distillation_trainer`` for the time of training and taken out after.
"""

from __future__ import annotations

import torch

from ._trl_stand_in import install_stand_in

# The arguments ChunkedDivergenceFunction.forward takes, in order, as the tested TRL versions call it.
_ARGUMENTS = (
    "ctx",
    "student_hidden",
    "student_weight",
    "student_bias",
    "teacher_hidden",
    "teacher_weight",
    "teacher_bias",
    "beta",
    "temperature",
    "student_logit_scale",
    "student_final_logit_softcapping",
    "teacher_logit_scale",
    "teacher_final_logit_softcapping",
)


class TokenDivergenceHead:
    """Stands in for ``ChunkedDivergenceFunction`` (its ``apply`` alone, which is all TRL calls). ``calls`` counts
    the calls the op served."""

    def __init__(self, original) -> None:
        self.original = original
        self.calls = 0

    def apply(
        self,
        student_hidden,
        student_weight,
        student_bias,
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        beta,
        temperature=1.0,
        student_logit_scale=1.0,
        student_final_logit_softcapping=None,
        teacher_logit_scale=1.0,
        teacher_final_logit_softcapping=None,
    ):
        args = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
        dtypes = {t.dtype for t in args if t is not None}
        if len(dtypes) > 1 and not torch.is_autocast_enabled(student_hidden.device.type):
            return self.original.apply(
                *args,
                beta,
                temperature,
                student_logit_scale,
                student_final_logit_softcapping,
                teacher_logit_scale,
                teacher_final_logit_softcapping,
            )
        self.calls += 1
        return torch.ops.offload.token_divergence(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            student_bias=student_bias,
            teacher_bias=teacher_bias,
            beta=float(beta),
            temperature=float(temperature),
            student_softcap=float(student_final_logit_softcapping or 0.0),
            student_logit_scale=float(student_logit_scale),
            teacher_softcap=float(teacher_final_logit_softcapping or 0.0),
            teacher_logit_scale=float(teacher_logit_scale),
        )


def distills(args) -> bool:
    """Whether ``args`` is TRL's DistillationConfig (or derives from it)."""
    return any(cls.__module__.startswith("trl.") and cls.__name__ == "DistillationConfig" for cls in type(args).__mro__)


def install(caller: str, args=None):
    """Under TRL's DistillationTrainer (``args`` its config): puts the stand-in in place of TRL's function and
    returns it with the undo, or warns and returns (None, None) where the installed TRL is not a version whose code
    path this matches. Under other trainers: (None, None)."""
    if args is None or not distills(args):
        return None, None
    import trl.trainer.distillation_trainer as distillation_trainer

    return install_stand_in(
        distillation_trainer,
        "ChunkedDivergenceFunction",
        _ARGUMENTS,
        TokenDivergenceHead,
        caller,
        "distillation loss",
        "token_divergence",
    )
