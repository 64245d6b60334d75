"""The shared argument checks: ints, positive numbers, ranges, token counts, choices.

Every check names the argument and the offending value in its error, and raises ``PlanError`` unless
told another error type (``error=TraceError``, ``error=ValueError``, ...). ``bool`` is never an int
here: ``True`` is rejected wherever an int is asked for (``is_int``), although Python treats it as 1.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from .errors import PlanError

__all__ = ["is_int", "is_number", "check_int", "check_count", "check_optional_int", "check_positive",
           "check_nonnegative", "check_range", "check_bool", "check_choice", "check_token_counts", "check_index_range"]


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python or numpy integer (``bool`` and ``np.bool_`` are not)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> bool:
    """Whether ``value`` is a real number (int, float, numpy scalar), ``bool`` excluded."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: object, lo: int = 0, hi: int | None = None, *,
              error: type[Exception] = PlanError) -> int:
    """``int(value)``; ``error`` naming ``name`` and the value unless it is an int (not bool) in ``[lo, hi]``."""
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise error(f"{name}={value!r} must be an int {bound}")
    return int(value)


def check_count(name: str, value: object, lo: int = 1, *, error: type[Exception] = PlanError) -> int:
    """``check_int`` with the message of a count field: ``"NAME must be a positive int, got VALUE"`` (``lo`` = 1),
    ``"NAME must be an int >= LO, got VALUE"`` otherwise (trace, spec and layer-shape fields)."""
    if not is_int(value) or value < lo:
        bound = "a positive int" if lo == 1 else f"an int >= {lo}"
        raise error(f"{name} must be {bound}, got {value!r}")
    return int(value)


def check_optional_int(name: str, value: object, lo: int = 0, *, error: type[Exception] = PlanError) -> int | None:
    """``check_int`` for a value that may also be None (returned as None)."""
    return None if value is None else check_int(name, value, lo, error=error)


def check_bool(name: str, value: object, *, error: type[Exception] = PlanError) -> bool:
    """``bool(value)``; ``error`` naming ``name`` and the value unless it is a ``bool`` or ``np.bool_``."""
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_positive(name: str, value: object, *, error: type[Exception] = PlanError) -> float:
    """``float(value)``; ``error`` naming ``name`` and the value unless it is a finite number > 0."""
    if not is_number(value) or not (np.isfinite(value) and value > 0):
        raise error(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def check_nonnegative(name: str, value: object, *, error: type[Exception] = PlanError) -> float:
    """``float(value)``; ``error`` naming ``name`` and the value unless it is a finite number >= 0."""
    if not is_number(value) or not (np.isfinite(value) and value >= 0):
        raise error(f"{name}={value!r} must be a finite number >= 0")
    return float(value)


def check_range(name: str, value: object, lo: float, hi: float, *, what: str = "a finite number", unit: str = "",
                error: type[Exception] = PlanError) -> float:
    """``float(value)``; ``error`` naming ``name``, the value and the accepted range unless it is a finite number in
    ``[lo, hi]`` (``what`` and ``unit`` describe it in the message: ``"NAME must be WHAT in [LO, HI] UNIT, got V"``)."""
    if not is_number(value) or not (np.isfinite(value) and lo <= value <= hi):
        raise error(f"{name} must be {what} in [{lo:g}, {hi:g}]{' ' + unit if unit else ''}, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, allowed: Collection[Any], *, error: type[Exception] = PlanError) -> Any:
    """``value``; ``error`` naming ``name`` and the value unless it is one of ``allowed``."""
    if isinstance(value, bool) or value not in allowed:
        raise error(f"{name}={value!r} is not one of {tuple(allowed)}")
    return value


def check_token_counts(name: str, x: np.ndarray, *, error: type[Exception] = PlanError) -> None:
    """Raise ``error`` naming the first entry of ``x`` (any shape, tokens) that is not finite and >= 0."""
    x = np.asarray(x)
    bad = ~np.isfinite(x) | (x < 0)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise error(f"{name}[{', '.join(map(str, i))}] = {x[i]}: token counts must be finite and >= 0")


def check_index_range(name: str, a: np.ndarray, lo: int, hi: int, *, error: type[Exception] = PlanError) -> None:
    """Raise ``error`` naming the first entry of the int array ``a`` outside ``[lo, hi)``."""
    a = np.asarray(a)
    bad = (a < lo) | (a >= hi)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise error(f"{name}[{', '.join(map(str, i))}] = {a[i]} is outside [{lo}, {hi})")
