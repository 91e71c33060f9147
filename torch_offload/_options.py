"""Checks of the options users pass by keyword: each names the option and what it expected.

Python's truthiness would otherwise read ``"no"`` as True, ``True`` as the int 1, and the
dispatcher would report a path or a size of the wrong type as "argument '_6'".
"""

from __future__ import annotations

import os
from typing import Any


def check_bool(value: Any, name: str, caller: str, *, none_ok: bool = False) -> bool | None:
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        expected = "True, False or None" if none_ok else "True or False"
        raise TypeError(f"{caller}: {name} must be {expected}, got {value!r}")
    return value


def check_int(value: Any, name: str, caller: str, *, minimum: int = 0, none_ok: bool = False) -> int | None:
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int subclass: True is not 1 byte
        expected = "an int" + (" or None" if none_ok else "")
        raise TypeError(f"{caller}: {name} must be {expected}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{caller}: {name} must be an int >= {minimum}, got {value}")
    return value


def check_path(value: Any, name: str, caller: str) -> str | None:
    """A str or os.PathLike (pathlib.Path) as a str; None stays None."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{caller}: {name} must be a str or os.PathLike path, got {value!r} ({type(value).__name__})")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{caller}: {name} must be a text path, got bytes {path!r}")
    return path
