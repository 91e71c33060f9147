"""Puts a stand-in in place of one of TRL's autograd Functions for the time of training, where the installed TRL
is a version whose code path the stand-in matches (trl_fused_head, trl_distillation)."""

from __future__ import annotations

import inspect
import warnings

# The TRL versions whose Functions the stand-ins were tested against.
TESTED_VERSIONS = ("1.16.",)


def tested_versions() -> str:
    """The tested versions, as a warning names them ("1.16.x")."""
    return ", ".join(version + "x" for version in TESTED_VERSIONS)


def install_stand_in(module, name: str, arguments: tuple[str, ...], make_stand_in, caller: str, what: str, op: str):
    """Puts ``make_stand_in(original)`` at ``module.<name>`` and returns it with the undo (which puts the original
    back unless something else replaced the stand-in since), where the installed TRL is a tested version and the
    original's ``forward`` takes ``arguments``; else warns that TRL's ``what`` is left as it is (it goes through
    ``op`` in the tested versions only) and returns (None, None)."""
    import trl

    original = getattr(module, name, None)
    forward = getattr(original, "forward", None)
    matches = (
        trl.__version__.startswith(TESTED_VERSIONS)
        and callable(forward)
        and tuple(inspect.signature(forward).parameters) == arguments
    )
    if not matches:
        warnings.warn(
            f"{caller}: TRL {trl.__version__}'s {what} is left as it is (it goes through {op} in TRL "
            f"{tested_versions()} only)",
            UserWarning,
            stacklevel=4,
        )
        return None, None
    stand_in = make_stand_in(original)
    setattr(module, name, stand_in)

    def undo():
        if getattr(module, name, None) is stand_in:
            setattr(module, name, original)

    return stand_in, undo
