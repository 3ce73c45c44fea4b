"""mlx-lm's own functions that mlxq.mlx_lm replaces, kept while enabled:
the replacements call them for everything mlxq does not handle."""

import importlib
from typing import Any, Dict

_originals: Dict[str, Any] = {}


def original(name: str):
    """mlx-lm's own function ``name``: as enable() recorded it, or, before
    any enable(), mlx-lm's module attribute (still its own), so that mlxq's
    replacements also serve calls made without enabling."""
    fn = _originals.get(name)
    if fn is None:
        from .patches import _patch_table  # (patches imports this module)

        module = next(m for m, n, _ in _patch_table() if n == name)
        fn = getattr(importlib.import_module(module), name)
    return fn


def record(functions: Dict[str, Any]) -> None:
    """Remember mlx-lm's functions, by name (enable())."""
    _originals.update(functions)


def recorded() -> Dict[str, Any]:
    """Name -> mlx-lm's function, for every one recorded."""
    return dict(_originals)
