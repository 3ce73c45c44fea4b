"""mlx-lm's own functions that mlxq.mlx_lm replaces, kept while enabled:
the replacements call them for everything mlxq does not handle."""

from typing import Any, Dict

_originals: Dict[str, Any] = {}


def original(name: str):
    """mlx-lm's own function ``name`` (recorded by enable())."""
    return _originals[name]


def record(functions: Dict[str, Any]) -> None:
    """Remember mlx-lm's functions, by name (enable())."""
    _originals.update(functions)


def recorded() -> Dict[str, Any]:
    """Name -> mlx-lm's function, for every one recorded."""
    return dict(_originals)
