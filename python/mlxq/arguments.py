"""Checks of scalar arguments, shared by the caches and the mlx-lm layer."""

import numbers
import warnings
from typing import Optional

import mlx.core as mx


def as_int(value, name: str, where: str, minimum: Optional[int] = None) -> int:
    """``value`` as an int (also from a 0-d/1-element array), or ValueError."""
    if isinstance(value, mx.array) and value.size == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"[{where}] {name} must be an int, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"[{where}] {name} must be >= {minimum}, got {value}.")
    return int(value)


def dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def renamed(value, old_value, new: str, old: str, where: str, default=None, stacklevel=3):
    """``value``, or ``old_value`` given under the deprecated name ``old``
    (a DeprecationWarning pointing ``stacklevel`` frames up: the caller of
    the function that calls this, by default; a ValueError if both names
    are given)."""
    if old_value is None:
        return value
    warnings.warn(
        f"[{where}] {old} is deprecated and will be removed; use {new}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    if value is not None and value != default and value != old_value:
        raise ValueError(f"[{where}] give {new} or its old name {old}, not both.")
    return old_value
